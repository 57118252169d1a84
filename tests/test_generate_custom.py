"""Per-trajectory generation on real engine processes: a custom generate function per sample,
many at once, turns streamed into the engines' running batches, token-faithful records."""

import asyncio
from types import SimpleNamespace

import pytest

from ppo.generate.custom import GenerateArgs, Sample, load_generate_function, turn_seed
from ppo.generate.trajectories import generate_trajectories_and_score
from ppo.generate.rollout import SamplingParams, generate_and_score
from ppo.tiny_model import EOS_ID
from roles.rollout import EngineConfig, RolloutEngine
from runtime import Supervisor

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [{"prompt": f"p{i}", "prompt_ids": [5 + i, 9, 12 + i]} for i in range(4)]
PARAMS = SamplingParams(n_samples_per_prompt=2, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=-1,
                        stop_token_ids=(EOS_ID,), seed=3)
ENV_IDS = [20, 21, 22]  # what the "environment" answers each turn


async def one_turn(args, sample, sampling_params):
    await args.generate(sample, sampling_params)
    return sample


def tool_turns(delays=(0.0,)):
    """Model, environment, model, environment, model: the turn log the tool loop writes; the
    environment takes delays[(sample + turn) % len(delays)] seconds to answer."""

    async def generate(args, sample, sampling_params):
        for turn in range(3):
            # at most 5 tokens a turn: the budget is the whole response's, so lift it by 5 each time
            turn_params = dict(sampling_params, max_new_tokens=len(sample.trajectory.response_ids) + 5)
            if await args.generate(sample, turn_params) is None:
                break
            if turn < 2:
                if delay := delays[(sample.index + turn) % len(delays)]:
                    await asyncio.sleep(delay)
                sample.trajectory.add_env_turn(ENV_IDS)
        return sample

    return generate


three_turns = tool_turns()


def run(engines, fn, ckpt, clients=None):
    def make_args(client):
        if clients is not None:
            clients.append(client)
        return GenerateArgs(config=None, tokenizer=None, max_context=64, client=client)

    return generate_trajectories_and_score(engines, [], PROMPTS, PARAMS, step=0, decode=str, eos_id=EOS_ID,
                                           recover=lambda role, dead: None, generate_fn=fn, make_args=make_args)


def test_one_turn_generate_function_samples_what_the_default_path_samples(two_engines, ckpt):
    default = generate_and_score(two_engines, [], PROMPTS, PARAMS, step=0, decode=str, eos_id=EOS_ID,
                                 recover=lambda role, dead: None)
    custom = run(two_engines, one_turn, ckpt)
    for d, c in zip(default, custom, strict=True):
        assert (c["index"], c["group_index"], c["response_ids"]) == (d["index"], d["group_index"], d["response_ids"])
        assert c["rollout_log_probs"] == pytest.approx(d["rollout_log_probs"], abs=1e-5)
        assert c["loss_mask"] == [1] * len(c["response_ids"]) and c["num_turns"] == 1


def test_a_second_turn_joins_the_running_batch_and_finishes_before_a_long_first_turn(two_engines, ckpt):
    """Sample 0's second turn is sent while the long first turns of samples 2, 4 and 6 decode on
    the same engine (sample index % 2): it joins their batch and comes back before they do."""
    done = []

    async def short_or_long(args, sample, sampling_params):
        if sample.index % 2:
            return await one_turn(args, sample, sampling_params)
        if sample.index > 0:
            await args.generate(sample, dict(sampling_params, max_new_tokens=40, ignore_eos=True))
            done.append(f"long {sample.index}")
            return sample
        for turn in range(2):
            await args.generate(sample, dict(sampling_params, max_new_tokens=len(sample.trajectory.response_ids) + 2,
                                             ignore_eos=True))
            sample.trajectory.add_env_turn(ENV_IDS)
        done.append("second turn of 0")
        return sample

    clients = []
    samples = run(two_engines, short_or_long, ckpt, clients)
    assert done[0] == "second turn of 0" and sorted(done[1:]) == ["long 2", "long 4", "long 6"]
    assert [len(s["response_ids"]) for s in samples[:8:2]] == [2 + 3 + 2 + 3, 40, 40, 40]
    assert clients[0].num_calls > 2  # the engines were called again while requests were out


