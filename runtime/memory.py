"""GPU leases: who may hold bulk device memory on which GPU, and when.

The supervisor keeps one lease per GPU (docs/design.md, "The memory handoff").
A role must hold a GPU's lease to grow memory there; it releases the lease after
offloading and reports the bytes it still keeps. A release that keeps more than the
caller allows is an error naming the role and the amount, so a colocation bug surfaces
at the handoff instead of as an out-of-memory error in the next holder.

Some memory legitimately outlives a lease: the actor keeps its bf16 weights on the GPU
for the weight sync while the engines hold the lease. Such a *residual* is allowed up
to `may_keep`, remembered, reported in the next grant, and shrunk with `report()` as the
previous holder frees it. A residual can never grow: only the lease holder grows memory.

With fake GPUs (runtime.fakegpu) the table mirrors each lease into the fake device, so
the device refuses growth by anyone else, and checks every reported byte count against
the device's exact ledger.

Side by side (--train-async --colocate: docs/architecture.md) a GPU is *split* into
budgets: one lease per budget, each with its holders (the engine's; the trainers', which
the actor and the critic take in turn). Two tenants of different budgets hold the GPU at
once; each grows only within its budget, which the fake device checks byte by byte and a
release or report checks for what stays. A GPU not split has one lease, as above.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from runtime.budget import Budget
from runtime.units import format_bytes

if TYPE_CHECKING:
    from runtime.fakegpu import FakeDevice


class LeaseError(RuntimeError):
    """A lease was granted, released or reported against the colocation rules."""


WHOLE = ""  # the name of the one lease of a GPU not split into budgets
Slot = tuple[int, str]  # (gpu, budget name or WHOLE): one lease


@dataclass(frozen=True, kw_only=True)
class Grant:
    gpu: int
    holder: str
    residuals: dict[str, int]  # bytes that earlier holders still keep on this GPU, by holder


def _exact(nbytes: int) -> str:
    # Two different byte counts can format alike ("3.2 GiB"); a mismatch needs the exact ones.
    return format_bytes(nbytes) if nbytes < 1024 else f"{format_bytes(nbytes)} ({nbytes} B)"


class LeaseTable:
    """In-memory lease table of the supervisor; thread-safe.

    `on_event("lease", gpu=, holder=, action=, bytes_left=, residuals=)`, and each callback
    added with `listen`, is called after every change, under the table's lock so events
    arrive in the order of the changes.
    `action` is "acquire" (bytes_left None), "release" or "report"; `residuals` maps the
    holders that keep memory on that GPU without holding its lease to their bytes.
    """

    def __init__(self, gpus: list[int], *, on_event: Callable[..., object] | None = None,
                 fake_devices: dict[int, FakeDevice] | None = None):
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"gpus={gpus} has duplicates; each GPU has exactly one lease")
        unknown = sorted(set(fake_devices or {}) - set(gpus))
        if unknown:
            raise ValueError(f"fake_devices has gpus {unknown} that are not in gpus={gpus}")
        self._gpus = set(gpus)
        self._holders: dict[Slot, str | None] = {(gpu, WHOLE): None for gpu in gpus}
        self._residuals: dict[Slot, dict[str, int]] = {(gpu, WHOLE): {} for gpu in gpus}
        self._budgets: dict[int, dict[str, Budget]] = {}  # split GPUs: {gpu: {holder: its budget}}
        self._listeners: list[Callable[..., object]] = [on_event] if on_event is not None else []
        self._fake_devices = dict(fake_devices or {})
        self._lock = threading.RLock()

    def split(self, gpu: int, budgets: list[Budget]) -> None:
        """Split `gpu`'s lease into one lease per budget (side by side); before anyone holds
        or keeps memory there. On a fake GPU the device checks the budgets as it grows."""
        with self._lock:
            self._check_gpu(gpu)
            holders = [h for b in budgets for h in b.holders]
            if len(holders) != len(set(holders)) or len({b.name for b in budgets}) != len(budgets) \
                    or WHOLE in {b.name for b in budgets}:
                raise ValueError(f"gpu {gpu}: budgets {budgets} must have distinct non-empty names and holders")
            if gpu in self._budgets or self._holders[(gpu, WHOLE)] is not None or self._residuals[(gpu, WHOLE)]:
                raise LeaseError(f"gpu {gpu} cannot be split: it is split already, held or kept memory on")
            del self._holders[(gpu, WHOLE)], self._residuals[(gpu, WHOLE)]
            self._budgets[gpu] = {h: b for b in budgets for h in b.holders}
            for b in budgets:
                self._holders[(gpu, b.name)], self._residuals[(gpu, b.name)] = None, {}
            if gpu in self._fake_devices:
                self._fake_devices[gpu].set_budgets(budgets)

    def holder(self, gpu: int, *, like: str | None = None) -> str | None:
        """Who holds `gpu`'s lease; on a split GPU, the lease that `like` takes."""
        with self._lock:
            self._check_gpu(gpu)
            return self._holders[self._slot(gpu, like)]

    def holds(self, gpu: int, holder: str) -> bool:
        """Whether `holder` holds its lease on `gpu` (its budget's, on a split GPU; False
        when it has none there)."""
        with self._lock:
            self._check_gpu(gpu)
            if holder not in self._budgets.get(gpu, {holder: None}):
                return False
            return self._holders[self._slot(gpu, holder)] == holder

    def same_lease(self, gpu: int, a: str, b: str) -> bool:
        """Whether `a` and `b` take turns with one lease on `gpu` (not budgets side by side)."""
        with self._lock:
            self._check_gpu(gpu)
            return self._slot(gpu, a) == self._slot(gpu, b)

    def snapshot(self) -> dict[int, dict]:
        """{gpu: {"holder": str | None, "residuals": {holder: bytes}}}; a split GPU has
        {"budgets": {name: {"nbytes", "holder", "residuals"}}} instead."""
        with self._lock:
            out: dict[int, dict] = {}
            for (gpu, name), holder in sorted(self._holders.items()):
                lease = {"holder": holder, "residuals": dict(self._residuals[(gpu, name)])}
                if name == WHOLE:
                    out[gpu] = lease
                else:
                    budget = next(b for b in self._budgets[gpu].values() if b.name == name)
                    out.setdefault(gpu, {"budgets": {}})["budgets"][name] = {"nbytes": budget.nbytes, **lease}
            return out

    def acquire(self, gpu: int, holder: str) -> Grant:
        """Grant `gpu`'s lease (its budget's, split) to `holder`; a lease that is held (by
        anyone) is a LeaseError."""
        with self._lock:
            self._check_gpu(gpu)
            error = self._acquire_error(gpu, holder)
            if error:
                raise LeaseError(error)
            return self._grant(gpu, holder)

    def release(self, gpu: int, holder: str, bytes_left: int, *, may_keep: int = 0) -> None:
        """End `holder`'s lease on `gpu`, which still keeps `bytes_left` there.

        LeaseError, and the lease stays with `holder`, when `holder` does not hold it,
        bytes_left exceeds may_keep or (split) its budget. The bytes left become a residual
        of `holder`.
        """
        with self._lock:
            self._check_gpu(gpu)
            error = self._release_error(gpu, holder, bytes_left, may_keep)
            if error:
                raise LeaseError(error)
            self._end(gpu, holder, bytes_left)

    def report(self, gpu: int, holder: str, nbytes: int) -> None:
        """Update the residual `holder` keeps on `gpu` after releasing it; it may only shrink."""
        with self._lock:
            self._check_gpu(gpu)
            slot = self._slot(gpu, holder)
            if self._holders[slot] == holder:
                raise LeaseError(f"{holder!r} holds gpu {gpu}: report() tracks the residual of a "
                                 f"released lease; end the lease with release()")
            residual = self._residuals[slot].get(holder, 0)
            if nbytes > residual:
                raise LeaseError(
                    f"{holder!r} reported {format_bytes(nbytes)} on gpu {gpu}, more than its "
                    f"residual {format_bytes(residual)}: only the lease holder "
                    f"({self._holders[slot]!r}) may grow memory")
            error = self._ledger_error(gpu, holder, nbytes)
            if error:
                raise LeaseError(error)
            if nbytes:
                self._residuals[slot][holder] = nbytes
            else:
                self._residuals[slot].pop(holder, None)
            self._emit(slot, holder, "report", nbytes)

    def acquire_all(self, gpus: list[int], holder: str) -> list[Grant]:
        """Grant every lease in `gpus` to `holder`, or none of them (LeaseError naming each conflict)."""
        with self._lock:
            self._check_group(gpus)
            errors = [e for gpu in gpus if (e := self._acquire_error(gpu, holder))]
            if errors:
                raise LeaseError("; ".join(errors))
            return [self._grant(gpu, holder) for gpu in gpus]

    def release_all(self, gpus: list[int], holder: str, bytes_left_by_gpu: Mapping[int, int], *,
                    may_keep: int | Mapping[int, int] = 0) -> None:
        """Release every lease in `gpus`, or none of them (LeaseError naming each problem).

        `may_keep` is one allowance for every GPU or an allowance per GPU.
        """
        with self._lock:
            self._check_group(gpus)
            if sorted(bytes_left_by_gpu) != sorted(gpus):
                raise ValueError(f"bytes_left_by_gpu has gpus {sorted(bytes_left_by_gpu)}; "
                                 f"expected exactly gpus={sorted(gpus)}")
            keep = may_keep if isinstance(may_keep, Mapping) else {gpu: may_keep for gpu in gpus}
            errors = [e for gpu in gpus
                      if (e := self._release_error(gpu, holder, bytes_left_by_gpu[gpu], keep.get(gpu, 0)))]
            if errors:
                raise LeaseError("; ".join(errors))
            for gpu in gpus:
                self._end(gpu, holder, bytes_left_by_gpu[gpu])

    def drop_dead_memory(self, gpus: list[int], holder: str) -> None:
        """`holder`'s processes died and are gone: on a fake GPU its ledger entries go too, as a
        real GPU frees a dead process's memory. Its leases stay as they are (the loop's
        handoffs and a deferred restart count on them); `forget` ends those as well."""
        with self._lock:
            for gpu in gpus:
                if gpu in self._fake_devices:
                    self._fake_devices[gpu].forget(holder)

    def forget(self, gpus: list[int], holder: str) -> None:
        """`holder`'s processes on `gpus` are gone, and their memory with them: end its leases
        there and drop its residuals (on a fake GPU, its ledger entries too), so that the next
        holder, or `holder` started again, begins from an empty device."""
        with self._lock:
            self._check_group(gpus)
            for gpu in gpus:
                if gpu in self._fake_devices:
                    self._fake_devices[gpu].forget(holder)
                slot = self._slot(gpu, holder)
                held = self._holders[slot] == holder
                if not held and holder not in self._residuals[slot]:
                    continue
                self._residuals[slot].pop(holder, None)
                if held:
                    self._end(gpu, holder, 0)
                else:
                    self._emit(slot, holder, "report", 0)

    def _check_gpu(self, gpu: int) -> None:
        if gpu not in self._gpus:
            raise ValueError(f"gpu={gpu} has no lease; leased gpus: {sorted(self._gpus)}")

    def _check_group(self, gpus: list[int]) -> None:
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"gpus={gpus} has duplicates")
        for gpu in gpus:
            self._check_gpu(gpu)

    def _slot(self, gpu: int, holder: str | None) -> Slot:
        """The lease `holder` takes on `gpu`: the GPU's one lease, or its budget's on a split GPU."""
        budgets = self._budgets.get(gpu)
        if budgets is None:
            return gpu, WHOLE
        if holder not in budgets:
            raise LeaseError(f"gpu {gpu} is split into budgets ("
                             + ", ".join(sorted({f"{b.name}: {', '.join(b.holders)}" for b in budgets.values()}))
                             + f") and {holder!r} has none")
        return gpu, budgets[holder].name

    def _acquire_error(self, gpu: int, holder: str) -> str | None:
        slot = self._slot(gpu, holder)
        current = self._holders[slot]
        if current is None:
            return None
        where = f"gpu {gpu}" + (f" (budget {slot[1]!r})" if slot[1] else "")
        if current == holder:
            return f"cannot grant {where} to {holder!r}: {holder!r} already holds it"
        return f"cannot grant {where} to {holder!r}: it is held by {current!r}"

    def _release_error(self, gpu: int, holder: str, bytes_left: int, may_keep: int) -> str | None:
        slot = self._slot(gpu, holder)
        current = self._holders[slot]
        if current != holder:
            held = "nobody holds it" if current is None else f"it is held by {current!r}"
            return f"{holder!r} cannot release gpu {gpu}: {held}"
        ledger_error = self._ledger_error(gpu, holder, bytes_left)
        if ledger_error:
            return ledger_error
        if bytes_left > may_keep:
            return (f"{holder} released gpu {gpu} with {format_bytes(bytes_left)} still allocated "
                    f"(allowed {format_bytes(may_keep)}): its offload missed something")
        if slot[1]:
            budget = self._budgets[gpu][holder]
            others = {h: b for h, b in self._residuals[slot].items() if h != holder}
            if bytes_left + sum(others.values()) > budget.nbytes:
                return (f"{holder} released gpu {gpu} keeping {format_bytes(bytes_left)}, which with "
                        + (", ".join(f"{h}'s {format_bytes(b)}" for h, b in others.items()) or "nothing else")
                        + f" is over its budget {budget.name!r} of {format_bytes(budget.nbytes)}")
        return None

    def _ledger_error(self, gpu: int, holder: str, nbytes: int) -> str | None:
        device = self._fake_devices.get(gpu)
        if device is None:
            return None
        actual = device.usage(holder=holder)
        if actual == nbytes:
            return None
        return (f"{holder!r} reported {_exact(nbytes)} on gpu {gpu} but the fake device "
                f"ledger shows {_exact(actual)}: its memory report is wrong")

    def _grant(self, gpu: int, holder: str) -> Grant:
        slot = self._slot(gpu, holder)
        self._holders[slot] = holder
        self._residuals[slot].pop(holder, None)  # memory it kept is held memory again
        if gpu in self._fake_devices:
            self._fake_devices[gpu].set_lease_holder(holder, budget=slot[1] or None)
        self._emit(slot, holder, "acquire", None)
        return Grant(gpu=gpu, holder=holder, residuals=dict(self._residuals[slot]))

    def _end(self, gpu: int, holder: str, bytes_left: int) -> None:
        slot = self._slot(gpu, holder)
        self._holders[slot] = None
        if bytes_left:
            self._residuals[slot][holder] = bytes_left
        if gpu in self._fake_devices:
            self._fake_devices[gpu].set_lease_holder(None, budget=slot[1] or None)
        self._emit(slot, holder, "release", bytes_left)

    def listen(self, callback: Callable[..., object]) -> None:
        """Call `callback` too after every change (the supervisor restarts a child waiting for a lease)."""
        with self._lock:
            self._listeners.append(callback)

    def _emit(self, slot: Slot, holder: str, action: str, bytes_left: int | None) -> None:
        gpu, budget = slot
        for callback in self._listeners:
            callback("lease", gpu=gpu, holder=holder, action=action, bytes_left=bytes_left,
                     residuals=dict(self._residuals[slot]), **({"budget": budget} if budget else {}))
