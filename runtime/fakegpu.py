"""Fake GPUs with an exact, cross-process memory ledger.

CPU runs and tests cannot observe real device memory, so roles on fake GPUs *declare*
it: `FakeDevice.set_usage(holder, tag, nbytes)` sets the absolute bytes that `holder`
keeps under `tag` (weights, optimizer, kv_cache, ...). The ledger enforces the
colocation rule of docs/design.md ("The memory handoff"):

    On each device, only the current lease holder may grow its memory;
    every other holder may only shrink (free what it left behind).

Files, one set per device N inside the fake-device directory (mode 0700):
  gpu<N>.json           capacity, lease holder, bytes per (holder, tag), last committed seq
  gpu<N>.history.jsonl  one line per change (usage or lease), append-only
  gpu<N>.lock           the `fcntl.flock` that serialises every read-modify-write

Several role processes write the same device, and the fault-injection tests SIGKILL
them at arbitrary points, so a change is written ahead to the history and then
committed by atomically replacing gpu<N>.json. A history line whose seq is above the
committed seq belongs to a writer that died mid-change and is ignored.

A device split into budgets (runtime.memory.LeaseTable.split: side by side) has one lease
holder per budget; a holder with a budget grows only while it holds its budget's lease and
while its budget's holders together keep at most the budget (BudgetExceeded otherwise).
Its history lines carry the budget, and `check_no_overlap` checks each budget on its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Iterator

from runtime.budget import Budget
from runtime.units import format_bytes

FAKE_GPU_DIR_ENV = "TANDEM_FAKE_GPU_DIR"


class LeaseViolation(RuntimeError):
    """A holder tried to grow memory on a fake device whose lease it does not hold."""


class FakeOutOfMemory(RuntimeError):
    """A change would push a fake device past its capacity."""


class BudgetExceeded(FakeOutOfMemory):
    """A change would push a holder's budget on a split fake device past its bytes."""


def create_fake_devices(dir: str | os.PathLike, num_gpus: int, capacity_bytes: int) -> list[FakeDevice]:
    """Create (or reset) `num_gpus` empty fake devices in `dir`; called once by the supervisor."""
    if num_gpus < 0:
        raise ValueError(f"num_gpus={num_gpus} must be >= 0")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes={capacity_bytes} must be > 0")
    root = Path(dir)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)  # mkdir's mode is masked by umask and ignored when the dir exists
    for index in range(num_gpus):
        paths = _Paths(root, index)
        with _locked(paths.lock):
            paths.history.write_text("")
            _write_state(paths.state, {"index": index, "capacity": capacity_bytes,
                                       "lease_holder": None, "seq": 0, "usage": {}})
    return [FakeDevice(root, index) for index in range(num_gpus)]


def visible_fake_devices() -> list[FakeDevice]:
    """The fake devices of this role process, in CUDA_VISIBLE_DEVICES order.

    [] when TANDEM_FAKE_GPU_DIR is unset (real GPUs or no GPUs) or no GPU is visible.
    """
    root = os.environ.get(FAKE_GPU_DIR_ENV)
    if not root:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return []
    try:
        indices = [int(index) for index in visible.split(",")]
    except ValueError:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} must list fake gpu indices (like '0,1') "
                         f"when {FAKE_GPU_DIR_ENV} is set") from None
    return [FakeDevice(root, index) for index in indices]


