"""Custom generate functions, miles' `--custom-generate-function-path module:function`:

    async def generate(args: GenerateArgs, sample: Sample, sampling_params: dict) -> Sample | list[Sample]

runs ONE trajectory. It asks the engines for each model turn with `await args.generate(sample,
sampling_params)` (miles posts to sglang's /generate instead), which appends the engine's ids to
`sample.trajectory`; it adds what the environment says with `sample.trajectory.add_env_turn(ids)`,
ids it tokenized once (ppo.generate.chat.tool_turn_ids renders a tool turn). Many run at once: the
rollout starts every trajectory as an asyncio task and their turns share the engines' batches
(ppo.generate.engines). sampling_params is the engine's request format (roles/rollout/sampling.py);
its max_new_tokens is the budget of the whole response, environment tokens included, as in miles.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from ppo.generate.engines import EngineClient
from ppo.generate.trajectory import Trajectory
from roles.reward.custom import load_function


@dataclass
class Sample:
    """One trajectory and what it started from (miles' Sample, as far as Tandem uses it)."""

    index: int
    group_index: int
    prompt: str
    prompt_ids: list[int]
    label: object = None
    metadata: dict = field(default_factory=dict)
    messages: list | None = None  # the chat before its template, where the prompt file had one
    trajectory: Trajectory = None
    weight_version: int | None = None  # the oldest weights that generated a turn of it
    num_aborts: int = 0  # its turns' aborts the engines answered by issuing them again (roles/rollout/aborts.py)
    stats: dict[str, float] = field(default_factory=dict)  # counts summed into rollout/* (tool calls, ...)
    reward: float | None = None  # set by the generate function (an agent's own reward): the scorer is skipped

    def __post_init__(self):
        if self.trajectory is None:
            self.trajectory = Trajectory(list(self.prompt_ids))

    @classmethod
    def of_prompt(cls, prompt: dict, index: int, group_index: int) -> Sample:
        """A fresh sample of a prompt record (ppo.data's: prompt, prompt_ids, label, metadata, messages)."""
        return cls(index=index, group_index=group_index, prompt=prompt["prompt"], prompt_ids=list(prompt["prompt_ids"]),
                   label=prompt.get("label"), metadata=dict(prompt.get("metadata") or {}),
                   messages=prompt.get("messages"))


class GenerateArgs:
    """What a generate function gets as `args`: the run's config, its tokenizer, the tool setup
    of the built-in loop (ppo.generate.tools; None without --generate-tool-specs-path) and the
    engines, through `generate`."""

    def __init__(self, config, tokenizer, max_context: int, client: EngineClient, tools=None):
        self.config, self.tokenizer, self.max_context, self.tools = config, tokenizer, max_context, tools
        self._client = client
        self._turns: dict[int, int] = {}

    async def generate(self, sample: Sample, sampling_params: dict) -> dict | None:
        """The next model turn of `sample` from its whole context, appended to its trajectory; the
        engine's result {"token_ids", "logprobs", "finish_reason", "weight_version"}, or None when no
        token fits (the response budget or the model's context is spent: the trajectory ends).

        Turn k > 0 of a sample draws with a seed derived from the request's seed and k, so turns
        are independent and a re-issued turn repeats itself."""
        traj = sample.trajectory
        budget = min(sampling_params["max_new_tokens"] - len(traj.response_ids), self.max_context - len(traj.ids))
        if budget <= 0:
            return None
        # a trajectory continued from a partial rollout's buffer counts on from the turns it has
        turn = self._turns.get(sample.index, traj.num_model_turns)
        self._turns[sample.index] = turn + 1
        seed = sampling_params.get("seed")
        request = dict(sampling_params, max_new_tokens=budget,
                       seed=turn_seed(seed, turn) if seed is not None else None)
        result = await self._client.generate(sample.index, traj.ids, request)
        version = result["weight_version"]
        traj.add_model_turn(result["token_ids"], result["logprobs"], result["finish_reason"], version)
        sample.num_aborts += result.get("num_aborts", 0)
        sample.weight_version = version if sample.weight_version is None else min(sample.weight_version, version)
        return result


    async def aclose(self) -> None:
        """What the rollout closes when it ends, on every path (ppo.generate.agents' session server)."""


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 keeps the request's seed: a one-turn generate function samples what the default
    path samples."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def load_generate_function(path: str) -> Callable:
    """The function --custom-generate-function-path names; ValueError (one line) if it does not
    load or is not `async def generate(args, sample, sampling_params)`."""
    fn = load_function(path, "custom_generate_function_path")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"custom_generate_function_path={path!r}: {fn.__name__} must be an async def "
                         "generate(args, sample, sampling_params)")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise ValueError(f"custom_generate_function_path={path!r}: {fn.__name__}{inspect.signature(fn)} must take "
                         "(args, sample, sampling_params)") from None
    return fn
