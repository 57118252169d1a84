"""Partial rollouts of multi-turn tool trajectories (the built-in tool loop, ppo.generate.tool_loop).

As ppo.generate.partial does for single responses: start --over-sampling-batch-size groups (the
buffered ones first), train the first --rollout-batch-size groups complete, put every other group
back in the buffer (ppo.generate.partial_buffer) with each trajectory's whole state: its turns
(ids, log-probs and weight version of each model turn, the ids of each tool turn), its tool
counts, its seed, the step it began in. A later rollout continues each where it stands
(tool_loop.generate: a model turn next, or the last model turn's tool calls run again).

Where the cut lands. A trajectory's clock is the model tokens it generated in this rollout,
counted at each model turn's end; a group completes at its slowest sample's clock at its finish
(0 for one complete when taken from the buffer). The cut T is the clock by which
--rollout-batch-size groups are complete, and what a trajectory keeps is what it had just after
the first model turn that took its clock past T (or all of it, if it finished by T). While the
rollout runs, T is the clock by which enough groups are complete so far; it only falls as more
complete, so a trajectory whose clock passed it is stopped at once (the cut): its model turn in
flight is dropped (the engine decodes it to its end; its result is never read), its tool calls in
flight are cancelled and their results dropped (threads and sandbox workers run to their end;
nothing is counted: tool_loop counts a turn's calls once all are back), and its reward is never
asked for (only the trained groups are scored, after the cut). The rollout ends when every
trajectory finished or was stopped; the stopped ones, and those that finished past the final T,
are rolled back to their state just after the turn that crossed it. Each trajectory's turns
depend only on its seed and its tokens (where the engine is batch invariant), so what is trained
and what is buffered do not depend on timing: a run resumed from its checkpoint repeats the
uninterrupted one. The cost: trajectories behind the cut run on until they pass it, as the
built-in engines' lockstep abort waits for the slowest call (roles/rollout/abort_board.py), and
turns generated past it are generated again next time.

A trajectory rolled back after a model turn runs that turn's tool calls again when it continues:
tool functions must be safe to repeat (the sandboxed calculator is).

Seeds: the sample's request seed is sample_seed(rollout seed, the step it began in, its index
then) and each turn's seed derives from it and the turn number (ppo.generate.custom.turn_seed),
so a continued trajectory draws what an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ppo.generate.custom import Sample
from ppo.generate.engines import EngineClient
from ppo.generate.partial import partial_metrics, score_groups
from ppo.generate.partial_buffer import PartialSource, num_tokens
from ppo.generate.pump import Pump
from ppo.generate.rollout import SamplingParams, sample_seed
from ppo.generate.trajectories import _row
from ppo.generate.trajectory import MODEL, Trajectory


def partial_tool_rollout(client_of: Callable[[Pump], EngineClient], scorers, source: PartialSource,
                         params: SamplingParams, step: int, *, num_groups: int, over_sampling: int,
                         mask_offpolicy: bool, decode, eos_id: int, recover, generate_fn, make_args
                         ) -> tuple[list[dict], dict]:
    """(samples of `num_groups` complete groups in batch order, scored; metrics), as
    ppo.generate.partial.partial_rollout returns. `client_of(pump)`: the engines' EngineClient on
    the rollout's pump; `generate_fn`: the tool loop's generate; `make_args(client)` builds its
    args (ppo.generate.setup.generation_arguments)."""
    n = params.n_samples_per_prompt
    groups = source.next_groups(over_sampling, n, step)
    resumed_groups = sum(any(num_tokens(s) or s["start_step"] < step for s in g) for g in groups)
    runs = [_Run.of(s, g * n + k, params, step) for g, group in enumerate(groups) for k, s in enumerate(group)]
    cut = _Cut(runs, n, num_groups)
    asyncio.run(_generate(client_of, runs, cut, params, generate_fn, make_args))
    num_cut = cut.roll_back()
    trained = [g for g in range(len(groups)) if cut.done_at.get(g, math.inf) <= cut.limit][:num_groups]
    batch = [dict(_trained_row(runs[g * n + k], step, mask_offpolicy, decode, eos_id), index=j * n + k,
                  group_index=j, session=j * n + k) for j, g in enumerate(trained) for k in range(n)]
    source.put_back([[runs[g * n + k].buffered() for k in range(n)] for g in range(len(groups)) if g not in trained])
    score_groups(scorers, batch, n, recover)
    return batch, partial_metrics(batch, source, resumed_groups, num_cut)


@dataclass
class _Mark:
    """A trajectory just after one of its model turns of this rollout (before that turn's tools)."""

    clock: int
    num_turns: int
    stats: dict
    num_aborts: int


@dataclass
class _Run:
    """One trajectory of the rollout: its sample, where it came from, and its marks so far."""

    sample: Sample
    record: dict  # its buffered sample (partial_buffer: the prompt, start_step, ...)
    seed: int
    carried: int  # response tokens it had when this rollout began
    finished: bool
    clock: int = 0  # model tokens generated in this rollout
    finished_at: int | None = None  # its clock when it finished (0: before this rollout)
    marks: list[_Mark] = field(default_factory=list)

    @classmethod
    def of(cls, record: dict, index: int, params: SamplingParams, step: int) -> _Run:
        prompt, n = record["prompt"], params.n_samples_per_prompt
        sample = Sample.of_prompt(prompt, index, index // n)
        if "trajectory" in record:  # continued (partial_buffer's tool form)
            sample.trajectory = Trajectory.from_state(sample.prompt_ids, record["trajectory"])
            sample.stats = dict(record["stats"])
            sample.num_aborts = record["num_aborts"]
            versions = [t.weight_version for t in sample.trajectory.turns if t.source == MODEL]
            sample.weight_version = min(versions) if versions else None
        seed = record.get("seed", sample_seed(params.seed, step, index))
        finished = record["finish_reason"] is not None
        return cls(sample, record, seed, len(sample.trajectory.response_ids), finished,
                   finished_at=0 if finished else None)

    def buffered(self) -> dict:
        """Its state for the buffer (partial_buffer's tool form)."""
        traj = self.sample.trajectory
        return {"prompt": self.record["prompt"], "start_step": self.record["start_step"],
                # no model turn to say why it ended: its budget was spent before one ("length")
                "finish_reason": (traj.finish_reason or "length") if self.finished else None,
                "num_aborts": self.sample.num_aborts, "seed": self.seed, "trajectory": traj.state(),
                "stats": dict(self.sample.stats)}


class _Cut:
    """The rollout's cut in the trajectories' clock (module docstring): `limit` is T."""

    def __init__(self, runs: list[_Run], n: int, need: int):
        self.runs, self.n, self.need = runs, n, need
        self.done_at: dict[int, int] = {}  # group -> the clock it completed at
        self.limit = math.inf
        self.tasks: dict[int, asyncio.Task] = {}
        for g in range(len(runs) // n):
            self._complete(g)

    def turn_done(self, i: int, num_tokens: int, num_aborts: int) -> None:
        """Trajectory i got a model turn of `num_tokens` (not yet appended to its trajectory)."""
        run = self.runs[i]
        run.clock += num_tokens
        run.marks.append(_Mark(run.clock, len(run.sample.trajectory.turns) + 1, dict(run.sample.stats),
                               run.sample.num_aborts + num_aborts))
        asyncio.get_running_loop().call_soon(self.enforce)  # once its turn is appended and it awaits again

    def finish(self, i: int) -> None:
        run = self.runs[i]
        run.finished, run.finished_at = True, run.clock
        if self._complete(i // self.n):
            self.enforce()

    def _complete(self, g: int) -> bool:
        """Record group g's completion if it is complete; True if the limit fell."""
        group = self.runs[g * self.n:(g + 1) * self.n]
        if g in self.done_at or not all(r.finished for r in group):
            return False
        self.done_at[g] = max(r.finished_at for r in group)
        times = sorted(self.done_at.values())
        limit = times[self.need - 1] if len(times) >= self.need else math.inf
        fell, self.limit = limit < self.limit, limit
        return fell

    def enforce(self) -> None:
        """Stop every running trajectory whose clock passed the limit."""
        for i, task in self.tasks.items():
            if not task.done() and not self.runs[i].finished and self.runs[i].clock > self.limit:
                task.cancel()

    def roll_back(self) -> int:
        """Every trajectory not finished by the final limit to just after the model turn that
        crossed it; returns how many it left unfinished (which, like the rest, does not depend on
        timing; which of them the cut stopped and which ran on does)."""
        cut = 0
        for run in self.runs:
            if run.finished and run.finished_at <= self.limit:
                continue
            # unfinished at the end means stopped: its clock passed the limit, so a mark did
            mark = next(m for m in run.marks if m.clock > self.limit)
            traj = run.sample.trajectory
            if run.finished and len(traj.turns) == mark.num_turns and run.sample.stats == mark.stats:
                continue  # it ended right after that turn, running no tools (so the cut cannot land between)
            del traj.turns[mark.num_turns:]
            run.sample.stats, run.sample.num_aborts, run.finished = dict(mark.stats), mark.num_aborts, False
            cut += 1
        return cut


class _Watched:
    """The engine client as the generate function's args see it, telling the cut of each turn."""

    def __init__(self, client: EngineClient, cut: _Cut):
        self._client, self._cut = client, cut

    async def generate(self, sample_index: int, prompt_ids: list[int], sampling: dict) -> dict:
        result = await self._client.generate(sample_index, prompt_ids, sampling)
        self._cut.turn_done(sample_index, len(result["token_ids"]), result.get("num_aborts", 0))
        return result


async def _generate(client_of, runs: list[_Run], cut: _Cut, params: SamplingParams, generate_fn, make_args) -> None:
    pump = Pump()
    pumping = asyncio.create_task(pump.run())
    client = client_of(pump)
    args = make_args(_Watched(client, cut))
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids)}

    async def one(i: int) -> None:
        try:
            await generate_fn(args, runs[i].sample, dict(sampling, seed=runs[i].seed))
        finally:  # finished or stopped by the cut: in lockstep its engine waits for it no more
            client.done(i)
        cut.finish(i)

    client.expect([i for i, run in enumerate(runs) if not run.finished])
    cut.tasks = {i: asyncio.create_task(one(i)) for i, run in enumerate(runs) if not run.finished}
    background = [pumping, *client.tasks]
    try:
        pending = set(cut.tasks.values())
        while pending:
            done, _ = await asyncio.wait([*pending, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task not in pending:  # a background task never ends by itself (ppo.generate.trajectories)
                    task.result()
                    raise RuntimeError(f"a rollout task ended early: {task!r}")
                pending.discard(task)
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
    finally:
        for task in [*cut.tasks.values(), *background]:
            task.cancel()
        await args.aclose()


def _trained_row(run: _Run, step: int, mask_offpolicy: bool, decode, eos_id: int) -> dict:
    """A rollout sample (ppo.generate.trajectories' row) with its per-token weight versions and
    partial_* counts; under --mask-offpolicy-in-partial-rollout its tokens from earlier rollouts
    get loss mask 0."""
    row = _row(run.sample, decode, eos_id)
    versions = run.sample.trajectory.weight_versions
    # its last turn's version, as a continued single response's is its last segment's: what
    # --train-async's staleness check reads (ppo.generate.rollout_ahead)
    row.update(weight_versions=versions, weight_version=versions[-1], sampling_seed=run.seed,
               partial_carried_tokens=run.carried, partial_age=step - run.record["start_step"])
    if mask_offpolicy:
        row["loss_mask"] = [0] * run.carried + row["loss_mask"][run.carried:]
    return row
