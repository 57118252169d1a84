"""An agent library runs unmodified against the session server: the OpenAI Agents SDK
(`openai-agents`) with its chat completions model pointed at the session's base URL and one
function tool, the calculator. Its requests extend the session's record token for token (no
split), its tool call runs, and it reads the model's answer as its final output."""

import asyncio

import pytest

from ppo.generate.agents.server import SessionServer
from ppo.generate.agents.session import Session
from ppo.generate.trajectory import ENV, MODEL
from roles.tools.calculator import evaluate
from tests.agent_engine import SAMPLING, ScriptedEngine
from tests.chat_tokenizers import qwen3_tokenizer

openai = pytest.importorskip("openai", reason="the openai client (in .[test]); the GPU image lacks it")

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (pip install openai-agents, in .[test])")

pytestmark = pytest.mark.timeout(60)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347+285"}}\n</tool_call>'


@agents.function_tool
def calculator(expression: str) -> str:
    """Evaluate integer arithmetic: + - * / // % ** and parentheses, e.g. 12*(3+4).

    Args:
        expression: the arithmetic to evaluate
    """
    return evaluate(expression)


def test_the_openai_agents_sdk_runs_unmodified_against_a_session_and_its_turns_extend_one_record():
    tok = qwen3_tokenizer()

    async def main():
        server = SessionServer(tok, "tiny-qwen3")
        await server.start()
        engine = ScriptedEngine(tok, [CALL, "347+285=632"])
        session = Session(0, tok, SAMPLING, 4096, engine)
        client = openai.AsyncOpenAI(base_url=server.open_session(session), api_key=server.api_key, max_retries=0)
        try:
            agent = agents.Agent(name="adder", instructions="Add with the calculator.", tools=[calculator],
                                 model=agents.OpenAIChatCompletionsModel(model="tiny-qwen3", openai_client=client))
            # no traces sent to OpenAI's servers: the run has nowhere else to talk to
            result = await agents.Runner.run(agent, "347+285=", run_config=agents.RunConfig(tracing_disabled=True))
        finally:
            await client.close()
            await server.close()
        return result, session, engine

    result, session, engine = asyncio.run(main())
    assert result.final_output == "347+285=632"
    assert session.stats["agent_requests"] == 2 and session.stats["agent_splits"] == 0
    [record] = session.records
    assert [t.source for t in record.trajectory.turns] == [MODEL, ENV, MODEL]
    assert "<tool_response>\n632\n</tool_response>" in tok.decode(list(record.trajectory.turns[1].ids))
    # the second request is the first's context, the model's own ids, and the tool turn: nothing re-tokenized
    first, second = engine.requests[0][1], engine.requests[1][1]
    assert second == first + list(record.trajectory.turns[0].ids) + list(record.trajectory.turns[1].ids)