def test_turns_of_many_trajectories_each_are_the_engines_own(two_engines, ckpt):
    samples = run(two_engines, three_turns, ckpt)
    assert len(samples) == 8
    assert sum(s["num_turns"] for s in samples) > 8
    for s in samples[:3]:  # replaying is a call per turn: a few samples say it
        mask, ids = s["loss_mask"], s["response_ids"]
        assert s["num_turns"] == 3 and s["num_env_tokens"] == 2 * len(ENV_IDS)
        assert len(mask) == len(ids) == len(s["rollout_log_probs"])
        assert all(lp == 0.0 for lp, m in zip(s["rollout_log_probs"], mask) if not m)
        # replay each model turn alone on an engine: from the same context and seed, the same ids
        context, turn, pos = list(s["prompt_ids"]), 0, 0
        for t in _turn_lengths(mask):
            source, length = t
            chunk = ids[pos:pos + length]
            if source == "model":
                seed = turn_seed(_request_seed(s["index"]), turn)
                budget = min(5, 64 - len(context))
                again = two_engines[s["index"] % 2].generate([{"id": 0, "prompt_ids": context,
                                                           "sampling": {"max_new_tokens": budget, "seed": seed,
                                                                        "stop_token_ids": [EOS_ID]}}])[0]
                assert again["token_ids"] == chunk
                turn += 1
            else:
                assert chunk == ENV_IDS
            context += chunk
            pos += length


def test_in_lockstep_the_engines_batches_and_log_probs_do_not_depend_on_how_long_tools_take(two_engines, ckpt):
    """EngineClient's lockstep (the built-in engines'): a call waits for every running trajectory
    of its engine, so the same turns decode together whatever the tools' timing, and the engine's
    log-probs repeat to the last bit (free-running, some moved by ~2e-7 with their batch-mates here)."""
    clients = []
    runs = [run(two_engines, tool_turns(delays), ckpt, clients)  # lockstep: the default
            for delays in ([0.0, 0.03, 0.001], [0.02, 0.0, 0.05, 0.01])]
    assert runs[0] == runs[1]  # every field: ids, log-probs (bitwise), masks, turns
    assert clients[0].num_calls == clients[1].num_calls
    assert sum(s["num_turns"] for s in runs[0]) > len(runs[0])


def _turn_lengths(mask):
    runs = []
    for m in mask:
        source = "model" if m else "env"
        if runs and runs[-1][0] == source:
            runs[-1][1] += 1
        else:
            runs.append([source, 1])
    return runs


def _request_seed(index):
    from ppo.generate.rollout import sample_seed
    return sample_seed(PARAMS.seed, 0, index)


def test_generate_function_path_must_name_an_async_function_of_three_arguments(tmp_path):
    f = tmp_path / "gen.py"
    f.write_text("def sync(args, sample, sampling_params):\n    return sample\n"
                 "async def two(args, sample):\n    return sample\n"
                 "async def good(args, sample, sampling_params):\n    return sample\n")
    assert load_generate_function(f"{f}:good").__name__ == "good"
    with pytest.raises(ValueError, match=r"custom_generate_function_path=.*sync must be an async def"):
        load_generate_function(f"{f}:sync")
    with pytest.raises(ValueError, match=r"two\(args, sample\) must take \(args, sample, sampling_params\)"):
        load_generate_function(f"{f}:two")
    with pytest.raises(ValueError, match=r"custom_generate_function_path=.*has no attribute 'missing'"):
        load_generate_function(f"{f}:missing")


def test_sample_starts_its_trajectory_at_the_prompt():
    s = Sample(index=0, group_index=0, prompt="x", prompt_ids=[1, 2])
    assert s.trajectory.ids == [1, 2] and s.trajectory.turns == []


