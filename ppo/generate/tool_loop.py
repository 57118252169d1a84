"""The built-in tool loop, miles' multi_turn generate function behind its flags:

    model turn -> parse <tool_call>s -> run them -> tool turn (chat template) -> model turn ...

until the model calls no tool, stops on length, runs out of its response budget or context, or
has had --generate-max-turns model turns. The tools of the last allowed turn are not run: their
answer would never be read. A malformed call is answered with an error message, as a tool
failure or timeout is (the executor's ToolResult: roles.tools.result). Counts go to
sample.stats (roles.tools.result.count) and from there to rollout/* metrics.

A trajectory is continued from where it stands (a partial rollout's buffer,
ppo.generate.partial_tools): after an environment turn (or none) the next model turn comes; after
a model turn, its tool calls run (again, if an abort cut them: tool functions must be safe to
repeat, as the sandboxed calculator is). A fresh trajectory thus starts with a model turn.

Select it with --generate-tool-specs-path (and no --custom-generate-function-path), or name
`ppo.generate.tool_loop:generate` in --custom-generate-function-path.
"""

from __future__ import annotations

import asyncio

from ppo.generate.chat import ToolCallError, parse_tool_calls, tool_messages, tool_turn_ids
from ppo.generate.custom import GenerateArgs, Sample
from ppo.generate.trajectory import MODEL
from roles.tools.result import ToolResult, count

STATS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "tool_worker_restarts")  # and tool_errors/KIND


async def generate(args: GenerateArgs, sample: Sample, sampling_params: dict) -> Sample:
    tools, tok, traj = args.tools, args.tokenizer, sample.trajectory
    if tools is None or tools.executor is None:
        raise ValueError("the tool loop needs --generate-tool-specs-path and --generate-execute-tool-function-path")
    for key in STATS:  # a continued trajectory keeps its counts
        sample.stats.setdefault(key, 0)
    while True:
        if not traj.turns or traj.turns[-1].source != MODEL:
            if await args.generate(sample, sampling_params) is None:
                break
        last = traj.turns[-1]
        if last.finish_reason != "stop" or traj.num_model_turns >= tools.max_turns:
            break
        # decoded only to be read: the trajectory keeps the engine's ids
        calls = parse_tool_calls(tok.decode(list(last.ids), skip_special_tokens=False), tools.names)
        if not calls:
            break
        # counted once all are back: an abort that cuts them counts none, and they run again
        results = await asyncio.gather(*(_run(tools.executor, c) for c in calls))
        for r in results:
            count(sample.stats, r)
        ids = tool_turn_ids(tok, tool_messages(calls, [r.text for r in results]), calls,
                            end_of_turn=last.ids[-1], tools=tools.specs)
        if (len(traj.ids) + len(ids) >= args.max_context
                or len(traj.response_ids) + len(ids) >= sampling_params["max_new_tokens"]):
            break  # no room left for the model to read it and answer
        traj.add_env_turn(ids)
    return sample


async def _run(executor, call) -> ToolResult:
    if isinstance(call, ToolCallError):
        return ToolResult(call.message, False, call.kind, 0.0)
    return await executor.call(call.name, call.arguments)
