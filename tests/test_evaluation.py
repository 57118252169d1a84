"""Evaluation during training (ppo.generate.evaluation): miles' flags and schedule, the metrics, the
held-out set, and the contract that an eval leaves training bit for bit as it was."""

import itertools
import json

import pytest

from ppo.generate import evaluation as ev
from ppo.config.cli import parse_args
from ppo.config import ConfigError
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.config.recipes import tiny_ppo
from ppo.prompts.tasks import EVAL_TASKS, TASKS


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The slow twin: the share of all k-subsets of the n samples that hold a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 4, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert ev.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_k_values_are_miles_powers_of_two_up_to_n():
    assert ev.pass_k_values(1) == [1]
    assert ev.pass_k_values(4) == [1, 2, 4]
    assert ev.pass_k_values(6) == [1, 2, 4]
    assert ev.pass_k_values(16) == [1, 2, 4, 8, 16]


def sample(reward, n_tokens, finish="stop", status="ok"):
    return {"reward": reward, "response_ids": [0] * n_tokens, "finish_reason": finish, "reward_status": status}


def test_set_metrics_use_miles_names():
    # 2 prompts x 2 samples: prompt 0 has one right, prompt 1 none; one response cut at the limit
    samples = [sample(1.0, 2), sample(0.0, 4, finish="length"), sample(0.0, 1), sample(0.0, 1, status="error")]
    m = ev.set_metrics("aime", samples, n=2)
    assert m == {
        "eval/aime": 0.25, "eval/aime-pass@1": 0.25, "eval/aime-pass@2": 0.5,
        "eval/aime/response_len/mean": 2.0, "eval/aime/response_len/median": 1.5,
        "eval/aime/response_len/max": 4.0, "eval/aime/response_len/min": 1.0,
        "eval/aime-truncated_ratio": 0.25, "eval/aime-none_reward_ratio": 0.25}


def test_schedule_is_miles_before_training_and_every_interval():
    cfg = tiny_ppo()  # --eval-interval 5
    assert ev.due_before_training(cfg, 0) and not ev.due_before_training(cfg, 1)
    assert not ev.due_before_training(cfg, 7)  # a resumed run: its weights were evaluated before the stop
    assert [s for s in range(20) if ev.due_after(cfg, s)] == [4, 9, 14, 19]
    skip = override(cfg, skip_eval_before_train=True)
    assert not ev.due_before_training(skip, 0)
    off = override(cfg, eval_prompt_data=None, eval_interval=None)
    assert not ev.due_before_training(off, 0) and not any(ev.due_after(off, s) for s in range(20))


def test_eval_flags_fall_back_to_the_rollout_settings():
    cfg = override(tiny_ppo(), rollout_temperature=0.7, rollout_top_p=0.9, rollout_top_k=5,
                   rollout_max_response_len=6)
    s = ev.eval_sampling(cfg, "a", (1, 3))  # the rollout's stop ids (ppo.generate.stops)
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.stop_token_ids) == (0.7, 0.9, 5, 6, (1, 3))
    assert s.n_samples_per_prompt == 16  # tiny_ppo's --n-samples-per-eval-prompt
    own = override(cfg, eval_temperature=0.0, eval_top_p=1.0, eval_top_k=-1, eval_max_response_len=2,
                   n_samples_per_eval_prompt=1)
    s = ev.eval_sampling(own, "a", (1, 3))
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.n_samples_per_prompt) == (0.0, 1.0, -1, 2, 1)
    # its own seed stream, apart from the rollouts' and from the other sets'
    assert s.seed not in (cfg.rollout.rollout_seed, ev.eval_sampling(own, "b", (1, 3)).seed)


