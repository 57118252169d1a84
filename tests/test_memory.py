import threading

import pytest

from runtime.fakegpu import LeaseViolation, create_fake_devices
from runtime.memory import Grant, LeaseError, LeaseTable
from runtime.units import format_bytes

GiB = 1 << 30


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, name, **fields):
        self.events.append((name, fields))


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
    (5 * (1 << 20), "5.0 MiB"), (int(3.2 * GiB), "3.2 GiB"), (2048 * GiB, "2.0 TiB"),
])
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


def test_granting_a_held_lease_names_both_holders():
    table = LeaseTable([0, 1])
    assert table.acquire(0, "actor") == Grant(gpu=0, holder="actor", residuals={})
    with pytest.raises(LeaseError, match="cannot grant gpu 0 to 'critic': it is held by 'actor'"):
        table.acquire(0, "critic")
    with pytest.raises(LeaseError, match="'actor' already holds it"):
        table.acquire(0, "actor")
    assert table.holder(0) == "actor" and table.holder(1) is None


def test_only_the_holder_may_release():
    table = LeaseTable([0])
    with pytest.raises(LeaseError, match="'actor' cannot release gpu 0: nobody holds it"):
        table.release(0, "actor", 0)
    table.acquire(0, "actor")
    with pytest.raises(LeaseError, match="'critic' cannot release gpu 0: it is held by 'actor'"):
        table.release(0, "critic", 0)
    table.release(0, "actor", 0)
    assert table.holder(0) is None


def test_release_with_memory_left_is_an_error_and_keeps_the_lease():
    table = LeaseTable([0])
    table.acquire(0, "actor")
    with pytest.raises(LeaseError) as error:
        table.release(0, "actor", int(3.2 * GiB))
    assert str(error.value) == ("actor released gpu 0 with 3.2 GiB still allocated (allowed 0 B): "
                                "its offload missed something")
    assert table.holder(0) == "actor"  # nobody else may grow on top of the leftover
    with pytest.raises(LeaseError, match=r"with 2\.0 GiB still allocated \(allowed 1\.0 GiB\)"):
        table.release(0, "actor", 2 * GiB, may_keep=GiB)


