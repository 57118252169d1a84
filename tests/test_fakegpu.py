import json
import multiprocessing as mp
import os
import stat

import pytest

from runtime.fakegpu import (FakeDevice, FakeOutOfMemory, LeaseViolation, check_no_overlap,
                             create_fake_devices, visible_fake_devices)

GiB = 1 << 30


@pytest.fixture
def device(tmp_path):
    return create_fake_devices(tmp_path / "gpus", 2, 4 * GiB)[0]


def test_create_makes_private_dir_and_empty_devices(tmp_path):
    devices = create_fake_devices(tmp_path / "gpus", 3, GiB)
    assert [d.index for d in devices] == [0, 1, 2]
    assert stat.S_IMODE(os.stat(tmp_path / "gpus").st_mode) == 0o700
    assert all(d.usage() == 0 and d.capacity == GiB and d.lease_holder() is None for d in devices)


def test_create_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        create_fake_devices(tmp_path, 1, 0)
    with pytest.raises(ValueError, match="num_gpus=-1"):
        create_fake_devices(tmp_path, -1, GiB)


def test_missing_device_names_the_file(tmp_path):
    create_fake_devices(tmp_path, 1, GiB)
    with pytest.raises(FileNotFoundError, match="gpu5.json"):
        FakeDevice(tmp_path, 5)


def test_set_usage_is_absolute_per_holder_and_tag(device):
    device.set_lease_holder("actor")
    device.set_usage("actor", "weights", 100)
    device.set_usage("actor", "optimizer", 300)
    device.set_usage("actor", "weights", 150)  # absolute, not a delta
    assert device.usage() == 450
    assert device.usage(holder="actor", tag="weights") == 150
    assert device.usage(tag="optimizer") == 300
    assert device.holders() == {"actor": 450}
    device.set_usage("actor", "weights", 0)
    device.set_usage("actor", "optimizer", 0)
    assert device.holders() == {}


def test_growth_without_lease_names_device_grower_and_holder(device):
    device.set_lease_holder("rollout")
    with pytest.raises(LeaseViolation, match=r"fake gpu 0: 'actor' tried to grow 'weights'.*held by 'rollout'"):
        device.set_usage("actor", "weights", 1)
    device.set_lease_holder(None)
    with pytest.raises(LeaseViolation, match="held by nobody"):
        device.set_usage("rollout", "kv_cache", 1)
    assert device.usage() == 0  # refused changes leave no trace
    assert [e["kind"] for e in device.history()] == ["lease", "lease"]


