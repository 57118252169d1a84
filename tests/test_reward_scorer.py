"""Scorer: rules and custom functions in worker processes; failures score 0 and the scorer lives on."""

import textwrap
import time

import pytest

from roles.reward.custom import load_reward_function
from roles.reward.config import ScorerConfig
from roles.reward.scorer import Scorer
from roles.reward.worker import JobConfig, JobEvaluator

CUSTOM = textwrap.dedent(
    """
    import asyncio, math, os, sys, time

    def length(sample):
        return float(len(sample["response"]))

    async def async_length(sample):
        await asyncio.sleep(0)
        return len(sample["response"])

    def group_rank(samples):
        # Reward by rank of length within the group: needs the whole group at once.
        order = sorted(range(len(samples)), key=lambda i: len(samples[i]["response"]))
        ranks = [0.0] * len(samples)
        for rank, i in enumerate(order):
            ranks[i] = float(rank)
        return ranks

    async def async_group_sizes(samples):
        return [float(len(samples))] * len(samples)

    def group_too_short(samples):
        return [1.0]

    def raises(sample):
        if sample["response"] == "bad":
            raise ValueError("cannot grade " + sample["response"])
        return 1.0

    def hangs(sample):
        if sample["response"] == "hang":
            time.sleep(600)
        return 1.0

    async def async_hangs(sample):
        await asyncio.sleep(600)

    def exits_process(sample):
        if sample["response"] == "die":
            os._exit(3)
        return 1.0

    def calls_sys_exit(sample):
        sys.exit(0)

    def returns_text(sample):
        return "1.0"

    def returns_nan(sample):
        return math.nan

    def sees_everything(sample):
        assert sample["prompt"] == "p" and sample["label"] == "l" and sample["metadata"] == {"k": 1}
        return 1.0

    not_a_function = 3
    """
)


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(CUSTOM)
    return path


def sample(index, response, *, label="7", group_index=0, metadata=None, prompt="p"):
    return {
        "index": index,
        "group_index": group_index,
        "prompt": prompt,
        "response": response,
        "label": label,
        "metadata": metadata or {},
    }


@pytest.mark.timeout(60)
def test_rule_scores_batch_in_order():
    responses = ["</think>\\boxed{7}", "</think>\\boxed{8}", "\\boxed{7}", "</think>\\boxed{7.0}"]
    with Scorer(ScorerConfig(rm_type="deepscaler", num_workers=2)) as scorer:
        out = scorer.score([sample(10 + i, r) for i, r in enumerate(responses)])
        assert [o["index"] for o in out] == [10, 11, 12, 13]
        assert [o["reward"] for o in out] == [1.0, 0.0, 0.0, 1.0]
        assert {o["status"] for o in out} == {"ok"} and {o["error"] for o in out} == {None}
        assert scorer.score([]) == []
        assert scorer.stats() == {"num_scored": 4, "num_errors": 0, "num_timeouts": 0, "num_worker_restarts": 0}


