"""One rollout of per-trajectory generation: every sample is a generate function's coroutine,
all of them at once on one event loop; each finished trajectory goes to a reward scorer.

It returns what ppo.generate.rollout.generate_and_score returns, one dict per sample in request order,
with the trajectory's fields added (ppo.generate.trajectory: loss_mask, num_turns,
num_env_tokens), "turns", each turn's text for samples/ (decoded for reading only: training
reads the ids), and "session", the request it was generated for: a generate function may return
several samples for one request (an agent session's records), which share one reward and count
as one member of the prompt's group (ppo.generate.sessions).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ppo.generate.custom import GenerateArgs, Sample
from ppo.generate.engines import Batcher, EngineClient
from ppo.generate.pump import Pump
from ppo.generate.rollout import SamplingParams, make_requests
from runtime import ActorHandle

SCORED_KEYS = ("index", "group_index", "prompt", "response", "label", "metadata")


def generate_trajectories_and_score(
    engines: list[ActorHandle], scorers: list[ActorHandle], prompts: list[dict], params: SamplingParams, step: int,
    decode, eos_id: int, recover: Callable[[ActorHandle, int], None], generate_fn: Callable,
    make_args: Callable[[EngineClient], GenerateArgs], sampling_round: int = 0, lockstep: bool = True,
) -> list[dict]:
    """Samples in request order (request = group * n + k, seeded as ppo.generate.rollout.make_requests).
    `make_args(client)` builds the generate function's `args` around the engine client; `lockstep`
    (the built-in engines'; off for sglang): an engine's next call waits for every running trajectory
    of that engine (ppo.generate.engines.EngineClient)."""
    return asyncio.run(_rollout(engines, scorers, prompts, params, step, decode, eos_id, recover, generate_fn,
                                make_args, sampling_round, lockstep))


async def _rollout(engines, scorers, prompts, params, step, decode, eos_id, recover, generate_fn, make_args,
                   sampling_round, lockstep) -> list[dict]:
    pump = Pump()
    pumping = asyncio.create_task(pump.run())
    client = EngineClient(engines, pump, recover, lockstep=lockstep)
    scoring = Batcher(scorers, "score", pump, recover) if scorers else None
    args = make_args(client)
    n = params.n_samples_per_prompt

    async def one(request: dict) -> list[dict]:
        group = request["id"] // n
        sample = Sample.of_prompt(prompts[group], request["id"], group)
        try:
            out = await generate_fn(args, sample, dict(request["sampling"]))
        finally:
            client.done(request["id"])
        outs = out if isinstance(out, list) else [out]
        if not outs or not all(isinstance(s, Sample) for s in outs):
            raise TypeError(f"the generate function {getattr(generate_fn, '__name__', generate_fn)} returned "
                            f"{type(out).__name__}; it must return the Sample it was given (or a list of Samples)")
        rows = [dict(_row(s, decode, eos_id), session=request["id"]) for s in outs]
        for r in rows:
            if not r["response_ids"]:
                raise ValueError(f"sample {sample.index}: the generate function returned a trajectory without a "
                                 "model turn; call `await args.generate(sample, sampling_params)` at least once")
        # the samples of one call are one sampled response (an agent session's records): they share
        # its reward, the last sample's, scored once (miles' session server gives the trajectory's
        # reward to every sample it keeps: miles/rollout/session/v2/postprocessor_hub/default_postprocess.py)
        own = {s.reward for s in outs if s.reward is not None}
        if len(own) > 1 or (own and outs[-1].reward is None):
            raise ValueError(f"sample {sample.index}: the generate function returned samples with rewards "
                             f"{[s.reward for s in outs]}; the samples of one trajectory share one reward, "
                             "set on the last (or on none, for the scorer to grade the last)")
        if own:
            reward, status = own.pop(), "ok"
        elif scoring is None:  # a reward model alone scores the whole rollout later (ppo.generate.rewards)
            reward, status = 0.0, "ok"
        else:
            result = await scoring.submit(sample.index % len(scorers), {k: rows[-1][k] for k in SCORED_KEYS})
            reward, status = result["reward"], result["status"]
        for r in rows:
            r.update(reward=reward, reward_status=status)
        return rows

    background = [pumping, *client.tasks, *(scoring.tasks if scoring is not None else ())]
    requests = make_requests(prompts, params, step, sampling_round)
    client.expect([r["id"] for r in requests])  # all of them before any starts: the first call waits for each
    trajectories = asyncio.ensure_future(asyncio.gather(*(one(r) for r in requests)))
    # read when cancelled on the way out, so asyncio does not report an unread error
    trajectories.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        # the background tasks never end by themselves: one that does was stopped by an exception
        # no trajectory would ever see (the driver's RunStopped raised by a signal while it ran)
        done, _ = await asyncio.wait([trajectories, *background], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not trajectories:
                task.result()
                raise RuntimeError(f"a rollout task ended early: {task!r}")
        per_request = trajectories.result()
    finally:
        trajectories.cancel()
        for task in background:
            task.cancel()
        await args.aclose()
    samples = [r for rows in per_request for r in rows]
    for i, s in enumerate(samples):
        s["index"] = i
    return samples


def _row(sample: Sample, decode, eos_id: int) -> dict:
    traj = sample.trajectory
    ids = traj.response_ids
    text_ids = ids[:-1] if ids and ids[-1] == eos_id else ids
    return {"index": sample.index, "group_index": sample.group_index, "prompt": sample.prompt,
            "prompt_ids": list(sample.prompt_ids), "label": sample.label, "messages": sample.messages,
            "metadata": sample.metadata, **traj.sample_fields(), "weight_version": sample.weight_version,
            "num_aborts": sample.num_aborts, "response": decode(text_ids), "stats": dict(sample.stats),
            "turns": [{"source": t.source, "text": decode(list(t.ids))} for t in traj.turns]}