def test_previous_holder_may_shrink_after_handover(device):
    device.set_lease_holder("actor")
    device.set_usage("actor", "weights", GiB)
    device.set_lease_holder("rollout")
    device.set_usage("rollout", "kv_cache", 2 * GiB)
    device.set_usage("actor", "weights", GiB // 2)
    device.set_usage("actor", "weights", 0)
    with pytest.raises(LeaseViolation):
        device.set_usage("actor", "weights", 1)
    assert device.holders() == {"rollout": 2 * GiB}


def test_exceeding_capacity_names_device_capacity_and_usage(device):
    device.set_lease_holder("actor")
    device.set_usage("actor", "weights", 3 * GiB)
    with pytest.raises(FakeOutOfMemory, match=r"fake gpu 0: .*needs 5\.0 GiB of capacity 4\.0 GiB; in use: actor=3\.0 GiB"):
        device.set_usage("actor", "optimizer", 2 * GiB)
    device.set_usage("actor", "optimizer", GiB)  # exactly full is fine
    assert device.usage() == 4 * GiB


def test_history_records_every_change(device):
    device.set_lease_holder("actor")
    device.set_usage("actor", "weights", 10)
    device.set_lease_holder(None)
    device.set_usage("actor", "weights", 4)
    history = device.history()
    assert [e["seq"] for e in history] == [1, 2, 3, 4]
    assert [(e["kind"], e["holder"], e["tag"], e["nbytes"], e["lease_holder"], e["total"]) for e in history] == [
        ("lease", "actor", None, 0, "actor", 0),
        ("usage", "actor", "weights", 10, "actor", 10),
        ("lease", None, None, 0, None, 10),
        ("usage", "actor", "weights", 4, None, 4),
    ]
    assert all(a["ts"] <= b["ts"] for a, b in zip(history, history[1:]))


def test_history_ignores_writes_of_a_killed_writer(device):
    device.set_lease_holder("actor")
    history_file = device._paths.history
    # A writer killed after its write-ahead line (seq 2 is never committed) and one killed mid-line.
    with open(history_file, "a") as f:
        f.write(json.dumps({"seq": 2, "kind": "usage", "holder": "ghost", "tag": "x", "nbytes": 9}) + "\n")
        f.write('{"seq": 3, "kind": "us')
    device.set_usage("actor", "weights", 5)
    assert [(e["seq"], e["holder"]) for e in device.history()] == [(1, "actor"), (2, "actor")]


def test_visible_fake_devices_follow_env(tmp_path, monkeypatch):
    create_fake_devices(tmp_path, 4, GiB)
    monkeypatch.delenv("TANDEM_FAKE_GPU_DIR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert visible_fake_devices() == []
    monkeypatch.setenv("TANDEM_FAKE_GPU_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert [d.index for d in visible_fake_devices()] == [3, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_fake_devices() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5e3a")
    with pytest.raises(ValueError, match="must list fake gpu indices"):
        visible_fake_devices()


def _role(root, index, name, commands, replies):
    """A role process: runs the commands the test sends, replies with results or errors."""
    device = FakeDevice(root, index)
    for command, nbytes in iter(commands.get, None):
        try:
            if command == "work":  # onload, compute, offload: what a colocated role does per turn
                device.set_usage(name, "weights", nbytes)
                device.set_usage(name, "activations", nbytes // 2)
                device.set_usage(name, "activations", 0)
                device.set_usage(name, "weights", 0)
            elif command == "grow":
                device.set_usage(name, "weights", nbytes)
            elif command == "ping":
                pass
            elif command == "churn":  # many small changes, racing the other process
                for i in range(nbytes):
                    device.set_usage(name, f"t{i % 7}", i + 1 if name == "grower" else 0)
            replies.put(("ok", device.usage(holder=name)))
        except Exception as e:  # the test asserts on the type and message
            replies.put((type(e).__name__, str(e)))


@pytest.fixture
def roles(tmp_path):
    """Start spawn role processes on fake gpu 0; stops and reaps them after the test."""
    ctx = mp.get_context("spawn")
    started = []

    def start(root, *names):
        queues = {}
        for name in names:
            commands, replies = ctx.Queue(), ctx.Queue()
            process = ctx.Process(target=_role, args=(str(root), 0, name, commands, replies), daemon=True)
            process.start()
            started.append((process, commands))
            queues[name] = (commands, replies)
        return queues

    yield start
    for process, commands in started:
        commands.put(None)
    for process, _ in started:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


@pytest.mark.timeout(60)
def test_two_processes_alternate_under_leases(tmp_path, roles):
    device = create_fake_devices(tmp_path, 1, 4 * GiB)[0]
    queues = roles(tmp_path, "actor", "rollout")
    for _ in range(3):
        for name, (commands, replies) in queues.items():
            device.set_lease_holder(name)
            commands.put(("work", GiB))
            assert replies.get(timeout=30) == ("ok", 0)
            device.set_lease_holder(None)

    # The rollout process grows while the actor holds the lease: refused, named.
    commands, replies = queues["actor"]
    device.set_lease_holder("actor")
    commands.put(("grow", GiB))
    assert replies.get(timeout=30) == ("ok", GiB)
    commands, replies = queues["rollout"]
    commands.put(("grow", GiB))
    kind, message = replies.get(timeout=30)
    assert kind == "LeaseViolation"
    assert "fake gpu 0" in message and "'rollout'" in message and "held by 'actor'" in message

    history = device.history()
    assert len([e for e in history if e["kind"] == "usage"]) == 3 * 2 * 4 + 1
    assert check_no_overlap(history) == []
    assert device.holders() == {"actor": GiB}


@pytest.mark.timeout(60)
def test_concurrent_writers_keep_an_exact_ledger(tmp_path, roles):
    """The lease holder grows while the previous holder frees its residual, at the same time."""
    device = create_fake_devices(tmp_path, 1, 4 * GiB)[0]
    device.set_lease_holder("shrinker")
    for i in range(7):
        device.set_usage("shrinker", f"t{i}", 1000)
    device.set_lease_holder("grower")
    queues = roles(tmp_path, "grower", "shrinker")
    num_changes = 300
    for commands, replies in queues.values():  # both processes up before either starts
        commands.put(("ping", 0))
        replies.get(timeout=30)
    for commands, _ in queues.values():
        commands.put(("churn", num_changes))
    results = {name: replies.get(timeout=50) for name, (_, replies) in queues.items()}
    # The grower's last write for each tag i % 7 is the largest i + 1 with that remainder.
    expected = sum(max(i + 1 for i in range(num_changes) if i % 7 == t) for t in range(7))
    assert results == {"grower": ("ok", expected), "shrinker": ("ok", 0)}
    history = device.history()
    assert [e["seq"] for e in history] == list(range(1, len(history) + 1))
    assert len(history) == 7 + 2 + 2 * num_changes
    # Replaying the history reproduces every recorded total: no lost or torn update.
    current = {}
    for entry in history:
        if entry["kind"] == "usage":
            current[(entry["holder"], entry["tag"])] = entry["nbytes"]
        assert entry["total"] == sum(current.values())
    assert check_no_overlap(history) == []


def _usage(seq, holder, tag, nbytes, lease_holder="absent"):
    entry = {"seq": seq, "kind": "usage", "holder": holder, "tag": tag, "nbytes": nbytes}
    if lease_holder != "absent":
        entry["lease_holder"] = lease_holder
    return entry


def _lease(seq, holder):
    return {"seq": seq, "kind": "lease", "holder": holder, "tag": None, "nbytes": 0, "lease_holder": holder}


def test_check_no_overlap_reports_growth_by_non_holder():
    history = [
        _lease(1, "actor"),
        _usage(2, "actor", "weights", 100, "actor"),
        _usage(3, "critic", "weights", 50, "actor"),
        _usage(4, "critic", "weights", 0, "actor"),  # shrinking is fine
    ]
    assert check_no_overlap(history) == [
        "seq 3: 'critic' grew 'weights' 0 B -> 50 B while the lease was held by 'actor'"]


def test_check_no_overlap_reports_interleaved_growing_periods():
    # No lease records (a hand-made ledger): actor, critic, actor growing without any handover.
    history = [
        _usage(1, "actor", "weights", 100),
        _usage(2, "critic", "weights", 100),
        _usage(3, "actor", "weights", 80),  # a shrink is not growth
        _usage(4, "actor", "optimizer", 200),
    ]
    problems = check_no_overlap(history)
    assert len(problems) == 1
    assert problems[0].startswith("seq 4: 'actor' grew 'optimizer' 0 B -> 200 B, but 'critic' grew since")
    assert "growing periods interleave" in problems[0]


def test_check_no_overlap_accepts_alternation_with_handovers_and_residuals():
    history = [
        _lease(1, "actor"),
        _usage(2, "actor", "weights", 100, "actor"),
        _lease(3, "rollout"),
        _usage(4, "rollout", "kv_cache", 300, "rollout"),
        _usage(5, "actor", "weights", 0, "rollout"),  # the previous holder frees its residual
        _lease(6, "actor"),
        _usage(7, "actor", "weights", 100, "actor"),
    ]
    assert check_no_overlap(history) == []
