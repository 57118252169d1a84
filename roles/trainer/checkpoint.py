"""Trainer checkpoints: a directory written atomically (temp dir, then rename).

    model.safetensors   master weights by name (HF names for the actor)
    optimizer.pt        torch optimizer state_dict (AdamW moments, step counts, lr groups)
    trainer_state.json  {"step": optimizer steps taken}

A reader never sees a half-written directory under the final name. A crash while saving
leaves a `.tmp-*` sibling to delete, and the previous checkpoint under its name or, if the
crash falls between the two renames, in a `.old-*` sibling.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


def save_checkpoint(path: str, *, weights: dict[str, torch.Tensor], optimizer: dict, step: int) -> None:
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, os.path.join(tmp, WEIGHTS_FILE))
        torch.save(optimizer, os.path.join(tmp, OPTIMIZER_FILE))
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump({"step": step}, f)
        if os.path.exists(path):
            # Directories cannot be replaced in one rename: move the old one aside first.
            old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
            os.rename(path, os.path.join(old, "ckpt"))
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(weights, optimizer state_dict, step) from a directory written by save_checkpoint."""
    missing = [f for f in (WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE) if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(f"{path} is not a trainer checkpoint: missing {missing}")
    weights = load_file(os.path.join(path, WEIGHTS_FILE))
    optimizer = torch.load(os.path.join(path, OPTIMIZER_FILE), map_location="cpu", weights_only=True)
    with open(os.path.join(path, STATE_FILE)) as f:
        step = json.load(f)["step"]
    return weights, optimizer, step