def test_planned_residual_is_reported_in_the_next_grant_and_shrinks():
    events = Recorder()
    table = LeaseTable([0], on_event=events)
    table.acquire(0, "actor")
    table.release(0, "actor", GiB, may_keep=GiB)  # bf16 weights kept for the weight sync
    grant = table.acquire(0, "rollout")
    assert grant.residuals == {"actor": GiB}
    table.report(0, "actor", GiB // 4)
    table.report(0, "actor", 0)
    assert table.snapshot() == {0: {"holder": "rollout", "residuals": {}}}
    assert events.events == [
        ("lease", dict(gpu=0, holder="actor", action="acquire", bytes_left=None, residuals={})),
        ("lease", dict(gpu=0, holder="actor", action="release", bytes_left=GiB, residuals={"actor": GiB})),
        ("lease", dict(gpu=0, holder="rollout", action="acquire", bytes_left=None, residuals={"actor": GiB})),
        ("lease", dict(gpu=0, holder="actor", action="report", bytes_left=GiB // 4, residuals={"actor": GiB // 4})),
        ("lease", dict(gpu=0, holder="actor", action="report", bytes_left=0, residuals={})),
    ]


def test_a_residual_cannot_grow_and_the_holder_does_not_report():
    table = LeaseTable([0])
    table.acquire(0, "actor")
    table.release(0, "actor", 100, may_keep=100)
    table.acquire(0, "rollout")
    with pytest.raises(LeaseError, match="'actor' reported 200 B on gpu 0, more than its residual 100 B: "
                                         "only the lease holder \\('rollout'\\) may grow memory"):
        table.report(0, "actor", 200)
    with pytest.raises(LeaseError, match="'rollout' holds gpu 0"):
        table.report(0, "rollout", 0)


def test_reacquiring_takes_back_your_own_residual():
    table = LeaseTable([0])
    table.acquire(0, "actor")
    table.release(0, "actor", 100, may_keep=100)
    assert table.acquire(0, "actor").residuals == {}
    assert table.snapshot()[0]["residuals"] == {}


def test_unknown_gpu_and_duplicates_are_value_errors():
    with pytest.raises(ValueError, match="duplicates"):
        LeaseTable([0, 0])
    table = LeaseTable([0, 1])
    with pytest.raises(ValueError, match=r"gpu=7 has no lease; leased gpus: \[0, 1\]"):
        table.acquire(7, "actor")
    with pytest.raises(ValueError, match="duplicates"):
        table.acquire_all([1, 1], "actor")


def test_acquire_all_is_all_or_nothing():
    table = LeaseTable([0, 1, 2])
    table.acquire(1, "critic")
    with pytest.raises(LeaseError, match="cannot grant gpu 1 to 'actor': it is held by 'critic'"):
        table.acquire_all([0, 1, 2], "actor")
    assert [table.holder(g) for g in (0, 1, 2)] == [None, "critic", None]
    table.release(1, "critic", 0)
    grants = table.acquire_all([0, 1, 2], "actor")
    assert [g.gpu for g in grants] == [0, 1, 2]
    assert all(table.holder(g) == "actor" for g in (0, 1, 2))


def test_release_all_is_all_or_nothing():
    table = LeaseTable([0, 1])
    table.acquire_all([0, 1], "actor")
    with pytest.raises(LeaseError, match="actor released gpu 1 with 300 B still allocated \\(allowed 200 B\\)"):
        table.release_all([0, 1], "actor", {0: 0, 1: 300}, may_keep={0: 0, 1: 200})
    assert table.holder(0) == "actor" and table.holder(1) == "actor"
    with pytest.raises(ValueError, match="bytes_left_by_gpu"):
        table.release_all([0, 1], "actor", {0: 0})
    table.release_all([0, 1], "actor", {0: 0, 1: 200}, may_keep=200)
    assert table.snapshot() == {0: {"holder": None, "residuals": {}},
                                1: {"holder": None, "residuals": {"actor": 200}}}


def test_concurrent_acquires_grant_exactly_one():
    table = LeaseTable([0])
    winners, barrier = [], threading.Barrier(8)

    def contend(name):
        barrier.wait()
        try:
            table.acquire(0, name)
            winners.append(name)
        except LeaseError:
            pass

    threads = [threading.Thread(target=contend, args=(f"role{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and table.holder(0) == winners[0]


def test_leases_are_mirrored_into_fake_devices(tmp_path):
    devices = create_fake_devices(tmp_path, 2, 4 * GiB)
    table = LeaseTable([0, 1], fake_devices={0: devices[0], 1: devices[1]})
    table.acquire_all([0, 1], "actor")
    assert [d.lease_holder() for d in devices] == ["actor", "actor"]
    devices[0].set_usage("actor", "weights", GiB)
    with pytest.raises(LeaseViolation):
        devices[0].set_usage("rollout", "kv_cache", GiB)
    table.release_all([0, 1], "actor", {0: GiB, 1: 0}, may_keep=GiB)
    assert [d.lease_holder() for d in devices] == [None, None]
    table.acquire(0, "rollout")
    devices[0].set_usage("rollout", "kv_cache", 2 * GiB)
    devices[0].set_usage("actor", "weights", 0)
    table.report(0, "actor", 0)
    assert devices[0].holders() == {"rollout": 2 * GiB}


def test_reports_are_checked_against_the_fake_ledger(tmp_path):
    device = create_fake_devices(tmp_path, 1, 4 * GiB)[0]
    table = LeaseTable([0], fake_devices={0: device})
    table.acquire(0, "actor")
    device.set_usage("actor", "optimizer", GiB + 5)
    with pytest.raises(LeaseError, match=r"'actor' reported 0 B on gpu 0 but the fake device ledger shows "
                                         r"1\.0 GiB \(1073741829 B\): its memory report is wrong"):
        table.release(0, "actor", 0)
    assert table.holder(0) == "actor" and device.lease_holder() == "actor"
    device.set_usage("actor", "optimizer", 0)
    table.release(0, "actor", 0)
    assert device.lease_holder() is None


def test_fake_devices_must_be_leased_gpus(tmp_path):
    devices = create_fake_devices(tmp_path, 2, GiB)
    with pytest.raises(ValueError, match=r"fake_devices has gpus \[1\]"):
        LeaseTable([0], fake_devices={0: devices[0], 1: devices[1]})