@pytest.mark.timeout(60)
def test_metadata_rm_type_overrides_and_rule_errors_score_zero():
    with Scorer(ScorerConfig(rm_type="deepscaler", num_workers=1)) as scorer:
        out = scorer.score(
            [
                sample(0, "Answer: 7", metadata={"rm_type": "dapo"}),
                sample(1, "Answer: 7"),  # deepscaler: no </think>
                sample(2, "x", metadata={"rm_type": "nope"}),
                sample(3, "</think>\\boxed{7}", label=None),
            ]
        )
    assert [o["reward"] for o in out] == [1.0, 0.0, 0.0, 0.0]
    assert [o["status"] for o in out] == ["ok", "ok", "error", "error"]
    assert "rm_type='nope'" in out[2]["error"]
    assert "no label" in out[3]["error"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("function", ["length", "async_length"])
def test_custom_function_sync_and_async(custom_file, function):
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:{function}", num_workers=1)) as scorer:
        out = scorer.score([sample(0, "abc"), sample(1, "abcdef")])
    assert [(o["reward"], o["status"]) for o in out] == [(3.0, "ok"), (6.0, "ok")]


@pytest.mark.timeout(60)
def test_custom_function_by_module_name(custom_file, monkeypatch):
    monkeypatch.syspath_prepend(str(custom_file.parent))
    for spec in ("my_rewards:length", "my_rewards.length"):  # ours and the miles spelling
        with Scorer(ScorerConfig(custom_rm_path=spec, num_workers=1)) as scorer:
            assert scorer.score([sample(0, "abcd")])[0]["reward"] == 4.0


@pytest.mark.timeout(60)
def test_group_function_gets_each_group_whole(custom_file):
    samples = [
        sample(0, "ccc", group_index=0),
        sample(1, "a", group_index=1),
        sample(2, "a", group_index=0),
        sample(3, "bb", group_index=0),
        sample(4, "bbbb", group_index=1),
    ]
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:group_rank", group_rm=True, num_workers=2)) as scorer:
        out = scorer.score(samples)
    assert [o["index"] for o in out] == [0, 1, 2, 3, 4]
    assert [o["reward"] for o in out] == [2.0, 0.0, 0.0, 1.0, 1.0]


@pytest.mark.timeout(60)
def test_async_group_function_and_wrong_length_result(custom_file):
    samples = [sample(0, "x", group_index=5), sample(1, "y", group_index=5), sample(2, "z", group_index=6)]
    config = ScorerConfig(custom_rm_path=f"{custom_file}:async_group_sizes", group_rm=True, num_workers=1)
    with Scorer(config) as scorer:
        assert [o["reward"] for o in scorer.score(samples)] == [2.0, 2.0, 1.0]
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:group_too_short", group_rm=True, num_workers=1)) as scorer:
        out = scorer.score(samples)
        assert [o["status"] for o in out] == ["error", "error", "ok"]
        assert [o["reward"] for o in out] == [0.0, 0.0, 1.0]
        assert "one reward per sample" in out[0]["error"]
        assert scorer.stats()["num_errors"] == 2


@pytest.mark.timeout(60)
def test_raising_function_scores_zero_and_scorer_keeps_serving(custom_file):
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:raises", num_workers=1)) as scorer:
        out = scorer.score([sample(0, "ok"), sample(1, "bad"), sample(2, "ok")])
        assert [(o["reward"], o["status"]) for o in out] == [(1.0, "ok"), (0.0, "error"), (1.0, "ok")]
        assert "ValueError: cannot grade bad" in out[1]["error"] and "my_rewards.py" in out[1]["error"]
        assert scorer.score([sample(3, "ok")])[0]["reward"] == 1.0
        assert scorer.stats() == {"num_scored": 4, "num_errors": 1, "num_timeouts": 0, "num_worker_restarts": 0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("function", ["hangs", "async_hangs"])
def test_hanging_function_times_out_and_scorer_keeps_serving(custom_file, function):
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:{function}", timeout_s=0.5, num_workers=2)) as scorer:
        started = time.monotonic()
        out = scorer.score([sample(0, "hang"), sample(1, "hang" if function == "async_hangs" else "fast")])
        assert time.monotonic() - started < 5.0
        assert out[0]["status"] == "timeout" and out[0]["reward"] == 0.0 and "0.5 s" in out[0]["error"]
        if function == "hangs":
            assert out[1] == {"index": 1, "reward": 1.0, "status": "ok", "error": None}
        timeouts = 1 if function == "hangs" else 2
        assert scorer.stats()["num_timeouts"] == timeouts
        assert scorer.stats()["num_worker_restarts"] == timeouts
        if function == "hangs":  # the replacement worker serves the next call
            assert scorer.score([sample(2, "fast")])[0]["reward"] == 1.0


@pytest.mark.timeout(60)
def test_hung_sympy_is_killed():
    # Not caught by the guard (single-digit exponents), but sympy needs seconds of bignum
    # arithmetic, holding the GIL: only a process kill stops it.
    tower = "(((((((9^9)^9)^9)^9)^9)^9)^9)"
    with Scorer(ScorerConfig(rm_type="math", timeout_s=1.0, num_workers=1)) as scorer:
        out = scorer.score([sample(0, f"\\boxed{{{tower}}}", label="\\frac{1}{3}"), sample(1, "\\boxed{7}")])
        assert [o["status"] for o in out] == ["timeout", "ok"]
        assert [o["reward"] for o in out] == [0.0, 1.0]


@pytest.mark.timeout(60)
def test_worker_that_exits_is_replaced(custom_file):
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:exits_process", num_workers=1)) as scorer:
        out = scorer.score([sample(0, "die"), sample(1, "fine")])
        assert out[0]["status"] == "error" and "exited with code 3" in out[0]["error"]
        assert out[1]["reward"] == 1.0
        assert scorer.stats()["num_worker_restarts"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("function", "message"),
    [("calls_sys_exit", "SystemExit"), ("returns_text", "expected a float"), ("returns_nan", "finite")],
)
def test_bad_custom_results_are_errors(custom_file, function, message):
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:{function}", num_workers=1)) as scorer:
        out = scorer.score([sample(0, "x")])[0]
        assert (out["status"], out["reward"]) == ("error", 0.0) and message in out["error"]
        assert scorer.score([sample(1, "x")])[0]["status"] == "error"  # the worker is still there


@pytest.mark.timeout(60)
def test_custom_function_sees_the_whole_sample(custom_file):
    with Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:sees_everything", num_workers=1)) as scorer:
        out = scorer.score([sample(0, "r", label="l", metadata={"k": 1})])
    assert out[0]["status"] == "ok", out[0]["error"]


def test_bad_configuration_fails_at_construction(custom_file):
    with pytest.raises(ValueError, match="rm_type='nope'"):
        Scorer(ScorerConfig(rm_type="nope"))
    with pytest.raises(ValueError, match="timeout_s=0"):
        Scorer(ScorerConfig(rm_type="math", timeout_s=0))
    with pytest.raises(ValueError, match="num_workers=0"):
        Scorer(ScorerConfig(rm_type="math", num_workers=0))
    with pytest.raises(ValueError, match="no such file"):
        Scorer(ScorerConfig(custom_rm_path=f"{custom_file.parent}/missing.py:f"))
    with pytest.raises(ValueError, match="has no attribute 'nothing'"):
        Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:nothing"))
    with pytest.raises(ValueError, match="not a function"):
        Scorer(ScorerConfig(custom_rm_path=f"{custom_file}:not_a_function"))
    with pytest.raises(ValueError, match="cannot import"):
        Scorer(ScorerConfig(custom_rm_path="no_such_module_xyz:f"))
    with pytest.raises(ValueError, match="names no function"):
        Scorer(ScorerConfig(custom_rm_path="justaname"))


@pytest.mark.timeout(60)
def test_malformed_samples_are_caller_errors():
    with Scorer(ScorerConfig(rm_type="math", num_workers=1)) as scorer:
        with pytest.raises(ValueError, match="'response' must be str"):
            scorer.score([{"index": 0}])
        with pytest.raises(ValueError, match="'index' must be int"):
            scorer.score([{"response": "x"}])
        assert scorer.score([sample(0, "\\boxed{7}")])[0]["reward"] == 1.0


def test_load_reward_function_returns_the_function(custom_file):
    assert load_reward_function(f"{custom_file}:length")({"response": "abc"}) == 3.0
    # Loading the same file twice reuses one module.
    assert load_reward_function(f"{custom_file}:length") is load_reward_function(f"{custom_file}:length")


def test_job_evaluator_in_process(custom_file):
    config = JobConfig(rm_type="", custom_rm_path=f"{custom_file}:async_length", group_rm=False, sys_path=())
    per_sample = JobEvaluator(config)
    assert per_sample(sample(0, "abcd")) == 4.0
    rule = JobEvaluator(JobConfig(rm_type="tiny_exact", custom_rm_path=None, group_rm=False, sys_path=()))
    assert rule(sample(0, " 7 ", label="7")) == 1.0


@pytest.mark.timeout(60)
def test_reward_scorer_actor_in_process():
    actor_module = pytest.importorskip("roles.reward.role", reason="runtime package not importable yet")
    scorer = actor_module.RewardScorer(ScorerConfig(rm_type="tiny_exact", num_workers=1))
    try:
        out = scorer.score([sample(0, "7"), sample(1, "8")])
        assert [o["reward"] for o in out] == [1.0, 0.0]
        assert scorer.stats()["num_scored"] == 2
    finally:
        scorer.close()
