"""Streamed generation in the built-in engine (RolloutEngine.stream, scheduler.py's running batch):
requests join the batch while others decode, each comes back when it finishes, and every result is
the one a blocking generate call gives."""

import pytest

from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.aborts import RequestsAborted

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = [[5, 14, 6, 17], [9, 8, 30], [7, 8, 9, 10, 11]]


def engine(ckpt, sync_every=2, max_batch_size=8):
    return RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", seed=0, max_batch_size=max_batch_size,
                                      options={"sync_every": sync_every}))


def request(rid, prompt, max_new_tokens, **sampling):
    return {"id": rid, "prompt_ids": prompt, "sampling": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                          "ignore_eos": True, **sampling}}


def drain(e, session, first, until_ids):
    """Stream `first`, then call with nothing new until every id of `until_ids` came back; the
    results in the order they came back."""
    got = e.stream(session, first, wait_s=0.0)
    while not {r["id"] for r in got} >= set(until_ids):
        got += e.stream(session, [], wait_s=0.0)
    return got


def test_a_request_streamed_while_a_long_batch_runs_finishes_before_that_batch(ckpt):
    e = engine(ckpt)
    longs = [request(i, p, 40) for i, p in enumerate(LONG)]
    assert e.stream("s", longs, wait_s=0.0) == []  # one sync (2 steps): nothing finished yet
    assert e.stream("s", [], wait_s=0.0) == []
    short = request(10, [20, 21, 22], 3)
    got = e.stream("s", [short], wait_s=0.0)  # joins the running batch at once: its own slot
    while not any(r["id"] == 10 for r in got):
        got += e.stream("s", [], wait_s=0.0)
    assert [r["id"] for r in got] == [10]  # back while all three long requests still decode
    stats = e._backend.scheduler.last_stats
    assert stats["admitted_while_decoding"] == 1 and stats["num_prefills"] == 2
    rest = drain(e, "s", [], [0, 1, 2])
    assert sorted(r["id"] for r in rest) == [0, 1, 2]
    assert e.stream("s", [], wait_s=0.0) == [] and e.engine_state() == "ready"

    # token for token what blocking calls give (greedy; fp32), in a batch of their own and alone
    streamed = {r["id"]: r for r in got + rest}
    blocking = {r["id"]: r for r in e.generate(longs) + e.generate([short])}
    for rid, r in streamed.items():
        assert r["token_ids"] == blocking[rid]["token_ids"]
        assert r["logprobs"] == pytest.approx(blocking[rid]["logprobs"], abs=1e-5)
        assert r["finish_reason"] == "length" and r["num_aborts"] == 0 and r["weight_version"] == 0


def test_streamed_turns_reuse_their_kv_and_seeded_samples_equal_the_blocking_ones(ckpt):
    e, cold = engine(ckpt), engine(ckpt)
    # the budget of the whole response (as ppo.generate does), so the second turns fit the first's slots
    stops = {"temperature": 1.0, "ignore_eos": False, "stop_token_ids": list(range(10, 16))}
    firsts = [request(i, p, 30, seed=100 + i, **stops) for i, p in enumerate(LONG)]
    turn1 = {r["id"]: r for r in drain(e, "s", firsts, [0, 1, 2])}
    assert all(len(r["token_ids"]) < 20 for r in turn1.values())
    seconds = [request(10 + i, p + turn1[i]["token_ids"] + [40, 41], 30 - len(turn1[i]["token_ids"]) - 2,
                       seed=200 + i, **stops) for i, p in enumerate(LONG)]
    turn2 = {r["id"]: r for r in drain(e, "s", seconds, [10, 11, 12])}
    assert e._backend.scheduler.last_stats["reused_tokens"] > 0  # the second turns continued their slots
    want = {r["id"]: r for r in cold.generate(firsts) + cold.generate(seconds)}
    for rid, r in {**turn1, **turn2}.items():
        assert r["token_ids"] == want[rid]["token_ids"]
        assert r["logprobs"] == pytest.approx(want[rid]["logprobs"], abs=1e-5)