def test_eval_config_problems_name_the_flag_and_the_fix():
    with pytest.raises(ConfigError) as err:
        parse_args(["--eval-prompt-data", "aime", "a.jsonl", "math", "--eval-rm-type", "math", "dapo", "x"])
    problems = err.value.problems
    assert any(p.startswith("--eval-prompt-data 'aime a.jsonl math' (evaluation.eval_prompt_data): must be "
                            "NAME PATH pairs") for p in problems)
    assert any("--eval-rm-type 'math dapo x' (evaluation.eval_rm_type): must name one rule for all" in p
               for p in problems)
    assert any("'x' must be one of: deepscaler, dapo, math, tiny_exact" in p for p in problems)
    with pytest.raises(ConfigError, match="is set but --eval-prompt-data .* Please add --eval-prompt-data"):
        parse_args(["--eval-prompt-data", "none", "--eval-interval", "2"])
    with pytest.raises(ConfigError, match="so no eval would run. Please add --eval-interval N"):
        parse_args(["--eval-interval", "none"])
    with pytest.raises(ConfigError, match="names a set twice"):
        parse_args(["--eval-prompt-data", "a", "x.jsonl", "a", "y.jsonl"])
    with pytest.raises(ConfigError, match="must be a path or one of: generated:arithmetic_heldout"):
        parse_args(["--eval-prompt-data", "a", "generated:poetry"])
    cfg = parse_args(["--eval-prompt-data", "a", "x.jsonl", "b", "y.jsonl", "--eval-rm-type", "math", "dapo",
                      "--skip-eval-before-train"])
    assert cfg.evaluation.eval_prompt_data == ("a", "x.jsonl", "b", "y.jsonl")
    assert cfg.evaluation.eval_rm_type == ("math", "dapo") and cfg.evaluation.skip_eval_before_train


def test_the_held_out_sums_are_never_trained_on(tmp_path):
    train = TASKS["arithmetic"].write(tmp_path / "train.jsonl", num_prompts=2000, seed=3)
    held = EVAL_TASKS["arithmetic_heldout"](tmp_path / "eval.jsonl")
    seen = EVAL_TASKS["arithmetic_seen"](tmp_path / "seen.jsonl")
    trained = {json.loads(x)["prompt"] for x in open(train)}
    held_out = [json.loads(x) for x in open(held)]
    assert len(trained) == 20 and len(held_out) == 5
    assert [json.loads(x)["prompt"] for x in open(seen)] == sorted(trained)  # the seen set: each once
    assert not trained & {h["prompt"] for h in held_out}
    for h in held_out:  # each held-out sum's swapped twin is trained: an operand is never unseen
        a, b = h["prompt"].rstrip("=").split("+")
        assert f"{b}+{a}=" in trained and int(h["label"]) == int(a) + int(b)


@pytest.mark.parametrize(("task", "num_trained", "num_held_out"), [("column_sums", 380, 20),
                                                                    ("column_sums_small", 132, 12)])
def test_the_held_out_column_sums_are_never_trained_on_but_each_of_their_columns_is(tmp_path, task, num_trained,
                                                                                     num_held_out):
    train = TASKS[task].write(tmp_path / "train.jsonl", num_prompts=20000, seed=3)
    trained = {json.loads(x)["prompt"] for x in open(train)}
    held_out = [json.loads(x) for x in open(EVAL_TASKS[f"{task}_heldout"](tmp_path / "eval.jsonl"))]
    seen = [json.loads(x)["prompt"] for x in open(EVAL_TASKS[f"{task}_seen"](tmp_path / "seen.jsonl"))]
    assert len(trained) == num_trained and len(held_out) == num_held_out and len(seen) == num_held_out
    assert not trained & {h["prompt"] for h in held_out} and set(seen) <= trained
    tens, units = ({(p[i], p[i + 3]) for p in trained} for i in (0, 1))  # "23+41=": ("2", "4"), ("3", "1")
    for h in held_out:
        a, b = h["prompt"].removesuffix("=").split("+")
        assert (a[0], b[0]) in tens and (a[1], b[1]) in units and int(h["label"]) == int(a) + int(b)


def test_load_eval_sets_reads_every_line_in_order_with_its_keys_and_rule(tmp_path):
    from ppo.tiny_model import build_tiny_checkpoint, load_tokenizer

    tok = load_tokenizer(build_tiny_checkpoint(str(tmp_path / "ckpt"), seed=0))
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"q": f"{i}+1=", "ans": str(i + 1)}) + "\n" for i in range(4)))
    cfg = override(tiny_ppo(), eval_prompt_data=("a", str(a), "b", str(a)), eval_input_key="q",
                   eval_label_key="ans", eval_rm_type=("math", "tiny_exact"))
    sets = ev.load_eval_sets(cfg, [("a", str(a)), ("b", str(a))], tok)
    assert [p["prompt"] for p in sets[0].prompts] == [f"{i}+1=" for i in range(4)]  # file order
    assert [p["label"] for p in sets[0].prompts] == ["1", "2", "3", "4"]
    assert [p["metadata"] for p in sets[0].prompts] == [{"rm_type": "math"}] * 4
    assert sets[1].prompts[0]["metadata"] == {"rm_type": "tiny_exact"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "1+1=", "ans": "2"}) + "\n" + json.dumps({"q": "2+2="}) + "\n")
    with pytest.raises(ValueError, match=f"^{bad}:2: missing label key 'ans'"):
        ev.load_eval_sets(cfg, [("a", str(a)), ("bad", str(bad))], tok)


