"""The nodes of a job meet in node 0's c10d TCPStore (runtime.rendezvous.meet): each publishes
its control endpoint and CURVE public key, signed under the job's secret, and reads the others';
every way it fails is one line within the timeout, and an entry that is not signed under the
job's secret takes no node's place."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from runtime.curve import KeyPair
from runtime.rendezvous import NodeEntry, RendezvousFailed, meet
from runtime.signing import JobSecret

SECRET = JobSecret(b"the job's secret, 32 characters!", job="4242")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def entry(rank: int) -> NodeEntry:
    return NodeEntry(rank, f"tcp://127.0.0.1:{7000 + rank}", KeyPair.new().public)


def test_every_node_reads_every_entry():
    port, entries = free_port(), [entry(r) for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=3, entry=entries[0], secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)  # node 0 first, as a launcher that waits for it would find it
        others = [pool.submit(meet, "127.0.0.1", port, nnodes=3, entry=e, secret=SECRET, timeout_s=20, host=False)
                  for e in entries[1:]]
        seen = [f.result(timeout=30).nodes for f in [host, *others]]
    assert all(nodes == entries for nodes in seen)


def test_node_0_unreachable_is_one_line_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(RendezvousFailed) as err:
        meet("127.0.0.1", free_port(), nnodes=2, entry=entry(1), secret=SECRET, timeout_s=1.0, host=False)
    assert time.monotonic() - started < 3
    assert "\n" not in str(err.value) and "did not answer within 1 s" in str(err.value)
    assert "--master-addr" in str(err.value)


def test_a_missing_node_is_named():
    with pytest.raises(RendezvousFailed, match=r"node\(s\) 1, 2 of 3 did not join .* within 0.5 s"):
        meet("127.0.0.1", free_port(), nnodes=3, entry=entry(0), secret=SECRET, timeout_s=0.5, host=True)


def test_two_launchers_with_one_rank_are_refused():
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=entry(0), secret=SECRET, timeout_s=10, host=True)
        time.sleep(0.2)
        with ThreadPoolExecutor(1) as second:
            first = second.submit(meet, "127.0.0.1", port, nnodes=2, entry=entry(1), secret=SECRET, timeout_s=10,
                                  host=False)
            first.result(timeout=20)
        with pytest.raises(RendezvousFailed, match="^another launcher already joined as node 1: give each launcher"):
            meet("127.0.0.1", port, nnodes=2, entry=entry(1), secret=SECRET, timeout_s=1, host=False)
        host.result(timeout=20)


def test_a_job_started_again_on_its_store_meets_afresh_whichever_node_comes_first():
    """torchrun's agent store serves every restart of its workers: the entries of the earlier start
    are still there, its node 1's place too. Node 1 of the new start, up first, waits for the new
    node 0's epoch instead of joining the old one's or being refused as a second node 1."""
    port, before, after = free_port(), [entry(0), entry(1)], [entry(0), entry(1)]
    with ThreadPoolExecutor(2) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=before[0], secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)
        meet("127.0.0.1", port, nnodes=2, entry=before[1], secret=SECRET, timeout_s=20, host=False)
        earlier = host.result(timeout=30)  # its store serves on, as the agent's does
        node_1 = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=after[1], secret=SECRET, timeout_s=20,
                             host=False)
        time.sleep(1.0)  # node 1 found its place in the earlier start taken, and waits
        assert not node_1.done()
        node_0 = meet("127.0.0.1", port, nnodes=2, entry=after[0], secret=SECRET, timeout_s=20, host=False)
        again = node_1.result(timeout=30)
    assert node_0.nodes == again.nodes == after
    assert node_0.run == again.run != earlier.run and node_0.prefix == "tandem/2" and earlier.prefix == "tandem/1"


def until(predicate, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def a_start_that_died_alone(nnodes: int):
    """A store that outlives its starts, as torchrun's agent's does, and the epoch of a start whose
    node 0 died before any other node joined: node 0's entry is there, every other place free."""
    from runtime.rendezvous import host_store

    store = host_store("127.0.0.1", nnodes)
    with pytest.raises(RendezvousFailed, match="did not join"):
        meet("127.0.0.1", store.port, nnodes=nnodes, entry=entry(0), secret=SECRET, timeout_s=0.3, host=False)
    return store


def test_a_node_that_met_an_earlier_starts_node_0_meets_the_new_one_once_it_opens_its_epoch():
    """A node of the new start that reads the epochs before the new node 0 opens its own joins the
    earlier start's epoch where its place is free, and meets the dead node 0 there. It learns of
    the new start from the store (Rendezvous.superseded) and meets again, in the new epoch."""
    store = a_start_that_died_alone(2)
    port, after = store.port, [entry(0), entry(1)]
    stale = meet("127.0.0.1", port, nnodes=2, entry=after[1], secret=SECRET, timeout_s=20, host=False)
    assert stale.epoch == 1 and stale.nodes[0] != after[0] and not stale.superseded()
    with ThreadPoolExecutor(1) as pool:
        node_0 = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=after[0], secret=SECRET, timeout_s=20,
                             host=False)
        assert until(stale.superseded, 10)
        again = meet("127.0.0.1", port, nnodes=2, entry=after[1], secret=SECRET, timeout_s=20, host=False)
        assert node_0.result(timeout=30).nodes == again.nodes == after and again.epoch == 2


