"""Dynamic sampling: rounds until enough groups pass the filter, the cap, the batch order, the
metrics, reproducibility across a resume, and the filter's loading and contract."""

import pytest

from ppo.prompts.dataset import PromptDataset
from ppo.generate.dynamic_sampling import DynamicSampling, check_reward_nonzero_std, sample_batch
from ppo.generate.rollout import make_requests, sample_seed
from roles.reward.custom import load_function

N = 4


class Prompts:
    """A stand-in for PromptDataset.next_batch: prompts numbered in order, resumable by position."""

    def __init__(self, start=0):
        self.position = start

    def next_batch(self, n):
        out = [{"prompt": f"p{self.position + i}", "prompt_ids": [1]} for i in range(n)]
        self.position += n
        return out


def fake_generate(solved):
    """Rewards by prompt: groups of prompts in `solved` all 1, every third prompt mixed, others all 0."""
    calls = []

    def generate(prompts, rnd):
        calls.append((len(prompts), rnd))
        out = []
        for g, p in enumerate(prompts):
            k = int(p["prompt"][1:])
            for j in range(N):
                reward = 1.0 if k in solved else (float(j % 2) if k % 3 == 0 else 0.0)
                out.append({"index": g * N + j, "group_index": g, "prompt": p["prompt"], "reward": reward})
        return out

    return generate, calls


def ds(**kw):
    base = dict(num_groups=4, n_samples_per_prompt=N, over_sampling_batch_size=6,
                keep=check_reward_nonzero_std, filter_path="ppo.generate.dynamic_sampling.check_reward_nonzero_std",
                max_extra_rounds=8)
    return DynamicSampling(**{**base, **kw})


def test_rounds_until_enough_groups_pass_then_batch_in_sampling_order():
    generate, calls = fake_generate(solved={1})
    prompts = Prompts()
    samples, metrics = sample_batch(generate, prompts.next_batch, ds())
    # mixed groups: prompts 0, 3, 6, 9, ...; 6 prompts a round -> 2 per round -> 2 rounds for 4
    assert calls == [(6, 0), (6, 1)] and prompts.position == 12
    assert [s["prompt"] for s in samples[::N]] == ["p0", "p3", "p6", "p9"]
    assert [s["index"] for s in samples] == list(range(16))
    assert [s["group_index"] for s in samples[::N]] == [0, 1, 2, 3]
    assert [s["sampling_round"] for s in samples[::N]] == [0, 0, 1, 1]
    assert metrics == {
        "rollout/dynamic_sampling_kept_groups": 4, "rollout/dynamic_sampling_dropped_groups": 8,
        "rollout/dynamic_sampling_extra_rounds": 1, "rollout/dynamic_sampling_filled_groups": 0,
        "rollout/sampled_raw_reward": pytest.approx((4 * 2 + 1 * 4) / 48),
        "rollout/dynamic_filter/drop_zero_std_0.0": 7, "rollout/dynamic_filter/drop_zero_std_1.0": 1,
    }


def test_surplus_of_the_last_round_is_dropped():
    generate, _ = fake_generate(solved=set())
    samples, metrics = sample_batch(generate, Prompts().next_batch, ds(num_groups=1, over_sampling_batch_size=12))
    assert len(samples) == N and samples[0]["prompt"] == "p0"
    assert metrics["rollout/dynamic_sampling_kept_groups"] == 4  # kept by the filter; 1 trained on


def test_the_cap_ends_the_rounds_and_dropped_groups_fill_the_batch():
    generate, calls = fake_generate(solved=set())
    always_drop = ds(keep=lambda group: False, max_extra_rounds=2)
    samples, metrics = sample_batch(generate, Prompts().next_batch, always_drop)
    assert calls == [(6, 0), (6, 1), (6, 2)]
    assert len(samples) == 4 * N and [s["prompt"] for s in samples[::N]] == ["p0", "p1", "p2", "p3"]
    assert metrics["rollout/dynamic_sampling_filled_groups"] == 4
    assert metrics["rollout/dynamic_sampling_extra_rounds"] == 2
    assert metrics["rollout/dynamic_filter/drop_filtered"] == 18
    # no cap on the no-round case either: 0 extra rounds samples once
    generate, calls = fake_generate(solved=set())
    sample_batch(generate, Prompts().next_batch, ds(max_extra_rounds=0))
    assert calls == [(6, 0)]


def test_without_a_filter_one_round_of_exactly_the_batch():
    generate, calls = fake_generate(solved=set())
    samples, metrics = sample_batch(generate, Prompts().next_batch, ds(keep=None, filter_path=None))
    assert calls == [(4, 0)] and len(samples) == 4 * N and metrics == {}


def test_a_resumed_run_samples_the_same_batch(tmp_path):
    """The dataset position after a step's rounds is what a checkpoint stores; a dataset
    restored from it, at the same step, draws the same prompts and request seeds."""
    data_file = tmp_path / "p.jsonl"
    data_file.write_text("".join(f'{{"input": "q{i}"}}\n' for i in range(50)))

    def dataset():
        return PromptDataset(str(data_file), input_key="input", label_key=None, seed=3, shuffle=True)

    seeds = []

    def generate(prompts, rnd):
        reqs = make_requests([dict(p, prompt_ids=[1]) for p in prompts], _params(), step=7, sampling_round=rnd)
        seeds.append([r["sampling"]["seed"] for r in reqs])
        return [{"prompt": p["prompt"], "group_index": i, "reward": float(i % 3 == 0 and j % 2)}
                for i, p in enumerate(prompts) for j in range(N)]

    first = dataset()
    sample_batch(generate, first.next_batch, ds())  # step 6
    state = first.state_dict()
    seeds.clear()
    run = sample_batch(generate, first.next_batch, ds())  # step 7
    run_seeds = list(seeds)
    resumed = dataset()
    resumed.load_state_dict(state)
    seeds.clear()
    again = sample_batch(generate, resumed.next_batch, ds())
    assert run == again and seeds == run_seeds
    assert seeds[0] != seeds[1]  # each round its own seeds
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3, 0) != sample_seed(1, 2, 3, 1)


def _params():
    from ppo.generate.rollout import SamplingParams
    return SamplingParams(n_samples_per_prompt=N, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1,
                          stop_token_ids=(0,), seed=11)


def test_built_in_filter_and_loading_by_path(tmp_path):
    assert check_reward_nonzero_std([{"reward": 1.0}, {"reward": 0.0}]) == (True, None)
    assert check_reward_nonzero_std([{"reward": 1.0}] * 3) == (False, "zero_std_1.0")
    assert load_function("ppo.generate.dynamic_sampling.check_reward_nonzero_std",
                         "dynamic_sampling_filter_path") is check_reward_nonzero_std
    with pytest.raises(ValueError, match=r"dynamic_sampling_filter_path='ppo.nothere:f': cannot import"):
        load_function("ppo.nothere:f", "dynamic_sampling_filter_path")
    with pytest.raises(ValueError, match=r"custom_tis_function_path=.*no such file"):
        load_function(str(tmp_path / "none.py") + ":f", "custom_tis_function_path")


def test_a_filter_returning_something_else_is_an_error_naming_the_path():
    generate, _ = fake_generate(solved=set())
    bad = ds(keep=lambda group: "yes", filter_path="my.filters:odd")
    with pytest.raises(ValueError, match=r"dynamic_sampling_filter_path='my.filters:odd' returned 'yes'"):
        sample_batch(generate, Prompts().next_batch, bad)
