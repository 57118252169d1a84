"""Where a partial rollout's unfinished groups wait for the next rollout, and the prompt source
that serves them first (miles' data buffer: `get_samples` takes the buffered groups, then the
dataset; `add_samples` puts the aborted groups back).

A buffered group is whole: its n samples, finished or not, as plain dicts (so that a checkpoint
stores them as JSON, floats exactly):

    prompt             the prompt record (ppo.prompts.dataset: prompt, prompt_ids, label, metadata, ...)
    response_ids       tokens generated so far, over every rollout it ran in
    rollout_log_probs  the engine's log-prob of each
    weight_versions    the weight version that generated each token
    segment_starts     where each rollout's tokens begin in response_ids (first: 0)
    segment_steps      the rollout step of each of those segments
    finish_reason      "stop" / "length" once finished, else None
    start_step         the rollout step it began in
    num_aborts         the engine's own aborts it was issued again after (roles/rollout/aborts.py)

A tool trajectory's sample (ppo.generate.partial_tools) keeps its whole state instead of the
response fields: prompt, finish_reason, start_step and num_aborts as above, and

    trajectory         its turns (ppo.generate.trajectory.Trajectory.state: ids, log-probs, finish
                       reason and weight version of each model turn; the ids of each tool turn)
    stats              its tool counts so far (ppo.generate.tool_loop.STATS)
    seed               its request seed, kept from its first rollout

PartialSource stands where the PromptDataset stands (job.data): its state_dict adds the buffer to
the data position, so a checkpoint saves the buffer and --load (or a trainer's recovery) brings it
back with the position (ppo.state.checkpoint stores and restores `data.state_dict()`).
"""

from __future__ import annotations

import copy

BUFFER_KEY = "partial_buffer"


def new_group(prompt: dict, n: int, step: int) -> list[dict]:
    """n samples of `prompt`, nothing generated yet."""
    return [{"prompt": prompt, "response_ids": [], "rollout_log_probs": [], "weight_versions": [],
             "segment_starts": [], "segment_steps": [], "finish_reason": None, "start_step": step, "num_aborts": 0} for _ in range(n)]


def is_complete(group: list[dict]) -> bool:
    return all(s["finish_reason"] is not None for s in group)


def num_tokens(s: dict) -> int:
    """Response tokens a buffered sample holds (a tool trajectory's: model and tool turns)."""
    if "trajectory" in s:
        return sum(len(t["ids"]) for t in s["trajectory"]["turns"])
    return len(s["response_ids"])


class PartialSource:
    """The prompt dataset, with the groups a partial rollout left unfinished served first."""

    def __init__(self, data):
        self.data = data
        self.groups: list[list[dict]] = []

    def __getattr__(self, name):  # the dataset's other fields (num_skipped, longest_prompt, path, ...)
        if name == "data":  # not set yet (a copy being built): no recursion through self.data
            raise AttributeError(name)
        return getattr(self.data, name)

    def next_groups(self, num_groups: int, n: int, step: int) -> list[list[dict]]:
        """`num_groups` groups: the buffered ones first (oldest first), then new prompts."""
        taken, self.groups = self.groups[:num_groups], self.groups[num_groups:]
        fresh = num_groups - len(taken)
        return taken + ([new_group(p, n, step) for p in self.data.next_batch(fresh)] if fresh else [])

    def next_batch(self, n: int) -> list[dict]:
        return self.data.next_batch(n)

    def put_back(self, groups: list[list[dict]]) -> None:
        """Groups to continue in a later rollout, after those already waiting (miles' buffer is a
        list served from its front and extended at its end)."""
        self.groups = [*self.groups, *groups]

    @property
    def num_buffered_tokens(self) -> int:
        return sum(num_tokens(s) for g in self.groups for s in g)

    def state_dict(self) -> dict:
        return {**self.data.state_dict(), BUFFER_KEY: copy.deepcopy(self.groups)}

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state)
        # a checkpoint of a run without --partial-rollout has no buffer: it starts empty
        self.groups = copy.deepcopy(state.get(BUFFER_KEY, []))