def test_a_node_waiting_in_an_earlier_starts_epoch_moves_to_the_new_one():
    """The same, caught while the node still waits there, for a node the earlier start never had:
    it leaves the earlier epoch once a newer one opens, and every node of the new start meets."""
    store = a_start_that_died_alone(3)
    port, after = store.port, [entry(0), entry(1), entry(2)]
    with ThreadPoolExecutor(2) as pool:
        node_1 = pool.submit(meet, "127.0.0.1", port, nnodes=3, entry=after[1], secret=SECRET, timeout_s=20,
                             host=False)
        assert until(lambda: store.check(["tandem/1/node/0/1/1"]), 10)  # node 1 offered itself in epoch 1
        node_0 = pool.submit(meet, "127.0.0.1", port, nnodes=3, entry=after[0], secret=SECRET, timeout_s=20,
                             host=False)
        # node 2 after the new epoch opens (before, it would meet in epoch 1, as node 1 did above)
        assert until(lambda: store.add("tandem/epochs", 0) == 2, 10)
        node_2 = meet("127.0.0.1", port, nnodes=3, entry=after[2], secret=SECRET, timeout_s=20, host=False)
        met = [node_0.result(timeout=30), node_1.result(timeout=30), node_2]
    assert all(r.nodes == after and r.epoch == 2 for r in met)


def test_a_store_that_ended_supersedes_nothing():
    """Node 0's own launcher serves its store; once it ends there is no newer epoch to meet in,
    and the hello's timeout decides (superseded is False, and asks no more)."""
    from runtime.rendezvous import host_store

    store = host_store("127.0.0.1", 2)
    with ThreadPoolExecutor(1) as pool:
        node_0 = pool.submit(meet, "127.0.0.1", store.port, nnodes=2, entry=entry(0), secret=SECRET, timeout_s=20,
                             host=False)
        node_1 = meet("127.0.0.1", store.port, nnodes=2, entry=entry(1), secret=SECRET, timeout_s=20, host=False)
        node_0.result(timeout=30)
    del store, node_0
    import gc

    gc.collect()  # the server goes with its last reference
    assert node_1.superseded() is False and node_1._store_gone  # it found the store gone ...
    node_1.store = None  # ... and asks it no more (a call would raise AttributeError)
    assert node_1.superseded() is False


def test_a_lost_node_joins_again_in_a_new_generation():
    from runtime.rendezvous import call_back

    port, entries = free_port(), [entry(0), entry(1)]
    with ThreadPoolExecutor(2) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=entries[0], secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)
        meet("127.0.0.1", port, nnodes=2, entry=entries[1], secret=SECRET, timeout_s=20, host=False)
        rdv = host.result(timeout=30)
        # node 1 lost: a launcher of rank 1 started before node 0 calls it back finds its place taken
        # and is refused once the timeout passes, unless node 0 calls it back meanwhile ...
        with pytest.raises(RendezvousFailed, match="already joined as node 1"):
            meet("127.0.0.1", port, nnodes=2, entry=entry(1), secret=SECRET, timeout_s=1, host=False)
        early = entry(1)
        waiting = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=early, secret=SECRET, timeout_s=20, host=False)
        time.sleep(0.5)
        assert not waiting.done()
        assert call_back(rdv, 1, entries[0], timeout_s=20) == early
        assert waiting.result(timeout=30).nodes == [entries[0], early]
        # ... and one started after a call back is let in, meeting node 0 alone
        back = pool.submit(call_back, rdv, 1, entries[0], timeout_s=20)
        time.sleep(0.2)
        again = entry(1)
        joined = meet("127.0.0.1", port, nnodes=2, entry=again, secret=SECRET, timeout_s=20, host=False)
        assert joined.nodes == [entries[0], again]
        assert back.result(timeout=30) == again


def test_a_call_back_of_another_node_lets_no_second_launcher_of_a_live_rank_in():
    from runtime.rendezvous import call_back

    port, entries = free_port(), [entry(0), entry(1), entry(2)]
    with ThreadPoolExecutor(3) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=3, entry=entries[0], secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)
        others = [pool.submit(meet, "127.0.0.1", port, nnodes=3, entry=e, secret=SECRET, timeout_s=20, host=False)
                  for e in entries[1:]]
        [f.result(timeout=30) for f in others]
        rdv = host.result(timeout=30)
        back = pool.submit(call_back, rdv, 2, entries[0], timeout_s=20)  # node 2 lost, node 1 alive
        time.sleep(0.3)
        with pytest.raises(RendezvousFailed, match="already joined as node 1"):
            meet("127.0.0.1", port, nnodes=3, entry=entry(1), secret=SECRET, timeout_s=1, host=False)
        again = entry(2)
        assert meet("127.0.0.1", port, nnodes=3, entry=again, secret=SECRET, timeout_s=20, host=False).nodes == \
            [entries[0], again]
        assert back.result(timeout=30) == again


