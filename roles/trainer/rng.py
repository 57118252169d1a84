"""A process's random-number state (python, numpy, torch CPU and CUDA) as JSON types.

Checkpoints store it so that a resumed process draws the numbers the uninterrupted one
would have drawn. The trainers and the PPO driver each save their own process's state.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict:
    """{"python", "numpy", "torch", "cuda"}: lists of ints, JSON-serialisable."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": [version, list(internal), gauss],
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])},
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state().tolist(),
        # Only when CUDA is already in use: querying it would otherwise initialise a context.
        "cuda": ([s.tolist() for s in torch.cuda.get_rng_state_all()]
                 if torch.cuda.is_available() and torch.cuda.is_initialized() else []),
    }


def restore_rng(state: dict) -> None:
    """Undo `capture_rng`. A CUDA state needs as many visible GPUs as were saved."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state({**np_state, "state": {"key": np.array(np_state["state"]["key"], dtype=np.uint32),
                                               "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"]:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(state["cuda"]):
            raise ValueError(f"the checkpoint holds the CUDA RNG state of {len(state['cuda'])} GPUs "
                             f"but this process sees {have}; resume on the same GPU layout")
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
