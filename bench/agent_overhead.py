"""What an agent session costs per model turn against the built-in tool loop, on tiny_tools' task
(CPU): the same trajectories, once through ppo.generate.tool_loop and once as the tiny agent
(ppo.generate.agents.tiny_agent) through the session server and the openai client.

    python -m bench.agent_overhead [--sessions 64] [--repeat 3]

The model is an instant stand-in that answers every trajectory with the call on its
expression, then the right sum (both paths get the same ids, which the bench checks): the
figure is the per-turn cost of each path's own machinery (HTTP, JSON, chat template
rendering, the openai client) with no engine time to hide it. What a rollout on a real engine
sees is in tests/test_e2e_agents.py's rollout times (docs/benchmarks.md). Prints ms per model
turn of each path (best of --repeat) and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from types import SimpleNamespace

from ppo.generate.agents.agent import AgentArgs, agent_generate_function
from ppo.generate.agents.tiny_agent import run_agent
from ppo.generate import tool_loop
from ppo.generate.custom import GenerateArgs, Sample
from ppo.generate.tiny_tools import TINY_TOOL_CHAT_TEMPLATE, TOOL_TOKENS, call_text
from ppo.config import ToolsConfig
from ppo.generate.tools import ToolSetup, tool_limits
from roles.tools.calculator import TOOL_SPECS
from roles.tools.in_process import InProcessExecutor
from roles.tools.specs import ToolSet
from ppo.prompts.tasks import write_tool_sum_task
from ppo.tiny_model import build_tiny_checkpoint, load_tokenizer

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 30, "stop_token_ids": [], "seed": 1}


class InstantEngine:
    """EngineClient.generate's contract (ppo/generate/engines.py) without a model: turn 1 calls the
    calculator on the prompt's expression and stops at `</tool_call>` (tiny_tools' --rollout-stop),
    turn 2 answers its result and stops at eos."""

    def __init__(self, tok, prompts: list[str]):
        self.tok, self.prompts, self.num_turns = tok, prompts, 0

    async def generate(self, sample_index: int, prompt_ids: list[int], sampling: dict) -> dict:
        self.num_turns += 1
        expr = self.prompts[sample_index].rstrip("=")
        a, _, b = expr.partition("+")  # tool_sums' prompts are sums
        calls = "<tool_response>" not in self.tok.decode(prompt_ids)
        text = call_text(expr) if calls else str(int(a) + int(b)) + self.tok.eos_token
        ids = self.tok.encode(text, add_special_tokens=False)
        return {"token_ids": ids, "logprobs": [-0.1] * len(ids), "finish_reason": "stop", "weight_version": 0}


def _samples(tok, prompts: list[str]) -> list[Sample]:
    return [Sample(index=i, group_index=i, prompt=p, prompt_ids=tok.encode(p, add_special_tokens=False))
            for i, p in enumerate(prompts)]


async def _tool_loop(tok, client, prompts) -> list[Sample]:
    calculator = ToolSet(specs=tuple(TOOL_SPECS), function_path="roles.tools.calculator:execute_tool")
    limits = tool_limits(SimpleNamespace(tools=ToolsConfig()))
    tools = ToolSetup(tools=calculator, executor=InProcessExecutor(calculator, limits, num_workers=4), max_turns=2,
                      parser="qwen25")
    args = GenerateArgs(None, tok, 64, client, tools=tools)
    return await asyncio.gather(*(tool_loop.generate(args, s, dict(SAMPLING)) for s in _samples(tok, prompts)))


async def _agent(tok, client, prompts) -> list[Sample]:
    args = AgentArgs(SimpleNamespace(), tok, 64, client)
    generate = agent_generate_function(run_agent)
    try:  # a session gives a list of records (one here: the sessions of this task never split)
        sessions = await asyncio.gather(*(generate(args, s, dict(SAMPLING)) for s in _samples(tok, prompts)))
        return [record for records in sessions for record in records]
    finally:
        await args.aclose()


def per_turn_ms(run, repeat: int) -> tuple[float, list[Sample]]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = run()
        turns = sum(s.trajectory.num_model_turns for s in out)
        best = min(best, (time.perf_counter() - t) / turns * 1e3)
    return best, out


def instant(tok, prompts, repeat):
    def run(path):
        return lambda: asyncio.run(path(tok, InstantEngine(tok, prompts), prompts))

    loop_ms, loop = per_turn_ms(run(_tool_loop), repeat)
    agent_ms, agent = per_turn_ms(run(_agent), repeat)
    assert [s.trajectory.response_ids for s in loop] == [s.trajectory.response_ids for s in agent], \
        "the two paths must record the same trajectories"
    return loop_ms, agent_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    path = write_tool_sum_task(tempfile.mktemp(suffix=".jsonl"), num_prompts=a.sessions, seed=0)
    prompts = [json.loads(line)["prompt"] for line in open(path)]
    tok = load_tokenizer(build_tiny_checkpoint(tempfile.mkdtemp(), extra_tokens=TOOL_TOKENS,
                                               chat_template=TINY_TOOL_CHAT_TEMPLATE))
    loop_ms, agent_ms = instant(tok, prompts, a.repeat)
    print(f"instant model, {a.sessions} sessions: tool loop {loop_ms:.2f} ms/turn, agent {agent_ms:.2f} ms/turn, "
          f"ratio {agent_ms / loop_ms:.2f}")


if __name__ == "__main__":
    main()
