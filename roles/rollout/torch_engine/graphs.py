"""CUDA-graph capture and replay of the decode step, one graph per (batch size, shape key).

A decode step reads and writes only preallocated tensors (the slot state, the KV cache,
the weights' storages), so its graph is replayed as is: new tokens come in through the
state tensors, new weights through in-place copies into the same storages. A replay reads
the addresses the capture saw, so the step is built once per key and kept with its graph:
whatever it holds lives as long as the graph does (a step built again each round would
free what the cached graph still reads). Anything that changes those addresses (releasing
the weights or the KV cache) must `free()` the graphs first; they are captured again
lazily, at the first step that needs each batch size.

All graphs share one memory pool, accounted under the "cuda_graph" tag. Off on the CPU
and on fake GPUs: `run` then calls the step it built for the key, the same path without
the capture.

At most `max_graphs` are kept; the least recently replayed one is dropped to make room.
A key holds the batch size, the cache geometry (slot length: each generate call's longest
prompt + max_new_tokens, rounded) and the sampling mode, so a long PPO run whose prompt
lengths vary would otherwise keep one set of graphs per geometry it ever met. A dropped
graph's blocks go back to the shared pool, where the next capture reuses them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import torch

from roles.device import DeviceMemory

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def batch_bucket(n: int, max_slots: int) -> int:
    """The graph batch size that serves n rows: the smallest listed size >= n (or max_slots)."""
    return next((b for b in BATCH_SIZES if b >= n and b <= max_slots), max_slots)


class DecodeGraphs:
    def __init__(self, memory: DeviceMemory, *, enabled: bool, max_graphs: int = 32):
        if max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs} must be >= 1")
        self.memory = memory
        self.enabled = enabled and memory.kind == "cuda"
        self.max_graphs = max_graphs
        # key -> (the step, its graph: None when disabled); oldest use first
        self._graphs: OrderedDict[Hashable, tuple[Callable[[], None], torch.cuda.CUDAGraph | None]] = OrderedDict()
        self._pool = None
        self._reserved_before: int | None = None
        self.num_captures = 0

    def run(self, key: Hashable, build: Callable[[], Callable[[], None]], state: list[torch.Tensor]) -> None:
        """Run the decode step of `key` once: replay its graph, building the step by `build()`
        and capturing it first if `key` has none.

        `state` lists the tensors the step updates in place; the warm-up run before a capture
        is undone on them so that capturing does not advance the decode.
        """
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.max_graphs:
                if self.enabled:
                    torch.cuda.synchronize()  # the oldest graph may still be replaying
                while len(self._graphs) >= self.max_graphs:
                    self._graphs.popitem(last=False)
            step = build()
            entry = self._graphs[key] = (step, self._capture(step, state) if self.enabled else None)
        else:
            self._graphs.move_to_end(key)
        step, graph = entry
        if graph is None:
            step()
        else:
            graph.replay()

    def _capture(self, step: Callable[[], None], state: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._reserved_before = torch.cuda.memory_reserved()
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, cuBLAS handles
            step()
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step()
        self.num_captures += 1
        self.memory.account("cuda_graph", max(0, torch.cuda.memory_reserved() - self._reserved_before))
        return graph

    def free(self) -> None:
        """Drop every step, its graph and the pool; memory goes back to the driver."""
        had = bool(self._graphs) or self._pool is not None
        self._graphs.clear()
        self._pool = None
        if had and self.memory.kind == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.memory.account("cuda_graph", 0)
