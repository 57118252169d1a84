"""The session server through the real `openai` client: completions streamed and not, tool
calls, log-probs, n, stop, the OpenAI-shaped errors and limits, and no port left open."""

import asyncio
import json
import socket

import aiohttp
import pytest

from ppo.generate.agents.server import ServerConfig, SessionServer
from ppo.generate.agents.session import Session
from ppo.generate.trajectory import ENV, MODEL
from tests.agent_engine import SAMPLING, ScriptedEngine
from tests.chat_tokenizers import qwen3_tokenizer

openai = pytest.importorskip("openai", reason="the openai client (in .[test]); the GPU image lacks it")

pytestmark = pytest.mark.timeout(60)

CALC = {"type": "function", "function": {"name": "calc", "description": "adds",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def serve(tok, replies, fn, config=ServerConfig(), sampling=SAMPLING, max_context=4096):
    """Run `await fn(client, session, engine, server)` against a fresh server and one session."""

    async def main():
        server = SessionServer(tok, "tiny-qwen3", config)
        await server.start()
        engine = ScriptedEngine(tok, replies)
        session = Session(0, tok, sampling, max_context, engine)
        client = openai.AsyncOpenAI(base_url=server.open_session(session), api_key=server.api_key, max_retries=0)
        try:
            return await fn(client, session, engine, server)
        finally:
            await client.close()
            await server.close()

    return asyncio.run(main())


def test_completions_streamed_and_not_carry_the_engines_tokens_and_log_probs(tok):
    async def fn(client, session, engine, server):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny-qwen3"]
        messages = [{"role": "user", "content": "hello"}]
        r = await client.chat.completions.create(model="any", messages=messages, logprobs=True, max_tokens=50)
        assert r.choices[0].message.content == "the answer is 42" and r.choices[0].finish_reason == "stop"
        ids = session.last.trajectory.turns[-1].ids
        assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(
            [-0.01 * (i + 1) for i in range(len(ids))])
        assert "".join(c.token for c in r.choices[0].logprobs.content) == "the answer is 42<|im_end|>"
        assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(engine.requests[0][1])
        assert engine.requests[0][2]["max_new_tokens"] == 50  # max_tokens caps the session's budget
        stream = await client.chat.completions.create(
            model="any", messages=messages + [r.choices[0].message, {"role": "user", "content": "again"}],
            stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "hello there" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len(session.last.trajectory.turns[-1].ids)
        assert session.stats["agent_splits"] == 0  # the second request extended the first's record

    serve(tok, ["the answer is 42", "hello there"], fn)


def test_tool_calls_and_thinking_come_back_in_openai_fields_and_stream(tok):
    reply = "<think>\nadd them\n</think>\n\nlet me add\n" + CALL

    async def fn(client, session, engine, server):
        messages = [{"role": "user", "content": "1+2?"}]
        r = await client.chat.completions.create(model="any", messages=messages, tools=[CALC])
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.content == "let me add"
        assert m.model_extra["reasoning_content"] == "add them"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("calc", {"expr": "1+2"})]
        none = await client.chat.completions.create(model="any", messages=messages, tools=[CALC], tool_choice="none")
        assert none.choices[0].message.tool_calls is None and CALL in none.choices[0].message.content
        stream = await client.chat.completions.create(model="any", messages=messages, tools=[CALC], stream=True)
        calls = [t for c in [c async for c in stream] for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [(0, "calc", '{"expr": "1+2"}')]

    serve(tok, [reply, reply, reply], fn)


def test_n_choices_fork_the_record_and_stop_strings_cut_it(tok):
    async def fn(client, session, engine, server):
        messages = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="any", messages=messages, n=2)
        assert [c.message.content for c in r.choices] == ["first", "second"] and len(session.records) == 2
        # the agent keeps choice 1: its record is extended, not choice 0's
        r2 = await client.chat.completions.create(
            model="any", messages=messages + [r.choices[1].message, {"role": "user", "content": "go on"}],
            stop=["STOP"])
        assert r2.choices[0].message.content == "the answer is " and r2.choices[0].finish_reason == "stop"
        assert session.last is session.records[1] and session.stats["agent_splits"] == 0
        assert tok.decode(session.last.trajectory.turns[-1].ids) == "the answer is "
        # distinct seeds for every engine request of the session (turn_seed)
        assert len({req[2]["seed"] for req in engine.requests}) == 3

    serve(tok, ["first", "second", "the answer is STOP 42"], fn)


def test_a_fork_holds_the_turns_it_shares_as_context_so_they_train_once(tok):
    async def fn(client, session, engine, server):
        messages = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model="any", messages=messages)
        await client.chat.completions.create(
            model="any", messages=messages + [r.choices[0].message, {"role": "user", "content": "more"}], n=2)
        base, fork = session.records
        assert [t.source for t in base.trajectory.turns] == [MODEL, ENV, MODEL]
        assert [t.source for t in fork.trajectory.turns] == [ENV, ENV, MODEL]  # the first answer: base's to train
        assert fork.trajectory.ids[:-len(fork.trajectory.turns[-1].ids)] == base.trajectory.ids[
            :-len(base.trajectory.turns[-1].ids)]
        assert session.training_records() == [fork, base]  # every record, the latest (choice 0's) last

    serve(tok, ["hello", "one", "two"], fn)


def test_bad_requests_get_openai_shaped_errors(tok):
    async def fn(client, session, engine, server):
        messages = [{"role": "user", "content": "hi"}]
        cases = [(dict(messages=[]), "messages"), (dict(messages=messages, temperature=0.3), "temperature"),
                 (dict(messages=messages, tool_choice="required", tools=[CALC]), "tool_choice"),
                 (dict(messages=messages, n=99), "n"), (dict(messages=messages, top_logprobs=3, logprobs=True),
                                                        "top_logprobs"),
                 (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0]")]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="any", **kwargs)
            assert e.value.status_code == 400 and e.value.body["param"] == param, kwargs
            assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:  # more than the model's context
            await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x" * 600}])
        assert e.value.body["code"] == "context_length_exceeded"
        bad_key = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            await bad_key.chat.completions.create(model="any", messages=messages)
        assert e.value.body["code"] == "invalid_api_key"
        await bad_key.close()
        gone = openai.AsyncOpenAI(base_url=str(client.base_url).replace("/sessions/", "/sessions/x"),
                                  api_key=server.api_key, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await gone.chat.completions.create(model="any", messages=messages)
        await gone.close()
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "y" * 5000}])
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
        async with aiohttp.ClientSession() as raw, raw.post(  # not JSON
                f"{client.base_url}chat/completions", data=b"{",
                headers={"Authorization": f"Bearer {server.api_key}"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
        assert engine.requests == []  # none of them reached the engines
        assert session.stats["agent_requests"] == 1  # the one over budget was the only one rendered

    serve(tok, [], fn, config=ServerConfig(max_request_bytes=4096), max_context=512)


def test_requests_beyond_the_concurrency_limit_get_429(tok):
    async def fn(client, session, engine, server):
        entered, gate, reply = asyncio.Event(), asyncio.Event(), engine.__call__

        async def slow(*args):
            entered.set()
            await gate.wait()
            return await reply(*args)

        session._engine = slow  # the first request holds its place until the second was refused
        messages = [{"role": "user", "content": "hi"}]
        first = asyncio.create_task(client.chat.completions.create(model="any", messages=messages))
        await entered.wait()
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model="any", messages=messages)
        assert e.value.body["code"] == "rate_limit_exceeded"
        gate.set()
        assert (await first).choices[0].message.content == "ok"

    serve(tok, ["ok"], fn, config=ServerConfig(max_concurrent_requests=1))


def test_the_server_leaves_no_port_open_once_closed(tok):
    async def main():
        server = SessionServer(tok, "m")
        await server.start()
        port = server.port
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
        await server.close()
        return port

    port = asyncio.run(main())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
