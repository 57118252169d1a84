"""Tools that fail inside the tool loop, under both executors (the sandbox's ToolExecutor with
the real bwrap, and InProcessExecutor): a call that hangs past the timeout, one that raises, a
malformed call, a sandbox worker or a call's sandbox killed mid-call. Each is an error message
in the tool turn, the trajectory goes on to its next model turn, and each is counted once in the
sample's stats, from which the rollout's metrics are summed (ppo.generate.metrics)."""

import asyncio
import os
import signal
from types import SimpleNamespace

import psutil
import pytest

from ppo.config import ToolsConfig
from ppo.generate.custom import GenerateArgs, Sample
from ppo.generate.metrics import trajectory_metrics
from ppo.generate.tool_loop import generate as tool_loop
from ppo.generate.tools import ToolSetup, tool_limits
from roles.tools import sandbox
from roles.tools.executor import ToolExecutor
from roles.tools.in_process import InProcessExecutor
from roles.tools.specs import ToolSet
from tests.test_generate_tools import ScriptedClient

BWRAP, NO_SANDBOX = sandbox.choose_bwrap()
TOOL = '''
import time

def execute(name, arguments):
    what = arguments["what"]
    if what == "hang":
        time.sleep(3)  # past the 0.5 s timeout; short, so that an in-process thread ends with the test
    if what == "slow":
        time.sleep(1.5)
    if what == "crash":
        raise RuntimeError("boom")
    return what + " done"
'''
SPECS = ({"type": "function", "function": {"name": "misbehave", "parameters": {
    "type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]}}},)
LIMITS = tool_limits(SimpleNamespace(tools=ToolsConfig(tool_timeout=0.5, tool_cpu_seconds=2, tool_memory_mb=256)))
SLOW_LIMITS = tool_limits(SimpleNamespace(tools=ToolsConfig(tool_timeout=10, tool_cpu_seconds=2, tool_memory_mb=256)))


@pytest.fixture
def tools(tmp_path):
    (tmp_path / "misbehave.py").write_text(TOOL)
    return ToolSet(specs=SPECS, function_path=f"{tmp_path}/misbehave.py:execute")


def executor(kind: str, tools: ToolSet, limits=LIMITS):
    if kind == "sandbox":
        if BWRAP is None:
            pytest.skip(f"{NO_SANDBOX} (.ci/run says so)")
        return ToolExecutor(tools, limits, num_workers=2)
    return InProcessExecutor(tools, limits, num_workers=2)


def call(what: str) -> str:
    return '<tool_call>{"name": "misbehave", "arguments": {"what": "' + what + '"}}</tool_call>'


def run_loop(tok, tools, ex, turns: list[str], during=None):
    """The tool loop over scripted model turns (each ends with <|im_end|>, the model's stop
    token); `during(executor)` runs as a task beside it."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    client = ScriptedClient([(tok.encode(t, add_special_tokens=False) + [im_end], "stop") for t in turns])
    setup = ToolSetup(tools=tools, executor=ex, max_turns=len(turns), parser="qwen25")
    args = GenerateArgs(config=None, tokenizer=tok, max_context=4096, client=client, tools=setup)
    sample = Sample(index=0, group_index=0, prompt="q", prompt_ids=tok.encode("q", add_special_tokens=False))

    async def main():
        side = asyncio.ensure_future(during(ex)) if during else None
        out = await tool_loop(args, sample, {"max_new_tokens": 4000, "seed": 1})
        if side is not None:
            await side
        return out

    out = asyncio.run(main())
    assert not client.turns  # every scripted turn was asked for: the trajectory went on
    return out, [tok.decode(list(t.ids), skip_special_tokens=False) for t in out.trajectory.turns]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["sandbox", "in_process"])
def test_a_hang_a_crash_and_a_malformed_call_are_error_messages_and_the_trajectory_goes_on(qwen_tok, tools, kind):
    ex = executor(kind, tools)
    try:
        out, texts = run_loop(qwen_tok, tools, ex, [call("hang") + call("crash") + "<tool_call>nope</tool_call>",
                                        call("echo"), "the answer"])
    finally:
        ex.close()
    assert [t.source for t in out.trajectory.turns] == ["model", "env", "model", "env", "model"]
    hang, crash, malformed = texts[1].split("</tool_response>")[:3]
    assert "error" in hang and "longer than 0<unk>5 s" in hang  # "." is no tiny token
    assert "error" in crash and "runtimeerror" in crash and "boom" in crash  # the tiny tokenizer lowercases
    assert "error" in malformed and "not json" in malformed
    assert "echo done" in texts[3]
    assert out.stats == {"tool_calls": 4, "tool_errors": 3, "tool_timeouts": 1, "tool_seconds": pytest.approx(
        out.stats["tool_seconds"]), "tool_worker_restarts": 0, "tool_errors/timeout": 1, "tool_errors/crash": 1,
        "tool_errors/malformed_call": 1}
    assert 0.5 <= out.stats["tool_seconds"] < 10
    row = {"response_ids": out.trajectory.response_ids, "num_turns": out.trajectory.num_model_turns,
           "num_env_tokens": out.trajectory.num_env_tokens, "stats": out.stats}
    metrics = trajectory_metrics([row, row])  # summed over the rollout's samples
    assert [metrics[f"rollout/{k}"] for k in ("tool_calls", "tool_errors", "tool_timeouts")] == [8, 6, 2]
    assert metrics["rollout/tool_errors/crash"] == metrics["rollout/tool_errors/malformed_call"] == 2
    assert metrics["rollout/turns_per_sample"] == 3 and 0 < metrics["rollout/env_token_share"] < 1
    assert ex.stats()["tool_calls"] == 3  # the malformed call never reached the executor


@pytest.mark.timeout(60)
def test_a_sandbox_worker_killed_mid_call_is_replaced_and_the_call_answered_once(qwen_tok, tools):
    ex = executor("sandbox", tools, SLOW_LIMITS)  # the slow call ends by itself, in 1.5 s

    async def kill_the_busy_worker(ex):
        busy = await _busy(ex)
        os.kill(busy.pid, signal.SIGKILL)

    try:
        out, texts = run_loop(qwen_tok, tools, ex, [call("slow"), "the answer"], during=kill_the_busy_worker)
    finally:
        ex.close()
    assert "slow done" in texts[1]  # run again on the replacement
    assert (out.stats["tool_calls"], out.stats["tool_errors"], out.stats["tool_worker_restarts"]) == (1, 0, 1)


@pytest.mark.timeout(60)
def test_a_calls_sandbox_killed_mid_call_is_an_error_and_the_worker_serves_on(qwen_tok, tools):
    ex = executor("sandbox", tools, SLOW_LIMITS)

    async def kill_the_sandbox(ex):
        busy = await _busy(ex)
        for child in busy.children():  # bwrap, and the call's processes below it
            child.kill()

    try:
        out, texts = run_loop(qwen_tok, tools, ex, [call("slow"), call("echo"), "the answer"], during=kill_the_sandbox)
    finally:
        ex.close()
    assert "error" in texts[1] and "sandbox was killed by sigkill" in texts[1] and "echo done" in texts[3]
    assert (out.stats["tool_calls"], out.stats["tool_errors"], out.stats["tool_worker_restarts"]) == (2, 1, 0)
    assert out.stats["tool_errors/crash"] == 1


async def _busy(ex) -> psutil.Process:
    """The worker whose sandbox is running a call."""
    for _ in range(200):
        await asyncio.sleep(0.02)
        for worker in ex._workers:
            process = psutil.Process(worker.process.pid)
            if process.children():
                await asyncio.sleep(0.2)  # inside the call now, past bwrap's start
                return process
    raise AssertionError("no worker started a sandbox")
