"""One handle for a trainer role's rank group: the driver calls it as it called one trainer.

THE RANK CONTRACT (torch and megatron backends). Both backends and the supervisor rely on
it; why its less obvious parts are so is at the end of this docstring.

Processes
    A trainer role with placement gpus [g0, ..., gN-1] is N processes, started by
    `Supervisor.spawn_group(role, cls, config, gpus=...)`. Rank i is named f"{role}.{i}"
    ("actor.1"; its error file is RUN_DIR/errors/actor.1.<incarnation>.txt), sees only
    gpus[i] (CUDA_VISIBLE_DEVICES=g_i: its device is cuda:0, or its one fake GPU) and
    starts with this environment, set before the interpreter imports anything:
        MASTER_ADDR=127.0.0.1   MASTER_PORT=<the group's rendezvous store, hosted by the supervisor>
        RANK=i   WORLD_SIZE=N   LOCAL_RANK=i   (one node)
    The trainer's __init__ joins the process group from that environment
    (roles.trainer.distributed.init_from_env: gloo on fake GPUs and the CPU,
    "cpu:gloo,cuda:nccl" on CUDA). `self.context.group` is the role name ("actor"): use it
    as the roles.device.DeviceMemory holder, because the lease of each GPU is granted to
    the role; each rank accounts its own GPU only.
    A rank's death is the group's death: the supervisor stops the other ranks, and every
    pending or later call to any rank raises the ActorDied of the rank that died (its
    name, reason and error file). The supervisor never restarts the group by itself
    (restart="temporary"); the driver may start it again from a checkpoint
    (`Supervisor.respawn_group`, ppo.recovery): every rank a new incarnation, with a new
    MASTER_PORT, built offloaded as at the job's start, then `load(path)`.

Endpoints every rank implements (names and arguments of the single-process trainer)
    rank_layout() -> {"dp_rank": int, "dp_size": int, "is_output": bool}
        Data-parallel ranks are 0..dp_size-1. Ranks with the same dp_rank (megatron's
        TP/PP/CP peers) receive the same share. is_output: this rank's results of the batch
        endpoints are the ones gathered for its dp_rank; exactly one output rank per dp_rank
        (torch: every rank; megatron: tp 0, cp 0, last pp stage).
    compute_log_probs(batch), compute_ref_log_probs(batch) -> {"log_probs": float32 [n, R']}
    compute_values(batch) -> {"values": float32 [n, R']}
        `batch` is the rank's share: the roles.trainer.batching schema, n whole rows in batch
        order, widths trimmed to the share (R' = its longest response). An output rank
        returns its rows in the order received; other ranks' results are ignored.
    train(batch, mini_batches=None) -> metrics {name: float}
        `batch` is the rank's share. `mini_batches` has one entry per optimizer step, in
        order: {"num_samples": the share's rows in that mini-batch (consecutive in the share,
        >= 1), "global_batch_size": G, "global_token_count": T}, where G and T are the whole
        mini-batch's counts for algorithms.aggregate(..., global_batch_size=G,
        global_token_count=T), as roles.trainer.sharding.aggregation_counts defines them
        for the loss_agg_mode. Each rank divides its micro-batch losses by these global
        counts, so the ranks' losses sum to the mini-batch's loss, and gradients are
        SUMMED over dp ranks (DDP averages: scale by dp_size or all-reduce a sum). Whether a
        step is skipped as non-finite is decided on the global loss and grad norm, the same
        on every rank. Returns the metrics of the whole global batch, reduced over dp,
        equal on every output rank. mini_batches=None: the whole batch is this rank's
        (one process; mini-batches of global_batch_size rows).
    offload(tags), onload(tags) -> {"ledger": {tag: bytes}, "bytes_in_use": int}
        of THIS rank's GPU (the colocation code releases each GPU with its rank's report).
    save(path), load(path), save_hf(path) -> {"path", ...}
        Every rank is called; the backend decides who writes (torch: rank 0 alone, the
        replicas being equal; megatron: whatever its sharded state needs) and every rank
        loads. The files are complete when every rank has returned.
    sync_weights(engines, buffer_bytes, version, timeout_s=600.0, engine_gpus=None)
        -> {"bytes", "buckets", "seconds"}
        Every rank is called; ranks that send nothing return zeros (torch: rank 0 sends the
        full HF weights; megatron: rank 0, once its TP peers joined the all-gather of the
        shards). Every sending rank
        calls the engines' set_weight_version(version) after its last bucket.
    weights_checksum() -> {hf_name: digest}
        Digests of the HF tensors the rank holds in full (torch: all of them; megatron: rank
        0 and its TP peers, after gathering; a rank may return {}).

What the group returns (TrainerGroup, in the driver)
    batch endpoints    the output ranks' rows, back in batch order: {key: [N, R]}
    train              the first output rank's metrics
    offload, onload    {"ledger": rank 0's, "bytes_in_use": the largest, "by_gpu": {gpu: report}}
    sync_weights       bytes and buckets summed, seconds the longest
    weights_checksum   the union; two ranks disagreeing on a name is an error (diverged replicas)
    rank_layout        the list, by rank
    anything else      rank 0's result (save, load, save_hf: rank 0 wrote or read the files)
    Errors: a rank's ActorDied is raised at once. An endpoint that raised on some rank
    (RemoteError) is raised once every rank has answered, or after `straggler_s` when a
    rank never does (it is then blocked in a collective its peer never joined).

Why
    MASTER_PORT is a store the supervisor listens on for the group's life
    (runtime.rendezvous), and every rank connects to it as a client: a port probed free and
    closed could be taken before rank 0 listened on it (EADDRINUSE in CI).
    A group may be started again by the driver (--max-trainer-restarts): same rank names and
    GPUs, new incarnations and a new MASTER_PORT; nothing else changes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from roles.trainer.config import TrainerConfig
from roles.trainer.sharding import plan_forward, plan_train, put_rows, take_rows
from runtime import ActorDied, ActorHandle, CallTimeout, Future, Supervisor
from runtime.handle import wait_any

BATCH_ENDPOINTS = ("compute_log_probs", "compute_ref_log_probs", "compute_values")


class TrainerGroup:
    """The driver's handle of one trainer role: `group.train(batch)` or `group.train.call(batch)`
    (a future with `.result()`), exactly as with a single trainer's ActorHandle."""

    def __init__(self, name: str, ranks: Sequence[ActorHandle], gpus: Sequence[int], *,
                 global_batch_size: int, loss_agg_mode: str, straggler_s: float = 60.0):
        if len(ranks) != len(gpus):
            raise ValueError(f"{name}: {len(ranks)} ranks for {len(gpus)} gpus; rank i runs on gpus[i]")
        self.name, self.ranks, self.gpus = name, list(ranks), list(gpus)
        self.global_batch_size, self.loss_agg_mode = global_batch_size, loss_agg_mode
        self.straggler_s = straggler_s
        self._layouts: list[dict] | None = None

    @classmethod
    def spawn(cls, sup: Supervisor, name: str, trainer_cls: type, config: TrainerConfig, *, gpus: Sequence[int],
              env: dict[str, str] | None = None) -> "TrainerGroup":
        """Start `trainer_cls(config)` as a rank group, one rank per GPU; returns at once.
        `config` carries the global_batch_size and loss_agg_mode the group shards by."""
        ranks = sup.spawn_group(name, trainer_cls, config, gpus=gpus, env=env)
        return cls(name, ranks, gpus, global_batch_size=config.global_batch_size,
                   loss_agg_mode=config.loss_agg_mode)

    def __repr__(self) -> str:
        return f"<TrainerGroup {self.name} ({len(self.ranks)} ranks)>"

    def rank_of(self, role: str) -> int | None:
        """The rank of the process named `role`, or None if it is not one of this group's."""
        return next((i for i, h in enumerate(self.ranks) if h.name == role), None)

    def layouts(self) -> list[dict]:
        """Each rank's rank_layout(), asked once (it blocks until the ranks are up)."""
        if self._layouts is None:
            self._layouts = GroupFuture([h.rank_layout.call() for h in self.ranks], list, self.straggler_s).result()
            dp = {lay["dp_size"] for lay in self._layouts}
            outputs = sorted(lay["dp_rank"] for lay in self._layouts if lay["is_output"])
            if len(dp) != 1 or outputs != list(range(dp.pop())):
                raise RuntimeError(f"{self.name}: inconsistent rank layouts {self._layouts}: every rank must report "
                                   "the same dp_size and each dp_rank exactly one output rank")
        return self._layouts

    def __getattr__(self, method: str) -> "GroupEndpoint":
        if method.startswith("_"):
            raise AttributeError(method)
        getattr(self.ranks[0], method)  # the handle's fix-it error for a non-endpoint
        return GroupEndpoint(self, method)

    # -- one call on every rank --------------------------------------------------------------
    def _call(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> "GroupFuture":
        if method in BATCH_ENDPOINTS:
            return self._call_sharded(method, args, kwargs, timeout)
        if method == "train":
            return self._call_train(args, kwargs, timeout)
        futures = [getattr(h, method).call(*args, timeout=timeout, **kwargs) for h in self.ranks]
        combine = {"offload": self._memory_report, "onload": self._memory_report,
                   "sync_weights": _sum_transfers, "weights_checksum": _merge_checksums,
                   "rank_layout": list}.get(method, _first)
        return GroupFuture(futures, combine, self.straggler_s)

    def _by_dp(self, shares: list, build: Callable[[Any], tuple[tuple, dict]], method: str,
               timeout: float | None) -> list[Future]:
        layouts = self.layouts()
        calls = []
        for h, lay in zip(self.ranks, layouts):
            args, kwargs = build(shares[lay["dp_rank"]])
            calls.append(getattr(h, method).call(*args, timeout=timeout, **kwargs))
        return calls

    def _outputs(self, results: list) -> list:
        """Output ranks' results, indexed by dp_rank."""
        out = [None] * self.layouts()[0]["dp_size"]
        for lay, r in zip(self.layouts(), results):
            if lay["is_output"]:
                out[lay["dp_rank"]] = r
        return out

    def _call_sharded(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> "GroupFuture":
        batch, = args
        n = batch["prompt_lens"].numel()
        rows = plan_forward(batch, self.layouts()[0]["dp_size"])
        futures = self._by_dp(rows, lambda r: ((take_rows(batch, r),), kwargs), method, timeout)
        return GroupFuture(futures, lambda results: put_rows(list(zip(rows, self._outputs(results))), n),
                           self.straggler_s)

    def _call_train(self, args: tuple, kwargs: dict, timeout: float | None) -> "GroupFuture":
        batch, = args
        rows, minis = plan_train(batch, self.layouts()[0]["dp_size"], self.global_batch_size, self.loss_agg_mode)
        shares = list(zip(rows, minis))
        futures = self._by_dp(shares, lambda s: ((take_rows(batch, s[0]),), dict(kwargs, mini_batches=s[1])),
                              "train", timeout)
        return GroupFuture(futures, lambda results: self._outputs(results)[0], self.straggler_s)

    def _memory_report(self, reports: list[dict]) -> dict:
        return {"ledger": reports[0]["ledger"], "bytes_in_use": max(r["bytes_in_use"] for r in reports),
                "by_gpu": dict(zip(self.gpus, reports))}


class GroupEndpoint:
    def __init__(self, group: TrainerGroup, method: str):
        self._group, self._method = group, method

    def call(self, *args, timeout: float | None = None, **kwargs) -> "GroupFuture":
        return self._group._call(self._method, args, kwargs, timeout)

    def __call__(self, *args, timeout: float | None = None, **kwargs) -> Any:
        return self.call(*args, timeout=timeout, **kwargs).result()

    def __repr__(self) -> str:
        return f"<group endpoint {self._group.name}.{self._method}>"


class GroupFuture:
    """The pending result of one call on every rank; `result()` combines the ranks' values."""

    def __init__(self, futures: list[Future], combine: Callable[[list], Any], straggler_s: float):
        self.futures, self._combine, self._straggler_s = futures, combine, straggler_s

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> Any:
        """The combined value; raises the first ActorDied at once, else a rank's error once
        every rank has answered (or `straggler_s` after the first error)."""
        until = None if timeout is None else time.monotonic() + timeout
        give_up: float | None = None
        while True:
            pending = [f for f in self.futures if not f.done()]
            failed = [f for f in self.futures if f.done() and f.exception(0) is not None]
            died = [f.exception(0) for f in failed if isinstance(f.exception(0), ActorDied)]
            if died:
                raise died[0]
            if failed and give_up is None:
                give_up = time.monotonic() + self._straggler_s
            if not pending or (give_up is not None and time.monotonic() >= give_up):
                break
            if until is not None and time.monotonic() >= until:
                raise CallTimeout(f"{pending[0].dst.name}: no reply within {timeout:.3g} s (the call is still pending)")
            wait_any(pending, timeout=0.05)
        if failed:
            raise failed[0].exception(0)
        return self._combine([f.result(0) for f in self.futures])


def _first(results: list) -> Any:
    return results[0]


def _sum_transfers(results: list[dict]) -> dict:
    return {"bytes": sum(r["bytes"] for r in results), "buckets": sum(r["buckets"] for r in results),
            "seconds": max(r["seconds"] for r in results)}


def _merge_checksums(results: list[dict]) -> dict:
    merged: dict[str, str] = {}
    for rank, sums in enumerate(results):
        for name, digest in sums.items():
            if merged.setdefault(name, digest) != digest:
                raise RuntimeError(f"weights_checksum: rank {rank} holds a different {name!r} than an earlier rank: "
                                   "the data-parallel replicas (or a tied embedding's pipeline-stage copies) diverged")
    return merged
