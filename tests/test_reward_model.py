"""The reward-model scorer: a one-label HF sequence classifier scoring conversations in
length-sorted micro-batches; refused before anything starts when it is not one or does not
fit; and in tiny_ppo on fake GPUs, a tenant of the memory handoff that the ledger checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.loop import train
from ppo.config.recipes import tiny_ppo
from ppo.generate.rewards import token_shares
from ppo.tiny_model import build_tiny_checkpoint
from roles.device import DeviceMemory
from roles.reward.model import RewardModel, budget_problem, checkpoint_problem, micro_batches
from roles.reward.config import RewardModelConfig
from roles.reward.model_scorer import RewardModelScorer
from roles.reward.rules import REWARD_RULES
from runtime.events import read_events
from runtime.fakegpu import FakeDevice, check_no_overlap

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONS = [("1+1=", "2"), ("2+3=", "5 and more words"), ("9-4=", ""), ("3*3=", "9 9 9 9 9 9 9 9 9 9 9 9")]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("rm") / "tiny-rm"), reward_model=True, seed=1)


def samples():
    return [{"prompt": p, "response": r} for p, r in CONVERSATIONS]


def loaded(path, max_tokens=4096) -> RewardModel:
    model = RewardModel(path, dtype="float32", max_tokens=max_tokens, memory=DeviceMemory("rm"))
    model.onload()
    return model


def test_scores_equal_the_hf_classifiers_own_pooling_one_conversation_at_a_time(rm_path):
    """The slow twin: transformers' forward, one unpadded row at a time, through the same template."""
    model = loaded(rm_path, max_tokens=40)  # several micro-batches of padded rows
    scores, counts = model.score(samples())
    hf = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    tok = model.tokenizer
    for (prompt, response), score in zip(CONVERSATIONS, scores):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                      tokenize=True, return_dict=False)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, 0].item()
        assert score == pytest.approx(want, abs=1e-5)
    assert counts["num_tokens"] == sum(len(f"u {p} a {r} ") for p, r in CONVERSATIONS)
    assert counts["num_padded_tokens"] >= counts["num_tokens"]
    assert len(set(scores)) == len(scores)  # an untrained head still tells them apart


def test_micro_batches_hold_the_token_budget_and_every_row_once():
    lengths = [5, 30, 12, 12, 7, 1, 29]
    batches = micro_batches(lengths, max_tokens=32)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 32 or len(b) == 1 for b in batches)
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert micro_batches([100], max_tokens=8) == [[0]]  # a row longer than the budget goes alone


def test_chat_messages_of_a_chat_prompt_are_what_is_scored(rm_path):
    model = loaded(rm_path)
    chat = {"prompt": "<policy template>1+1=", "response": "2", "messages": [{"role": "user", "content": "1+1="}]}
    assert model.encode([chat]) == model.encode([{"prompt": "1+1=", "response": "2"}])


def test_token_shares_balance_the_ranks_and_keep_every_sample():
    lengths = [10, 1, 9, 2, 8, 3, 7, 4]
    shares = token_shares(lengths, 3)
    assert sorted(i for s in shares for i in s) == list(range(8))
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths) and all(s == sorted(s) for s in shares)
    assert token_shares([4, 4], 3)[2] == []


def test_the_role_scores_only_onloaded_and_reports_its_ledger(rm_path):
    role = RewardModelScorer(RewardModelConfig(path=rm_path, dtype="float32", max_tokens=256))
    with pytest.raises(RuntimeError, match="offloaded"):
        role.score(samples())
    report = role.onload(["weights"])
    assert report["ledger"]["weights"] > 0 and role.state == "onloaded"
    out = role.score(samples())
    assert len(out["scores"]) == 4 and out["seconds"] > 0 and role.state == "onloaded"
    assert role.offload(["weights"])["ledger"] == {} and role.state == "offloaded"
    with pytest.raises(ValueError, match="memory tags"):
        role.onload(["kv_cache"])