def test_a_lost_node_that_never_comes_back_is_one_line():
    from runtime.rendezvous import call_back

    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=entry(0), secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)
        meet("127.0.0.1", port, nnodes=2, entry=entry(1), secret=SECRET, timeout_s=20, host=False)
        rdv = host.result(timeout=30)
    with pytest.raises(RendezvousFailed, match=r"^node 1 did not come back within 0.5 s \(--rendezvous-timeout-s\)$"):
        call_back(rdv, 1, entry(0), timeout_s=0.5)


def test_a_node_admits_node_0_before_its_own_entry_is_there_to_dial():
    import torch.distributed as dist

    port, entries, seen = free_port(), [entry(0), entry(1)], []

    def admit(node_0: NodeEntry) -> None:  # as NodeAgent.admit: node 0 must not find node 1 before this
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        seen.append((node_0, store.check(["tandem/1/offers/0/1", "tandem/1/node/0/1/1"])))

    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=entries[0], secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)
        meet("127.0.0.1", port, nnodes=2, entry=entries[1], secret=SECRET, timeout_s=20, host=False, on_node_0=admit)
        host.result(timeout=30)
    assert seen == [(entries[0], False)]


def test_an_impostor_that_writes_a_nodes_entry_first_is_refused_and_the_real_node_joins(caplog):
    """Whoever reaches node 0's store can write there before node 1 does: one with a secret of
    its own, and one that signs nothing. Neither takes node 1's place; each is logged, naming
    node 1; node 1 joins after them."""
    import json

    import torch.distributed as dist

    from runtime.rendezvous import _Board

    port, entries = free_port(), [entry(0), entry(1)]
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=entries[0], secret=SECRET, timeout_s=20, host=True)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        while not store.check(["tandem/1/node/0/0/1"]):  # node 0's entry: its run is in the clear
            time.sleep(0.05)
        run = json.loads(store.get("tandem/1/node/0/0/1"))["run"]
        wrong = JobSecret(b"a secret of its own, 32 chars...", job=SECRET.job)
        # the impostor writes as a launcher does, with its own key pair and endpoint
        _Board(store, "tandem/1", 0, wrong, "here").offer(entry(1), run, time.monotonic() + 5, TimeoutError)
        slot = store.add("tandem/1/offers/0/1", 1)  # and one unsigned
        store.set(f"tandem/1/node/0/1/{slot}", json.dumps({"endpoint": "tcp://127.0.0.1:9", "public_key": "x",
                                                         "run": run}))
        joined = meet("127.0.0.1", port, nnodes=2, entry=entries[1], secret=SECRET, timeout_s=20, host=False)
        assert joined.nodes == entries
        assert host.result(timeout=30).nodes == entries
    refused = [r.getMessage() for r in caplog.records if "refused an entry" in r.getMessage()]
    assert any("for node 1" in m and "slot 1" in m and "does not verify under this job's TANDEM_JOB_SECRET" in m
               for m in refused), refused
    assert any("for node 1" in m and "slot 2" in m and "is not signed" in m for m in refused), refused
    assert all("\n" not in m for m in refused)


def test_a_good_entry_copied_to_another_slot_does_not_verify():
    """An impostor that copies node 1's signed entry (the store is readable) to a slot of its own
    does not become node 1 either: the signature covers the slot."""
    import json

    import torch.distributed as dist

    port, entries = free_port(), [entry(0), entry(1)]
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(meet, "127.0.0.1", port, nnodes=2, entry=entries[0], secret=SECRET, timeout_s=20, host=True)
        time.sleep(0.2)
        meet("127.0.0.1", port, nnodes=2, entry=entries[1], secret=SECRET, timeout_s=20, host=False)
        host.result(timeout=30)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        signed = json.loads(store.get("tandem/1/node/0/1/1"))
        # node 1 lost and called back: the copy goes first in the new generation, then node 1 itself
        from runtime.rendezvous import call_back

        back = pool.submit(call_back, host.result(), 1, entries[0], timeout_s=20)
        while not store.check(["tandem/1/generation"]):
            time.sleep(0.05)
        slot = store.add("tandem/1/offers/1/1", 1)
        store.set(f"tandem/1/node/1/1/{slot}", json.dumps(signed))
        again = entry(1)
        assert meet("127.0.0.1", port, nnodes=2, entry=again, secret=SECRET, timeout_s=20, host=False).nodes[1] == again
        assert back.result(timeout=30) == again
