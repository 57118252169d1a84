"""ppo.gpu.colocation's lease checks on a trainer's memory report: what a trainer may keep when
it hands its GPU over, and what the error says when it keeps more (the reports are shaped as
the megatron and torch trainer cores return them)."""

from concurrent.futures import Future

import pytest

from ppo.gpu.colocation import UNTRACKED_LIMIT, Colocation, Tenant
from runtime.memory import LeaseError, LeaseTable

GIB = 1 << 30


def done(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


def trainer(report: dict, frees: tuple[str, ...] = ()) -> Tenant:
    return Tenant("actor", (0,), free=lambda tags: done(report), take=lambda tags: done(report),
                  report=lambda: done(report), frees=frees)


def handed_over(report: dict, frees: tuple[str, ...] = ()) -> Colocation:
    colo = Colocation(LeaseTable([0]))
    t = trainer(report, frees)
    colo.occupy([t], [])
    colo.vacate([t], ["grads", "optimizer"])
    return colo


def test_a_resident_optimizer_may_keep_a_little_untracked_memory():
    ledger = {"params": 8 * GIB, "optimizer": 48 * GIB, "grads": 16 * GIB}
    colo = handed_over({"ledger": ledger, "bytes_in_use": 72 * GIB + UNTRACKED_LIMIT})
    assert colo.leases.holder(0) is None


def test_more_untracked_memory_is_refused_and_the_error_names_the_blocks():
    ledger = {"params": 8 * GIB, "optimizer": 48 * GIB, "grads": 16 * GIB}
    report = {"ledger": ledger, "bytes_in_use": 73 * GIB, "untracked": [GIB - (8 << 20), 8 << 20]}
    with pytest.raises(LeaseError, match=r"offload missed something; allocations no tag covers, "
                                          r"largest first: 1016\.0 MiB, 8\.0 MiB"):
        handed_over(report)


def test_a_freed_tag_left_on_the_device_is_refused():
    """The trainer frees its optimizer and grads but its report still holds the optimizer's bytes."""
    report = {"ledger": {"params": 8 * GIB, "optimizer": 0, "grads": 0}, "bytes_in_use": 56 * GIB}
    with pytest.raises(LeaseError, match="offload missed something"):
        handed_over(report, frees=("grads", "optimizer"))
