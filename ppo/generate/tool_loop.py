"""The built-in tool loop, miles' multi_turn generate function behind its flags:

    model turn -> parse <tool_call>s -> run them -> tool turn (chat template) -> model turn ...

until the model calls no tool, stops on length, runs out of its response budget or context, or
has had --generate-max-turns model turns. The tools of the last allowed turn are not run: their
answer would never be read. A malformed call is answered with an error message, as a tool
failure or timeout is (the executor's ToolResult: roles.tools.result). Counts go to
sample.stats (roles.tools.result.count) and from there to rollout/* metrics.

Select it with --generate-tool-specs-path (and no --custom-generate-function-path), or name
`ppo.generate.tool_loop:generate` in --custom-generate-function-path.
"""

from __future__ import annotations

import asyncio

from ppo.generate.chat import ToolCallError, parse_tool_calls, tool_messages, tool_turn_ids
from ppo.generate.custom import GenerateArgs, Sample
from roles.tools.result import ToolResult, count

STATS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "tool_worker_restarts")  # and tool_errors/KIND


async def generate(args: GenerateArgs, sample: Sample, sampling_params: dict) -> Sample:
    tools, tok, traj = args.tools, args.tokenizer, sample.trajectory
    if tools is None or tools.executor is None:
        raise ValueError("the tool loop needs --generate-tool-specs-path and --generate-execute-tool-function-path")
    sample.stats.update(dict.fromkeys(STATS, 0))
    for turn in range(tools.max_turns):
        result = await args.generate(sample, sampling_params)
        if result is None or result["finish_reason"] != "stop" or turn == tools.max_turns - 1:
            break
        # decoded only to be read: the trajectory keeps the engine's ids
        calls = parse_tool_calls(tok.decode(result["token_ids"], skip_special_tokens=False), tools.names)
        if not calls:
            break
        results = await asyncio.gather(*(_run(tools.executor, c) for c in calls))
        for r in results:
            count(sample.stats, r)
        ids = tool_turn_ids(tok, tool_messages(calls, [r.text for r in results]), calls,
                            end_of_turn=result["token_ids"][-1], tools=tools.specs)
        if (len(traj.ids) + len(ids) >= args.max_context
                or len(traj.response_ids) + len(ids) >= sampling_params["max_new_tokens"]):
            break  # no room left for the model to read it and answer
        traj.add_env_turn(ids)
    return sample


async def _run(executor, call) -> ToolResult:
    if isinstance(call, ToolCallError):
        return ToolResult(call.message, False, call.kind, 0.0)
    return await executor.call(call.name, call.arguments)
