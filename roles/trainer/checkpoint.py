"""Trainer checkpoints: a directory written atomically (temp dir, then rename).

    model.safetensors   master weights by name (HF names for the actor)
    optimizer.pt        torch optimizer state_dict (AdamW moments, step counts, lr groups)
    trainer_state.json  {"step": optimizer steps taken, "rng": the process's RNG state}

The LR schedule is a function of the step (roles.trainer.schedule), so the step is its state.

A reader never sees a half-written directory under the final name. A crash while saving
leaves a `.tmp-*` sibling to delete, and the previous checkpoint under its name or, if the
crash falls between the two renames of `replace_dir`, in a `.old-*` sibling.

Durability: a rename is atomic for the processes that watch, but after a power loss the
file system may hold the new name with empty or missing files unless the data reached the
disk first. So every file and the temp directory are fsynced before the rename, and the
parent directory (which records the rename) after it (`sync_tree`, `sync_dir`).

`save_hf_checkpoint` writes the other format: what `AutoModelForCausalLM.from_pretrained`
reads (weights in the compute dtype, and the source checkpoint's config and tokenizer).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
TRAINER_FILES = (WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE)
# Files of an HF checkpoint dir that hold weights; everything else (config, tokenizer,
# generation config, custom modeling code) is copied into an HF export as is.
_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".index.json")


@dataclass(frozen=True, kw_only=True)
class TrainerCheckpoint:
    weights: dict[str, torch.Tensor]
    optimizer: dict
    step: int
    rng: dict


def sync_dir(path: str) -> None:
    """fsync a directory: makes the names created, renamed or removed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str) -> None:
    """fsync every file under `root`, then each directory, deepest first, `root` last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in sorted(filenames):
            sync_file(os.path.join(dirpath, name))
        sync_dir(dirpath)


def replace_dir(tmp: str, path: str) -> None:
    """Rename the finished directory `tmp` to `path`, replacing any directory there; the
    contents of `tmp` are made durable first and the rename after (see the module doc)."""
    sync_tree(tmp)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path):
        os.rename(tmp, path)
        sync_dir(parent)
        return
    # Directories cannot be replaced in one rename: move the old one aside first.
    old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
    os.rename(path, os.path.join(old, "ckpt"))
    os.rename(tmp, path)
    sync_dir(parent)
    shutil.rmtree(old)


def _write_atomically(path: str, fill) -> None:
    """Create a temp sibling of `path`, let `fill(tmp)` write into it, then rename it over `path`."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        fill(tmp)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(path: str, *, weights: dict[str, torch.Tensor], optimizer: dict, step: int, rng: dict) -> None:
    def fill(tmp: str) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, os.path.join(tmp, WEIGHTS_FILE))
        torch.save(optimizer, os.path.join(tmp, OPTIMIZER_FILE))
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump({"step": step, "rng": rng}, f)

    _write_atomically(path, fill)


def load_checkpoint(path: str) -> TrainerCheckpoint:
    """What save_checkpoint wrote; FileNotFoundError names the missing files."""
    missing = [f for f in TRAINER_FILES if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(f"{path} is not a trainer checkpoint: missing {missing}")
    with open(os.path.join(path, STATE_FILE)) as f:
        state = json.load(f)
    return TrainerCheckpoint(
        weights=load_file(os.path.join(path, WEIGHTS_FILE)),
        optimizer=torch.load(os.path.join(path, OPTIMIZER_FILE), map_location="cpu", weights_only=True),
        step=state["step"], rng=state["rng"])


def save_hf_checkpoint(path: str, *, weights: dict[str, torch.Tensor], source: str) -> None:
    """An HF checkpoint dir: `weights` (HF names) as model.safetensors, plus every non-weight
    file of the `source` HF dir (config.json, tokenizer files, generation_config.json).

    The architecture does not change in training, so the source's config is the right one;
    the model's own config is not saved because the trainer edits it (use_cache=False).
    """
    def fill(tmp: str) -> None:
        for name in sorted(os.listdir(source)):
            src = os.path.join(source, name)
            if os.path.isfile(src) and not name.endswith(_HF_WEIGHT_SUFFIXES):
                shutil.copy2(src, os.path.join(tmp, name))
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, os.path.join(tmp, WEIGHTS_FILE),
                  metadata={"format": "pt"})

    _write_atomically(path, fill)