def test_checkpoints_that_are_not_reward_models_are_named(tmp_path, rm_path):
    lm = build_tiny_checkpoint(str(tmp_path / "lm"))
    assert "a Qwen3ForCausalLM, not a sequence classifier" in checkpoint_problem(lm)
    two = tmp_path / "two"
    AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=2, ignore_mismatched_sizes=True) \
        .save_pretrained(two)
    assert "has 2 labels" in checkpoint_problem(str(two))
    headless = tmp_path / "headless"
    os.system(f"cp -r {rm_path} {headless}")
    weights = load_file(headless / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "score.weight"}, headless / "model.safetensors",
              metadata={"format": "pt"})
    assert "no score.weight in its safetensors weights" in checkpoint_problem(str(headless))
    untemplated = tmp_path / "untemplated"
    os.system(f"cp -r {rm_path} {untemplated}")
    config = json.loads((untemplated / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (untemplated / "tokenizer_config.json").write_text(json.dumps(config))
    (untemplated / "chat_template.jinja").unlink(missing_ok=True)
    assert "no chat template" in checkpoint_problem(str(untemplated))
    assert checkpoint_problem(rm_path) is None


def test_a_model_larger_than_its_gpu_is_named_with_the_bytes(rm_path):
    assert budget_problem(rm_path, dtype="float32", max_tokens=64, capacity=1 << 30) is None
    problem = budget_problem(rm_path, dtype="float32", max_tokens=1 << 20, capacity=1 << 30)
    assert "--reward-model-max-tokens-per-gpu 1048576 need" in problem and "more than its GPU's 1.0 GiB" in problem


def launch(args, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "--recipe", "tiny_ppo", *args,
                           "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=100)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_launch_refuses_a_causal_lm_or_a_model_too_large_in_one_line_exit_2(tmp_path, rm_path):
    lm = build_tiny_checkpoint(str(tmp_path / "lm"))
    for args, message in [([lm], "not a sequence classifier"),
                          ([rm_path, "--reward-model-max-tokens-per-gpu", str(1 << 30)],
                           "more than its GPU's 80.0 GiB")]:
        proc = launch(["--reward-model-path", *args], tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tandem: --reward-model-path") and message in lines[0], lines
        assert not (tmp_path / "run").exists()


def grown(run_dir, gpu) -> set[str]:
    history = FakeDevice(run_dir / "fakegpu", gpu).history()
    return {h["holder"] for h in history if h.get("kind") == "usage" and h["nbytes"]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_ppo_with_a_colocated_reward_model_takes_its_turn_on_the_engines_gpus(tmp_path, rm_path):
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=2, rollout_batch_size=16,
                                reward_model_path=rm_path, reward_model_coef=0.5, eval_prompt_data=None,
                                eval_interval=None))
    history = train(cfg)
    run = tmp_path / "run"
    for gpu in (0, 1):  # one rank per engine GPU, onloaded and offloaded around its scoring, never overlapping
        assert check_no_overlap(FakeDevice(run / "fakegpu", gpu).history()) == []
        assert {f"reward-model-{gpu}", f"rollout-{gpu}", "actor"} <= grown(run, gpu)
    spans = [(e["role"], e["phase"]) for e in read_events(run) if e["event"] == "phase" and e.get("action") == "span"]
    assert spans.count(("reward-model-0", "onload")) == spans.count(("reward-model-0", "offload")) == 2
    samples = [json.loads(x) for x in (run / "samples" / "rollout_00001.jsonl").read_text().splitlines()]
    for s in samples:  # the weighted sum of the rule's reward and the model's score
        rule = REWARD_RULES[cfg.reward.rm_type](s["response"], s["label"])
        assert s["reward"] == pytest.approx(rule + 0.5 * s["rm_score"], abs=1e-6)
    assert history[-1]["rollout/rm_score"] == pytest.approx(sum(s["rm_score"] for s in samples) / len(samples))
    assert history[-1]["perf/reward_model_tokens_per_s"] > 0 and history[-1]["perf/reward_model_time"] > 0
    # the bench's per-phase table has the scoring phase, counted as compute, and its tokens/s
    from bench.iteration import analyse, report

    rates = {"d2h": 50.0, "h2d": 50.0}
    steps = analyse(run, [(e["ts"], 0, 0) for e in read_events(run)], rates, num_samples=128, prompts={})
    assert all("reward_model" in [r["phase"] for r in s["phases"]] for s in steps)
    assert [s["reward_model_tokens_per_s"] for s in steps] == [h["perf/reward_model_tokens_per_s"] for h in history]
    assert "reward model:" in report(steps, rates)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_model_alone_on_a_gpu_of_its_own_stays_loaded(tmp_path, rm_path):
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=2, rollout_batch_size=16,
                                rm_type=None, reward_model_path=rm_path, reward_model_num_gpus=1,
                                eval_prompt_data=None, eval_interval=None))
    train(cfg)
    run = tmp_path / "run"
    assert grown(run, 2) == {"reward-model-0"} and "reward-model-0" not in grown(run, 0) | grown(run, 1)
    spans = [(e["role"], e["phase"]) for e in read_events(run) if e["event"] == "phase" and e.get("action") == "span"]
    assert spans.count(("reward-model-0", "onload")) == 1 and ("reward-model-0", "offload") not in spans
    assert "reward-0" not in {e.get("role") for e in read_events(run)}  # no rule scorer to start
    samples = [json.loads(x) for x in (run / "samples" / "rollout_00001.jsonl").read_text().splitlines()]
    assert all(s["reward"] == s["rm_score"] for s in samples)


@pytest.mark.gpu
def test_on_a_gpu_it_scores_in_bf16_as_the_cpu_does_in_fp32_and_offloads_to_nothing(rm_path):
    want, _ = loaded(rm_path).score(samples())  # float32 on the CPU
    role = RewardModelScorer(RewardModelConfig(path=rm_path, dtype="bfloat16", max_tokens=40))
    assert role.onload(["weights"])["bytes_in_use"] >= role._model.memory.ledger()["weights"] > 0
    got = role.score(samples())
    assert got["scores"] == pytest.approx(want, abs=0.05)  # bf16 weights and activations
    report = role.offload(["weights"])
    assert report["ledger"] == {} and report["bytes_in_use"] < 1 << 20  # no activation or weight left behind
    assert next(role._model.model.parameters()).device.type == "cpu"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_model_rank_killed_around_its_scoring_is_restarted_and_the_rollout_scored_again(tmp_path, rm_path):
    from bench.faults import after_first_rollout
    from tests.test_faults_ppo import run_with_fault

    history, inj = run_with_fault(tmp_path, "reward-model-0", after_first_rollout("reward-model-0", "onloaded"),
                                  num_rollout=3, rollout_batch_size=16, reward_model_path=rm_path,
                                  eval_prompt_data=None, eval_interval=None,
                                  advantage_estimator="grpo")  # no critic ranks to start: scoring is the test
    assert inj.fired_at and len(history) == 3
    assert sum(h["rollout/scorer_restarts"] for h in history) == 1  # counted with the scorers'
    events = read_events(tmp_path / "run")
    assert any(e["event"] == "restarted" and e["role"] == "reward-model-0" for e in events)
    for gpu in (0, 1):
        assert check_no_overlap(FakeDevice(tmp_path / "run" / "fakegpu", gpu).history()) == []
    for step in range(3):
        rows = [json.loads(x) for x in (tmp_path / "run" / "samples" / f"rollout_{step:05d}.jsonl")
                .read_text().splitlines()]
        assert len(rows) == 128 and all("rm_score" in r for r in rows)
