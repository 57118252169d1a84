"""What the run's config asks of per-trajectory generation, loaded once at job start.

`load_generation(cfg)` is None for the default path (one response per prompt, ppo.generate.rollout),
else the generate function (--custom-generate-function-path, an agent session around
--custom-agent-function-path (ppo.generate.agents), or the built-in tool loop when only
--generate-tool-specs-path is set) and the tool setup. `rollout_function(...)` gives the
loop and the eval what they call in place of ppo.generate.rollout.generate_and_score.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from ppo.generate.custom import GenerateArgs, load_generate_function
from ppo.generate.trajectories import generate_trajectories_and_score
from ppo.generate.tools import ToolSetup, check_chat_template, load_tool_setup
from ppo.generate.rollout import generate_and_score


@dataclass(frozen=True)
class Generation:
    function: Callable  # async def generate(args, sample, sampling_params)
    tools: ToolSetup | None  # its executor runs until `close`
    args_class: type = GenerateArgs  # the generate function's `args`: AgentArgs for agent sessions

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()


def load_generation(cfg) -> Generation | None:
    """ValueError (one line) when a path does not load or names the wrong thing. With tools, their
    executor is started (the sandbox's workers): the caller closes the Generation."""
    g = cfg.generate
    function, args_class = None, GenerateArgs
    # the functions are checked before the tools' executor starts
    if g.custom_agent_function_path is not None:
        from ppo.generate.agents.agent import AgentArgs, agent_generate_function, load_agent_function

        function = agent_generate_function(load_agent_function(g.custom_agent_function_path))
        args_class = AgentArgs
    elif g.custom_generate_function_path is not None:
        function = load_generate_function(g.custom_generate_function_path)
    tools = load_tool_setup(cfg)
    if function is not None:
        return Generation(function, tools, args_class=args_class)
    if tools is not None:
        from ppo.generate import tool_loop

        return Generation(tool_loop.generate, tools)
    return None


def check_generation(generation: Generation | None, tokenizer) -> None:
    """What needs the tokenizer: a tool loop's chat template (ValueError if it cannot render tools);
    an agent session's (the server renders every request with it)."""
    if generation is not None and generation.args_class is not GenerateArgs and not getattr(tokenizer, "chat_template",
                                                                                            None):
        raise ValueError("--custom-agent-function-path: the session server renders requests with the tokenizer's "
                         "chat template, and this tokenizer has none")
    if generation is not None and generation.tools is not None:
        check_chat_template(tokenizer, generation.tools)


def generation_arguments(generation: Generation, cfg, tokenizer, max_context: int) -> dict:
    """A per-trajectory generate function and the builder of its args around an engine client:
    what generate_trajectories_and_score and ppo.generate.partial_tools.partial_tool_rollout take."""
    def make_args(client) -> GenerateArgs:
        return generation.args_class(cfg, tokenizer, max_context, client, tools=generation.tools)

    return {"generate_fn": generation.function, "make_args": make_args}


def rollout_function(generation: Generation | None, cfg, tokenizer, max_context: int) -> Callable:
    """generate_and_score, or its per-trajectory twin with the same arguments and result."""
    if generation is None:
        return generate_and_score
    return functools.partial(generate_trajectories_and_score, lockstep=lockstep(cfg),
                             **generation_arguments(generation, cfg, tokenizer, max_context))


def lockstep(cfg) -> bool:
    """Whether the built-in engines take turns in lockstep (ppo.generate.engines), so that a run
    and its resume repeat bit for bit: where their numerics can (on the CPU, or in the engine's
    batch-invariant mode). Elsewhere a turn goes to the engine as soon as it is ready: lockstep
    idles an engine while any of its trajectories waits on a tool, and bf16 decode on a GPU does
    not repeat across batch compositions anyway. sglang batches whatever is in flight by itself:
    no lockstep would make it repeat."""
    e = cfg.engine
    return e.rollout_backend == "torch" and (cfg.placement.fake_gpus or e.sglang_enable_deterministic_inference)
