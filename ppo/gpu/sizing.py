"""What the memory plan is computed from, before any role starts: the GPU's memory and the
model spec of --hf-checkpoint."""

from __future__ import annotations

import os

from ppo.config import PPOConfig
from ppo.config.schema import GENERATED_PREFIX
from ppo.model_shapes import ARCHS, tiny_config_fields
from roles.model_spec import ModelSpec

FAKE_GPU_BYTES = 80 << 30  # the memory of each fake GPU (--fake-gpus), on every node
# The dry run's bound on a prompt when --rollout-max-prompt-len is unset; a run plans with
# its data's longest prompt (ppo.setup.job).
DEFAULT_PROMPT_LEN = 512


def compute_dtype(cfg: PPOConfig) -> str:
    """The roles' compute dtype: float32 on fake GPUs (the CPU computes), bfloat16 on GPUs."""
    return "float32" if cfg.placement.fake_gpus else "bfloat16"


def compute_dtype_bytes(cfg: PPOConfig) -> int:
    """Bytes per element of `compute_dtype` (known here without importing torch)."""
    return {"float32": 4, "bfloat16": 2}[compute_dtype(cfg)]


def gpu_capacity_bytes() -> int | None:
    """Memory of GPU 0 that processes can take, as nvidia-smi reports it: its total less what the
    driver reserves (the H100's 79.65 GiB less 0.47, the 79.18 GiB CUDA reports); the driver
    process makes no CUDA context of its own, which would hold GPU memory for the whole run.
    None without a GPU."""
    import subprocess

    def query(field: str) -> int:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) << 20

    try:
        total = query("memory.total")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    try:
        return total - query("memory.reserved")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):  # drivers before 510 lack the field
        return total


def plan_spec(cfg: PPOConfig) -> ModelSpec | None:
    """The spec of --hf-checkpoint without loading it: a generated model's, a local checkpoint's
    config.json, or, for a path that does not exist here but is named after an architecture
    `python -m ppo.make_model` knows (/root/models/Qwen3-4B), that architecture's published
    config; None otherwise (the dry run then has no memory plan to show)."""
    path = cfg.checkpoint.hf_checkpoint
    if path.startswith(GENERATED_PREFIX):
        return ModelSpec.from_hf(tiny_config_fields())
    if os.path.exists(os.path.join(path, "config.json")):
        return ModelSpec.from_checkpoint(path)
    arch = os.path.basename(path.rstrip("/")).lower()
    return ModelSpec.from_hf({"model_type": "qwen3", **ARCHS[arch]}) if arch in ARCHS else None