@pytest.mark.slow  # 20-56 s end to end; `make test` stays within its 20 minutes
@pytest.mark.timeout(600)
def test_a_run_with_eval_trains_bit_for_bit_as_one_without(tmp_path):
    """tiny_ppo twice, 3 rollouts, evaluating before training and after every rollout in one and
    never in the other: every training metric is equal (perf/* times aside), on the CPU."""
    from ppo.loop import train

    def run(name, **values):
        cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / name), num_rollout=3, num_critic_only_steps=1,
                                    rollout_batch_size=16, global_batch_size=64, micro_batch_size=32, **values))
        return train(cfg)

    with_eval = run("eval", eval_interval=1)
    without = run("plain", eval_prompt_data=None, eval_interval=None)
    assert len(with_eval) == len(without) == 3
    for a, b in zip(with_eval, without):
        keys = {k for k in a if not k.startswith("perf/")}
        assert keys == {k for k in b if not k.startswith("perf/")}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["perf/eval_time"] > 0 and "perf/eval_time" not in b
    lines = [json.loads(x) for x in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval/weight_version" in x]
    assert [(x["step"], x["eval/weight_version"]) for x in evals] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    held = "eval/column_sums_small_heldout"
    assert all(0 <= x[f"{held}-pass@1"] <= x[f"{held}-pass@16"] <= 1 for x in evals)
    assert all(x["eval/response_tokens"] >= 192 + 192 for x in evals)  # 12 + 12 sums x 16 samples
    dumped = sorted(p.name for p in (tmp_path / "eval" / "samples").glob("eval_*.jsonl"))
    assert dumped == [f"eval_column_sums_small_{name}_{s:05d}.jsonl" for name in ("heldout", "seen") for s in range(4)]
    rows = [json.loads(x) for x in (tmp_path / "eval" / "samples" / dumped[3]).read_text().splitlines()]
    assert len(rows) == 192 and rows[0]["weight_version"] == 2 and rows[0]["prompt"] == "10+32="


@pytest.mark.timeout(300)
def test_ppo_evaluate_judges_a_checkpoint_alone_and_prints_a_table_and_json(tmp_path, capsys):
    from ppo.evaluate import main
    from ppo.tiny_model import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "ckpt"), seed=0)
    run_dir = tmp_path / "run"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": 1}\n')
    assert main(["--hf-checkpoint", ckpt, "--eval-prompt-data", "sums", "generated:arithmetic_heldout",
                 "bad", str(bad), "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"tandem: {bad}:2: ")
    assert main(["--hf-checkpoint", ckpt, "--run-dir", str(run_dir)]) == 2  # no set: says which flag
    assert "--eval-prompt-data (evaluation.eval_prompt_data) is required" in capsys.readouterr().err

    assert main(["--hf-checkpoint", ckpt, "--eval-prompt-data", "sums", "generated:arithmetic_heldout",
                 "--n-samples-per-eval-prompt", "4", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split() == ["set", "reward", "pass@1", "pass@2", "pass@4", "response_len", "truncated"]
    assert out[1].split()[0] == "sums" and "tok/s" in out[2]
    metrics = json.loads(out[-1])["metrics"]
    assert metrics == json.loads((run_dir / "eval.json").read_text())["metrics"]
    assert 0 <= metrics["eval/sums-pass@1"] <= metrics["eval/sums-pass@4"] <= 1
    assert len((run_dir / "samples" / "eval_sums_00000.jsonl").read_text().splitlines()) == 5 * 4


def test_ppo_evaluate_stops_in_one_line_when_an_engine_gives_up_on_a_request(tmp_path, capsys, monkeypatch):
    import ppo.evaluate
    from ppo.generate.rollout import RequestsFailed

    line = "rollout engine 0: request id=1 was aborted 4 times (the last: sglang HTTPException: 500: Out of memory)"

    def gives_up(cfg):  # what ppo/generate/rollout.py raises when an engine's generate raised RequestsGaveUp
        raise RequestsFailed(line)

    monkeypatch.setattr(ppo.evaluate, "evaluate_checkpoint", gives_up)
    assert ppo.evaluate.main(["--hf-checkpoint", str(tmp_path), "--eval-prompt-data", "sums",
                              "generated:arithmetic_heldout", "--run-dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err == f"tandem: {line}\n"