def test_an_engine_killed_mid_trajectory_is_replaced_and_every_trajectory_finishes_as_without(ckpt, tmp_path):
    """The dead engine's turns are sent again to its restarted incarnation, with the same seeds:
    the trajectories are those of an undisturbed run, and no turn is counted twice."""
    sup = Supervisor(tmp_path / "run", heartbeat_interval=0.1, heartbeat_timeout=1.0, shutdown_grace_s=2.0)
    try:
        engine = sup.spawn("rollout-0", RolloutEngine,
                           EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=8), restart="one_for_one")
        killed = []

        async def kill_on_second_turn(args, sample, sampling_params):
            for turn in range(3):
                if turn == 1 and sample.index == 0 and not killed:
                    killed.append(True)
                    engine.kill()  # sample 0's second turn, and every other sample's, meet a dead engine
                turn_params = dict(sampling_params, max_new_tokens=len(sample.trajectory.response_ids) + 5)
                if await args.generate(sample, turn_params) is None:
                    break
                if turn < 2:
                    sample.trajectory.add_env_turn(ENV_IDS)
            return sample

        def rollout(fn):
            return generate_trajectories_and_score(
                [engine], [], PROMPTS, PARAMS, step=0, decode=str, eos_id=EOS_ID,
                recover=lambda role, dead: sup.wait_restarted(role.name, dead), generate_fn=fn,
                make_args=lambda client: GenerateArgs(config=None, tokenizer=None, max_context=64, client=client))

        disturbed = rollout(kill_on_second_turn)
        assert killed and sup.restart_counts()["rollout-0"] == 1
        undisturbed = rollout(three_turns)
        assert [s["response_ids"] for s in disturbed] == [s["response_ids"] for s in undisturbed]
        assert all(s["num_turns"] == 3 for s in disturbed)
    finally:
        sup.shutdown()


class Stop(BaseException):
    """As ppo.state.signals.RunStopped: a BaseException raised in the driver by a signal handler."""


def test_a_signal_raised_while_the_engines_are_called_stops_the_rollout_instead_of_hanging():
    def call(session, requests, wait_s=None):  # where the handler's exception lands: in EndpointRef.call (runtime/handle.py)
        raise Stop()

    engine = SimpleNamespace(stream=SimpleNamespace(call=call))
    with pytest.raises(Stop):
        generate_trajectories_and_score([engine], [], PROMPTS, PARAMS, step=0, decode=str, eos_id=EOS_ID,
                                        recover=lambda role, dead: None, generate_fn=three_turns,
                                        make_args=lambda client: GenerateArgs(None, None, 64, client))


@pytest.mark.parametrize("changes, want", [
    ({}, True),  # tiny_tools: the built-in engine on fake GPUs
    ({"fake_gpus": False}, False),  # on a GPU turns go free-running ...
    ({"fake_gpus": False, "sglang_enable_deterministic_inference": True}, True),  # ... unless batch-invariant
    ({"rollout_backend": "sglang"}, False),
])
def test_lockstep_where_a_run_can_repeat_bit_for_bit(changes, want):
    from ppo.config.recipes import tiny_tools
    from ppo.config.serialize import override
    from ppo.generate.setup import lockstep

    assert lockstep(override(tiny_tools(), **changes)) is want


def test_in_lockstep_a_stopped_trajectorys_turn_brings_no_call(two_engines):
    """A partial rollout's cut cancels a trajectory mid-turn (ppo.generate.partial_tools): once no
    one awaits any turn of an engine, the client calls it no more; a turn queued and cancelled
    before its call is never sent."""
    from ppo.generate.engines import EngineClient
    from ppo.generate.pump import Pump

    def no_recovery(role, dead):
        raise RuntimeError(f"{role.name} died")

    async def main():
        pump = Pump()
        pumping = asyncio.create_task(pump.run())
        client = EngineClient(two_engines[:1], pump, no_recovery, lockstep=True)
        client.expect([0, 1])
        long = asyncio.create_task(client.generate(0, [5, 14, 6], {"max_new_tokens": 50, "ignore_eos": True,
                                                                     "seed": 1}))
        short = asyncio.create_task(client.generate(1, [9, 8], {"max_new_tokens": 2, "ignore_eos": True, "seed": 2}))
        assert len((await short)["token_ids"]) == 2
        long.cancel()  # the cut: sample 0 stops, with its request out
        client.done(0)
        await asyncio.sleep(0)
        calls = client.num_calls
        queued = asyncio.create_task(client.generate(1, [9, 8, 7], {"max_new_tokens": 2, "seed": 3}))
        await asyncio.sleep(0)
        queued.cancel()  # queued, cancelled before any call took it
        client.done(1)
        await asyncio.sleep(0.3)
        assert client.num_calls == calls
        for task in [pumping, *client.tasks]:
            task.cancel()

    asyncio.run(main())
