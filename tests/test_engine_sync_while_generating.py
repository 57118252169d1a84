"""A weight sync sent while an engine generates (what --train-async could do; its loop waits
instead, ppo.generate.rollout_ahead): the engine serves one call at a time, so the requests in flight
finish on the old weights and carry the old version, the sync loads after them, and no
request sees half-updated weights. A real engine process (the built-in torch backend); the
sglang adapter is the same RolloutEngine role, whose `generate` is one blocking call too."""

import threading
import time

import pytest

from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm
from roles.rollout import EngineConfig, RolloutEngine
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import send_to_engines
from runtime.events import read_events

pytestmark = pytest.mark.timeout(240)


def requests(n: int) -> list[dict]:
    return [{"id": i, "prompt_ids": [5 + i % 7, 14, 6], "sampling": {"max_new_tokens": 32, "ignore_eos": True,
                                                                     "temperature": 1.0, "seed": 1000 + i}}
            for i in range(n)]


def generating_spans(run_dir) -> list[tuple[float, float]]:
    """(start, end) of each of rollout-0's generate calls, from its lifecycle events."""
    spans, start = [], None
    for e in read_events(run_dir):
        if e["event"] == "state" and e.get("role") == "rollout-0":
            if e["new"] == "generating":
                start = e["ts"]
            elif e["old"] == "generating":
                spans.append((start, e["ts"]))
    return spans


def test_a_sync_sent_mid_generation_loads_after_it_and_its_results_are_all_old_weights(sup, run_dir, ckpt, tmp_path):
    other = load_causal_lm(build_tiny_checkpoint(str(tmp_path / "other"), seed=1), "float32")
    engine = sup.spawn("rollout-0", RolloutEngine, EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=8))
    sup.wait_ready(timeout=180)
    reqs = requests(32)
    old = engine.generate.call(reqs).result(120)  # the old weights' answers (each request seeded)

    in_flight = engine.generate.call(reqs)
    while sum(e["event"] == "state" and e.get("role") == "rollout-0" and e["new"] == "generating"
              for e in read_events(run_dir)) < 2:
        time.sleep(0.005)  # until the second generate has begun
    synced = {}

    def sync():  # from another thread, as the actor's process would send it
        synced["sent"] = time.time()
        send_to_engines(other.state_dict().items(), [engine], buffer_bytes=16 * 1024)
        engine.set_weight_version.call(1).result(60)
        synced["done"] = time.time()

    sender = threading.Thread(target=sync)
    sender.start()
    during = in_flight.result(120)
    sender.join(120)

    (_, _), (began, ended) = generating_spans(run_dir)[:2]
    assert began < synced["sent"] < ended, "the sync was not sent while the engine generated"
    assert synced["done"] > ended  # it loaded after the requests in flight finished
    assert {r["weight_version"] for r in during} == {0}
    assert [(r["token_ids"], r["logprobs"]) for r in during] == [(r["token_ids"], r["logprobs"]) for r in old]

    after = engine.generate.call(reqs).result(120)
    assert {r["weight_version"] for r in after} == {1}
    assert engine.weights_checksum.call().result(60) == checksum_named_tensors(other.state_dict().items())
    assert [r["logprobs"] for r in after] != [r["logprobs"] for r in old]