class FakeDevice:
    """Handle on one fake device; cheap to create, safe to use from any process or thread."""

    def __init__(self, dir: str | os.PathLike, index: int):
        self.index = index
        self._paths = _Paths(Path(dir), index)
        if not self._paths.state.exists():
            raise FileNotFoundError(
                f"fake gpu {index} does not exist: no {self._paths.state} "
                f"(create_fake_devices() makes the devices; is {FAKE_GPU_DIR_ENV} right?)")

    def __repr__(self) -> str:
        return f"FakeDevice({str(self._paths.root)!r}, {self.index})"

    @property
    def capacity(self) -> int:
        return self._read()["capacity"]

    def set_usage(self, holder: str, tag: str, nbytes: int) -> None:
        """Set the absolute bytes `holder` keeps under `tag` on this device.

        Raises LeaseViolation when this grows the (holder, tag) usage and `holder` does not
        hold the lease, FakeOutOfMemory when the device total would exceed its capacity.
        Shrinking is always allowed: a previous holder frees its residual after handing over.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0 (holder {holder!r}, tag {tag!r})")
        with self._transaction() as state:
            old = state["usage"].get(holder, {}).get(tag, 0)
            budget = _budget_of(state, holder)
            lease = state["budgets"][budget]["lease_holder"] if budget else state["lease_holder"]
            if nbytes > old and holder != lease:
                actual = "nobody" if lease is None else repr(lease)
                of = f"the lease of budget {budget!r}" if budget else "the lease"
                raise LeaseViolation(
                    f"fake gpu {self.index}: {holder!r} tried to grow {tag!r} from "
                    f"{format_bytes(old)} to {format_bytes(nbytes)} but {of} is held by {actual}; "
                    f"only the lease holder may grow memory, others may only shrink")
            if budget and nbytes > old:
                b = state["budgets"][budget]
                used = sum(_by_holder(state).get(h, 0) for h in b["holders"]) - old + nbytes
                if used > b["nbytes"]:
                    raise BudgetExceeded(
                        f"fake gpu {self.index}: {holder!r} growing {tag!r} to {format_bytes(nbytes)} would "
                        f"keep {format_bytes(used)} in its budget {budget!r} of {format_bytes(b['nbytes'])} "
                        f"(holders {', '.join(b['holders'])})")
            total = _total(state) - old + nbytes
            if nbytes > old and total > state["capacity"]:
                by_holder = ", ".join(f"{h}={format_bytes(b)}" for h, b in _by_holder(state).items())
                raise FakeOutOfMemory(
                    f"fake gpu {self.index}: {holder!r} growing {tag!r} to {format_bytes(nbytes)} "
                    f"needs {format_bytes(total)} of capacity {format_bytes(state['capacity'])}; "
                    f"in use: {by_holder or 'nothing'}")
            tags = state["usage"].setdefault(holder, {})
            tags[tag] = nbytes
            if nbytes == 0:  # keep the ledger to holders that still hold bytes
                del tags[tag]
                if not tags:
                    del state["usage"][holder]
            self._append(state, {"kind": "usage", "holder": holder, "tag": tag, "nbytes": nbytes,
                                 "total": total}, budget)

    def forget(self, holder: str) -> None:
        """Free everything `holder` keeps here: its processes died, and their memory with them
        (a real GPU frees a dead process's allocations; a fake one is told)."""
        with self._transaction() as state:
            tags = state["usage"].pop(holder, {})
            for tag in sorted(tags):
                self._append(state, {"kind": "usage", "holder": holder, "tag": tag, "nbytes": 0,
                                     "total": _total(state)}, _budget_of(state, holder))

    def set_budgets(self, budgets: list[Budget]) -> None:
        """Split this device into budgets, each with its own lease (called by LeaseTable.split)."""
        with self._transaction() as state:
            total = sum(b.nbytes for b in budgets)
            if total > state["capacity"]:
                raise ValueError(f"fake gpu {self.index}: budgets of {format_bytes(total)} exceed its capacity "
                                 f"{format_bytes(state['capacity'])}")
            state["budgets"] = {b.name: {"nbytes": b.nbytes, "holders": list(b.holders), "lease_holder": None}
                                for b in budgets}

    def set_lease_holder(self, holder: str | None, budget: str | None = None) -> None:
        """Record who may grow memory here (in `budget`, on a split device) from now on
        (called by runtime.memory.LeaseTable)."""
        with self._transaction() as state:
            if budget:
                state["budgets"][budget]["lease_holder"] = holder
            else:
                state["lease_holder"] = holder
            self._append(state, {"kind": "lease", "holder": holder, "tag": None,
                                 "nbytes": _by_holder(state).get(holder, 0), "total": _total(state)}, budget)

    def lease_holder(self, budget: str | None = None) -> str | None:
        state = self._read()
        return state["budgets"][budget]["lease_holder"] if budget else state["lease_holder"]

    def usage(self, holder: str | None = None, tag: str | None = None) -> int:
        """Bytes in use, filtered by holder and/or tag (None means all)."""
        usage = self._read()["usage"]
        return sum(nbytes for h, tags in usage.items() if holder is None or h == holder
                   for t, nbytes in tags.items() if tag is None or t == tag)

    def holders(self) -> dict[str, int]:
        """Bytes per holder, for holders that keep any memory here."""
        return _by_holder(self._read())

    def history(self) -> list[dict]:
        """Every committed change in order: seq, ts, kind ('usage' | 'lease'), holder, tag,
        nbytes (the holder's new bytes under tag; for 'lease': the new holder's bytes),
        lease_holder (after the change), total (device bytes after the change)."""
        with _locked(self._paths.lock):
            committed = _read_state(self._paths.state)["seq"]
            text = self._paths.history.read_text()
        entries: dict[int, dict] = {}
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # torn line of a writer killed mid-append
                continue
            if entry["seq"] <= committed:
                entries[entry["seq"]] = entry  # a later line re-using a dead writer's seq wins
        return [entries[seq] for seq in sorted(entries)]

    def _read(self) -> dict:
        with _locked(self._paths.lock):
            return _read_state(self._paths.state)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[dict]:
        with _locked(self._paths.lock):
            state = _read_state(self._paths.state)
            yield state  # an exception here leaves the state file untouched
            _write_state(self._paths.state, state)

    def _append(self, state: dict, change: dict, budget: str | None = None) -> None:
        state["seq"] += 1
        entry = {"seq": state["seq"], "ts": time.time(), **change,
                 "lease_holder": state["budgets"][budget]["lease_holder"] if budget else state["lease_holder"],
                 **({"budget": budget} if budget else {})}
        with open(self._paths.history, "a+b") as f:
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a killed writer left a torn line; end it
                    f.write(b"\n")
            f.write(json.dumps(entry).encode() + b"\n")


def check_no_overlap(history: list[dict]) -> list[str]:
    """Check one device's history against the colocation invariant; [] when it holds.

    A *growth* is a usage entry whose nbytes exceeds the previous nbytes of the same
    (holder, tag); the checker replays the history to find them. A *lease tenure* is a
    stretch of the history between two lease entries (or between changes of the recorded
    lease_holder, for histories without lease entries). Reported:

    1. every growth by a holder other than the lease holder recorded with it;
    2. every growth by X after another holder Y grew in the same tenure in which X had
       already grown: X's and Y's growing periods interleave, i.e. both were allocating on
       the device at once. Given rule 1 this can only happen with a wrong lease_holder
       record; it also catches interleaving in histories that carry no lease records.
    Shrinking is never reported: a previous holder may free its residual at any time.
    The budgets of a split device are checked each on its own: their holders grow side by side.
    """
    budgets = sorted({entry.get("budget") or "" for entry in history})
    return [p for budget in budgets for p in _check_lease([e for e in history if (e.get("budget") or "") == budget])]


def _check_lease(history: list[dict]) -> list[str]:
    """check_no_overlap for the history of one lease."""
    problems: list[str] = []
    current: dict[tuple[str, str], int] = {}
    tenure_growers: list[str] = []  # holders that grew in the current tenure, in order
    lease: object = object()  # sentinel: no lease seen yet
    for entry in history:
        if entry.get("kind", "usage") == "lease" or entry.get("lease_holder", lease) != lease:
            lease = entry.get("lease_holder")
            tenure_growers = []
        if entry.get("kind", "usage") != "usage":
            continue
        holder, tag, nbytes = entry["holder"], entry["tag"], entry["nbytes"]
        old = current.get((holder, tag), 0)
        current[(holder, tag)] = nbytes
        if nbytes <= old:
            continue
        where = f"seq {entry['seq']}: {holder!r} grew {tag!r} {format_bytes(old)} -> {format_bytes(nbytes)}"
        if "lease_holder" in entry and holder != entry["lease_holder"]:
            problems.append(f"{where} while the lease was held by {entry['lease_holder']!r}")
        if holder in tenure_growers and tenure_growers[-1] != holder:
            last_run = len(tenure_growers) - 1 - tenure_growers[::-1].index(holder)
            others = sorted(set(tenure_growers[last_run + 1:]))
            problems.append(f"{where}, but {', '.join(map(repr, others))} grew since {holder!r} "
                            f"last grew, with no lease handover between: growing periods interleave")
        if not tenure_growers or tenure_growers[-1] != holder:
            tenure_growers.append(holder)
    return problems


class _Paths:
    def __init__(self, root: Path, index: int):
        self.root = root
        self.state = root / f"gpu{index}.json"
        self.history = root / f"gpu{index}.history.jsonl"
        self.lock = root / f"gpu{index}.lock"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # A fresh open file description per use, so flock also serialises threads of one process.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _read_state(path: Path) -> dict:
    return json.loads(path.read_text())


def _write_state(path: Path, state: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _budget_of(state: dict, holder: str | None) -> str | None:
    """The budget `holder` draws on, on a split device; None on a whole one."""
    return next((name for name, b in state.get("budgets", {}).items() if holder in b["holders"]), None)


def _by_holder(state: dict) -> dict[str, int]:
    return {holder: sum(tags.values()) for holder, tags in state["usage"].items()}


def _total(state: dict) -> int:
    return sum(_by_holder(state).values())
