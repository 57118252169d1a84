"""ppo.generate.rewards: --custom-reward-post-process-path sees the whole rollout and replaces its rewards."""

import textwrap

import pytest

from ppo.config.serialize import override
from ppo.config.recipes import tiny_ppo
from ppo.generate.rewards import apply_post_process, load_post_process

FUNCTIONS = textwrap.dedent(
    """
    def centre_per_group(samples):
        groups = {}
        for s in samples:
            groups.setdefault(s["group_index"], []).append(s["reward"])
        return [s["reward"] - sum(groups[s["group_index"]]) / len(groups[s["group_index"]]) for s in samples]

    def too_few(samples):
        return [1.0]

    def not_numbers(samples):
        return ["1"] * len(samples)

    def mutates(samples):
        for s in samples:
            s["response"] = "changed"
        return [0.0] * len(samples)
    """
)


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "post.py"
    path.write_text(FUNCTIONS)
    return path


def rollout():
    return [{"index": i, "group_index": i // 2, "prompt": "p", "response": "r", "label": "l", "metadata": {},
             "reward": float(i), "reward_status": "ok", "response_ids": [1]} for i in range(4)]


def test_the_function_sees_every_sample_and_its_rewards_replace_the_scores(module):
    fn = load_post_process(override(tiny_ppo(), custom_reward_post_process_path=f"{module}:centre_per_group"))
    samples = rollout()
    apply_post_process(fn, samples, "post.py:centre_per_group")
    assert [s["reward"] for s in samples] == [-0.5, 0.5, -0.5, 0.5]
    assert [s["raw_reward"] for s in samples] == [0.0, 1.0, 2.0, 3.0]


def test_the_function_gets_copies(module):
    samples = rollout()
    apply_post_process(load_post_process(override(tiny_ppo(), custom_reward_post_process_path=f"{module}:mutates")),
                 samples, "mutates")
    assert {s["response"] for s in samples} == {"r"}


@pytest.mark.parametrize("name,message", [("too_few", "one reward per sample (4), got 1 values"),
                                          ("not_numbers", "expected a float")])
def test_a_wrong_answer_names_the_flag(module, name, message):
    fn = load_post_process(override(tiny_ppo(), custom_reward_post_process_path=f"{module}:{name}"))
    with pytest.raises((TypeError, ValueError), match="--custom-reward-post-process-path") as e:
        apply_post_process(fn, rollout(), name)
    assert message in str(e.value)


def test_unset_is_none_and_a_bad_path_fails_at_load(module):
    assert load_post_process(tiny_ppo()) is None
    with pytest.raises(ValueError, match="custom_reward_post_process_path"):
        load_post_process(override(tiny_ppo(), custom_reward_post_process_path=f"{module}:missing"))
