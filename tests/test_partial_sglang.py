"""Partial rollouts on the sglang adapter (roles/rollout/sglang_backend.py, BoardWatch): the
driver's abort reaches sglang as `abort_request(abort_all=True)` on the engine's own event loop;
what sglang returns for the requests it held (tests/fakes/sglang_engine.py copies it from the
0.5.21 and 0.5.23 source) comes back as the unfinished requests' tokens so far."""

import json
import threading
import time

import pytest

from ppo.tiny_model import EOS_ID
from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.abort_board import AbortBoard
from tests.fakes import sglang_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = 48  # room for the abort to land mid-request on a loaded machine (positions: 64)


@pytest.fixture
def fake_sglang(monkeypatch):
    return sglang_engine.install(monkeypatch, eos_id=EOS_ID)


def greedy(i: int, prompt: list[int], n: int) -> dict:
    return {"id": i, "prompt_ids": prompt, "sampling": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}


@pytest.mark.timeout(120)
def test_the_drivers_abort_ends_sglangs_call_with_the_running_requests_tokens_so_far(ckpt, fake_sglang):
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", dtype="float32"))
    prompts, lengths = [[5, 6], [7, 8], [9, 10, 11], [12, 13]], [2, 3, LONG, LONG]
    reqs = [greedy(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
    full = engine.generate(reqs)
    with AbortBoard.create(groups=[0, 1, 2, 3], chunks=[0] * 4, need=2, lockstep=False) as board:
        def driver() -> None:  # ppo.generate.partial's check, every POLL_S
            while not board.finished()[:2].all():
                time.sleep(0.001)
            board.check()

        thread = threading.Thread(target=driver)
        thread.start()
        got = engine.generate(reqs, abort_board=board.path)
        thread.join(10)
        assert board.finished().tolist() == [True, True, False, False]
    assert [(r["token_ids"], r["finish_reason"]) for r in got[:2]] == [(r["token_ids"], "length") for r in full[:2]]
    # the running request ran one forward more and kept its token (scheduler.py's to_finish);
    # the queued one never started (popped from the waiting queue); neither is issued again
    cut, queued = got[2], got[3]
    n = len(cut["token_ids"])
    assert cut["finish_reason"] == "abort" and 0 < n < LONG and cut["num_aborts"] == 0
    assert cut["token_ids"] == full[2]["token_ids"][:n] and cut["logprobs"] == full[2]["logprobs"][:n]
    assert (queued["token_ids"], queued["logprobs"], queued["finish_reason"]) == ([], [], "abort")
    # continued as ppo.generate.partial sends it: the uninterrupted request's tokens
    rest = engine.generate([greedy(0, prompts[2] + cut["token_ids"], LONG - n)])[0]
    assert rest["token_ids"] == full[2]["token_ids"][n:] and rest["finish_reason"] == "length"


@pytest.mark.slow  # two job starts and 2 rollouts on role processes: past the default suite's budget
@pytest.mark.timeout(600)
def test_tiny_ppo_with_partial_rollouts_on_fake_sglang_buffers_and_continues_its_stragglers(tmp_path, monkeypatch):
    import ppo.setup.job
    from ppo.config.recipes import tiny_ppo
    from ppo.config.serialize import override
    from ppo.loop import train

    monkeypatch.syspath_prepend(str(sglang_engine.write_package(tmp_path / "site")))
    monkeypatch.setattr(ppo.setup.job, "rollout_backend_problem", lambda cfg: None)  # no GPU: the fake needs none
    cfg = override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=2, num_critic_only_steps=0,
                   rollout_batch_size=8, over_sampling_batch_size=12, n_samples_per_prompt=4, global_batch_size=32,
                   micro_batch_size=32, rollout_backend="sglang", partial_rollout=True, eval_interval=None,
                   eval_prompt_data=None)
    history = train(cfg)
    assert [h["step"] for h in history] == [0, 1]
    assert [h["rollout/partial_buffered_groups"] for h in history] == [4, 4]  # 12 started, 8 trained
    # made and trained on by the same weights: sglang's log-probs are the actor's (later, carried
    # tokens come from older weights than the trainer's)
    assert history[0]["rollout/log_probs_diff"] < 1e-4, [h["rollout/log_probs_diff"] for h in history]
    assert history[1]["rollout/partial_resumed_groups"] >= 1
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples" / "rollout_00001.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(r["finish_reason"] in ("stop", "length") for r in rows)
