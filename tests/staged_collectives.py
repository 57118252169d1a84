"""A torch.distributed backend that runs every collective through the host, for several
ranks on ONE GPU, where NCCL refuses to run (tests/test_megatron_gpu_parallel.py).

gloo takes CUDA tensors for all_reduce, broadcast and a list all_gather only; megatron's
distributed optimizer reduce-scatters and all-gathers flat buffers into tensors, its DDP
coalesces them (torch's _coalescing_manager, which ends in the group's *_coalesced calls),
and its pipeline schedule sends and receives. `StagedGroup` is a process group (a Python
ProcessGroup subclass, the kind pytorch's test/distributed/test_c10d_pypg.py registers as a
backend) whose every op copies the tensors to the host, runs the SAME collective
there on an inner gloo group, and copies the results back into the caller's tensors: the
caller's code (torch.distributed's Python API, megatron's optimizer and schedule) runs
unchanged. Registered as backend "staged": `init_process_group("staged")`, and every group
megatron makes without naming a backend is one too (its explicit gloo groups stay gloo).

What differs from NCCL: the bytes go GPU -> host -> host -> GPU; a collective completes
before it returns (an async one returns finished work), the coalesced ops of a group run
one after the other, and a send is not stream-ordered. A receive is truly asynchronous (a
blocking one could deadlock two stages that both send first): its wait() lands the host
copy in the caller's buffer. Reduce ops are gloo's (no AVG: megatron sums, roles.trainer.
megatron.core). Ops megatron does not take here (gather, scatter, all-to-all) are not
staged: torch raises for them ("No backend type associated with device type"), as it does
for any backend that lacks an op. On the CPU the same staging runs on CPU tensors (a copy), which is how
tests/test_staged_collectives.py holds each op to torch's semantics without a GPU.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

BACKEND = "staged"
# Ops by name over every StagedGroup of this process (the PP test checks that megatron's
# pipeline messages went through send/recv).
COUNTS: Counter = Counter()


def register() -> None:
    """Make "staged" a torch.distributed backend in this process (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(store, rank: int, size: int, timeout):
    return StagedGroup(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)


class _Done(dist._Work):
    """Finished work, or a receive whose wait() copies the host buffer into the caller's."""

    def __init__(self, inner=None, copies: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        super().__init__()
        self.inner, self.copies = inner, list(copies)

    def wait(self, timeout=None) -> bool:
        if self.inner is not None:
            self.inner.wait()
            self.inner = None
            _land(self.copies)
            self.copies = []
        return True

    def is_completed(self) -> bool:
        return self.inner is None

    def get_future(self):
        fut = torch.futures.Future()
        self.wait()
        fut.set_result(None)
        return fut


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _land(copies) -> None:
    with torch.no_grad():  # megatron's receive buffers are leaves that require grad
        for into, host in copies:
            into.copy_(host)


class StagedGroup(dist.ProcessGroup):
    """Each op: host copies of its tensors, gloo's op on them, the results copied back."""

    def __init__(self, inner, rank: int, size: int):
        super().__init__(rank, size)
        self.inner = inner

    def getBackendName(self) -> str:
        return BACKEND

    def _run(self, name: str, op, outputs: list[torch.Tensor], host_outputs: list[torch.Tensor]) -> _Done:
        COUNTS[name] += 1
        op().wait()
        _land(zip(outputs, host_outputs))
        return _Done()

    def allreduce(self, tensors, opts=None):
        host = [_host(t) for t in tensors]
        return self._run("allreduce", lambda: self.inner.allreduce(host, _opts(opts, c10d.AllreduceOptions)),
                         tensors, host)

    def allreduce_coalesced(self, tensors, opts=None):
        host = [_host(t) for t in tensors]
        one = c10d.AllreduceOptions()
        one.reduceOp = opts.reduceOp
        return self._run("allreduce_coalesced", lambda: _all(self.inner.allreduce([h], one) for h in host),
                         tensors, host)

    def broadcast(self, tensors, opts=None):
        host = [_host(t) for t in tensors]
        return self._run("broadcast", lambda: self.inner.broadcast(host, _opts(opts, c10d.BroadcastOptions)),
                         tensors, host)

    def allgather(self, output_lists, inputs, opts=None):
        host_out = [[torch.empty_like(t, device="cpu") for t in outs] for outs in output_lists]
        host_in = [_host(t) for t in inputs]
        return self._run("allgather", lambda: self.inner.allgather(host_out, host_in, _opts(opts, c10d.AllgatherOptions)),
                         [t for outs in output_lists for t in outs], [t for outs in host_out for t in outs])

    def _allgather_base(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        host_out = [torch.empty_like(t, device="cpu") for t in outputs]
        host_in = [_host(t) for t in inputs]
        return self._run("allgather_into_tensor",
                         lambda: _all(self.inner._allgather_base(o, i, c10d.AllgatherOptions())
                                      for o, i in zip(host_out, host_in)), outputs, host_out)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        host_out = [torch.empty_like(t, device="cpu") for t in outputs]
        host_in = [_host(t) for t in inputs]

        def op():
            one = c10d.ReduceScatterOptions()
            one.reduceOp = opts.reduceOp
            return _all(self.inner._reduce_scatter_base(o, i, one) for o, i in zip(host_out, host_in))

        return self._run("reduce_scatter_tensor", op, outputs, host_out)

    # torch 2.13 renamed the single-tensor ops (all_gather_into_tensor -> all_gather_single,
    # reduce_scatter_tensor -> reduce_scatter_single) and the group methods they call
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        return self._run("barrier", lambda: self.inner.barrier(_opts(opts, c10d.BarrierOptions)), [], [])

    def send(self, tensors, dst: int, tag: int):
        COUNTS["send"] += 1
        host = [_host(t) for t in tensors]
        work = _Done(self.inner.send(host, dst, tag))
        work.host = host  # gloo reads the buffer until the send completes
        return work

    def recv(self, tensors, src: int, tag: int):
        COUNTS["recv"] += 1
        host = [torch.empty_like(t, device="cpu") for t in tensors]
        return _Done(self.inner.recv(host, src, tag), list(zip(tensors, host)))


class _AllWork:
    def __init__(self, works):
        self.works = list(works)

    def wait(self):
        for w in self.works:
            w.wait()


def _all(works) -> _AllWork:
    """Issue every op (in order: each rank issues the same sequence) and wait for them all."""
    return _AllWork(works)


def _opts(opts, kind):
    return kind() if opts is None else opts