def test_a_request_too_long_for_the_running_slots_waits_for_the_batch_to_drain(ckpt):
    e = engine(ckpt)
    got = e.stream("s", [request(0, LONG[0], 6)], wait_s=0.0)
    slot_len = e._backend.scheduler.batch.geometry.slot_len
    long = request(1, LONG[1], slot_len + 4)  # does not fit these slots
    got = drain(e, "s", [long], [0, 1]) + got
    assert sorted(r["id"] for r in got) == [0, 1]
    assert e._backend.scheduler.cache.geometry.slot_len > slot_len
    assert {r["id"]: r["token_ids"] for r in got}[1] == e.generate([long])[0]["token_ids"]


def test_another_session_generate_or_release_drops_the_streamed_requests(ckpt, monkeypatch):
    e = engine(ckpt)
    e.stream("a", [request(0, LONG[0], 30)], wait_s=0.0)
    assert e._backend.scheduler.held_ids() == [0]
    drops = []
    drop = e._backend.drop_stream
    monkeypatch.setattr(e._backend, "drop_stream", lambda: (drops.append(1), drop()))
    got = drain(e, "b", [request(0, LONG[1], 2)], [0])  # id 0 again: session a's request is gone
    assert len(drops) == 1  # session a's requests and its kept K/V go in one drop
    assert e._backend.scheduler.held_ids() == []
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in e.generate([request(0, LONG[1], 2)])]
    e.stream("b", [request(1, LONG[0], 30)], wait_s=0.0)
    e.generate([request(0, LONG[2], 2)])  # the stream's caller moved on
    assert e._backend.scheduler.held_ids() == [] and e.engine_state() == "ready"
    e.stream("b", [request(2, LONG[0], 30)], wait_s=0.0)
    e.release(["kv_cache"])
    assert e._backend.scheduler.held_ids() == [] and e.engine_state() == "kv_cache_released"
    e.resume(["kv_cache"])
    e.stream("c", [request(3, LONG[0], 30)], wait_s=0.0)
    with pytest.raises(ValueError, match="already streaming"):
        e.stream("c", [request(3, LONG[1], 30)], wait_s=0.0)
    assert e._backend.scheduler.held_ids() == []  # an error drops the stream


def test_a_session_continues_only_its_own_turns_kv_and_none_waits_past_a_finish(ckpt):
    """A new session (a new rollout) starts with no kept K/V, so what it computes does not depend
    on the sessions before it; wait_s None (the driver's lockstep) decodes until a finish."""
    e = engine(ckpt)
    # the budget of the whole response (as ppo.generate does), so later turns fit the first's slot
    stops = {"temperature": 1.0, "ignore_eos": False, "stop_token_ids": list(range(10, 16))}

    def turn(rid, session, before):
        prompt = before["prompt_ids"] + before["token_ids"] + [40, 41]
        req = request(rid, prompt, 30 - (len(prompt) - len(LONG[0])), seed=100 + rid, **stops)
        return dict(drain(e, session, [req], [rid])[0], prompt_ids=prompt)

    first = dict(drain(e, "a", [request(0, LONG[0], 30, seed=100, **stops)], [0])[0], prompt_ids=LONG[0])
    second = turn(1, "b", first)
    assert e._backend.scheduler.last_stats["reused_tokens"] == 0  # another session's turn: prefilled whole
    turn(2, "b", second)
    assert e._backend.scheduler.last_stats["reused_tokens"] > 0  # its own session's: continued
    got = e.stream("c", [request(3, LONG[1], 30)], wait_s=None)  # one call, however long it decodes
    assert [(r["id"], len(r["token_ids"])) for r in got] == [(3, 30)]


def test_aborted_streamed_requests_rejoin_with_their_seeds_and_count_their_aborts(ckpt, monkeypatch):
    e, calm = engine(ckpt), engine(ckpt)
    reqs = [request(i, p, 8, temperature=1.0, seed=7 + i) for i, p in enumerate(LONG)]
    backend = e._backend
    real, hits = backend.stream, []

    def out_of_memory_once(requests, seeds, wait_s):  # as torch_engine/backend.py's OOM: the batch is dropped
        if not hits:
            hits.append(True)
            ids = [r.id for r in requests]
            backend.scheduler.drop_state()
            raise RequestsAborted(ids, "out of memory (injected)")
        return real(requests, seeds, wait_s)

    monkeypatch.setattr(backend, "stream", out_of_memory_once)
    got = {r["id"]: r for r in drain(e, "s", reqs, [0, 1, 2])}
    want = {r["id"]: r for r in calm.generate(reqs)}
    assert all(got[i]["num_aborts"] == 1 and got[i]["token_ids"] == want[i]["token_ids"] for i in want)
