"""Token faithfulness of agent sessions under real chat templates (Qwen3's, Llama 3.2's): the
record holds the engine's own ids; a request that extends it reuses them (the engine is asked to
continue exactly those ids, so it finds their K/V); one the template rewrote starts a new record,
counted as a split; nothing the model wrote is ever tokenized again."""

import asyncio

import pytest

from ppo.generate.agents.server import SessionServer
from ppo.generate.agents.session import Session
from ppo.generate.trajectory import ENV, MODEL
from tests.agent_engine import SAMPLING, ScriptedEngine
from tests.chat_tokenizers import llama3_tokenizer, qwen3_tokenizer

openai = pytest.importorskip("openai", reason="the openai client (in .[test]); the GPU image lacks it")

pytestmark = pytest.mark.timeout(60)

CALC = {"type": "function", "function": {"name": "calc", "description": "adds",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def qwen():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return llama3_tokenizer()


def converse(tok, replies, agent, **template_kwargs):
    """Run `await agent(chat)`, `chat(messages, **kw)` being one completion; returns the session
    and the engine's requests."""

    async def main():
        server = SessionServer(tok, "m")
        await server.start()
        engine = ScriptedEngine(tok, replies)
        session = Session(0, tok, SAMPLING, 4096, engine)
        client = openai.AsyncOpenAI(base_url=server.open_session(session), api_key=server.api_key, max_retries=0)

        async def chat(messages, **kw):
            extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
            r = await client.chat.completions.create(model="m", messages=messages, extra_body=extra, **kw)
            return r.choices[0].message

        try:
            await agent(chat)
        finally:
            await client.close()
            await server.close()
        return session, engine.requests

    return asyncio.run(main())


def assert_faithful(session, requests, tok):
    """Every model turn of every record is an engine reply, id for id; every request after the
    first continued its record's ids exactly (so the engine's kept K/V serve it)."""
    replies = iter(requests)
    for record in session.records:
        traj = record.trajectory
        assert record.text == tok.decode(traj.ids, skip_special_tokens=False)
        context = list(traj.prompt_ids)
        for turn in traj.turns:
            if turn.source == MODEL:
                _, prompt_ids, _ = next(replies)
                assert prompt_ids == context
            context += turn.ids
        assert traj.loss_mask == [int(t.source == MODEL) for t in traj.turns for _ in t.ids]


def test_qwen3_tool_turns_with_thinking_extend_the_record_token_for_token(qwen):
    call = '<think>\nI should add\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'
    # the model's final answer in its own tokenization, one token a character: not what BPE gives its text
    final = "<think>\nsum known\n</think>\n\nthe answer is 3"
    final_ids = [i for ch in final for i in qwen.encode(ch, add_special_tokens=False)]
    assert final_ids != qwen.encode(final, add_special_tokens=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"}]

    async def agent(chat):
        m = await chat(messages, tools=[CALC])
        assert m.tool_calls and m.model_extra["reasoning_content"] == "I should add"
        messages.extend([m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                           "content": "3"}])
        m = await chat(messages, tools=[CALC])
        assert m.content == "the answer is 3" and m.model_extra["reasoning_content"] == "sum known"

    session, requests = converse(qwen, [call, final_ids], agent)
    # what the engine was asked to continue is, as text, the template's rendering of the conversation
    assert qwen.decode(requests[1][1], skip_special_tokens=False) == qwen.apply_chat_template(
        messages, tools=[CALC], tokenize=False, add_generation_prompt=True)
    assert session.stats["agent_splits"] == 0 and len(session.records) == 1
    traj = session.last.trajectory
    assert [t.source for t in traj.turns] == [MODEL, ENV, MODEL]
    assert list(traj.turns[2].ids) == final_ids + [qwen.eos_token_id]  # kept as the engine wrote it
    env = qwen.decode(traj.turns[1].ids, skip_special_tokens=False)
    assert env == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert_faithful(session, requests, qwen)


def test_qwen3_drops_earlier_thinking_at_a_new_query_so_a_new_sample_starts(qwen):
    async def agent(chat):
        messages = [{"role": "user", "content": "hi"}]
        m = await chat(messages)
        messages += [m.model_dump(exclude_none=True), {"role": "user", "content": "and now?"}]
        await chat(messages)

    session, requests = converse(qwen, ["<think>\nhmm\n</think>\n\nhello", "<think>\nagain\n</think>\n\nbye"], agent)
    assert session.stats["agent_splits"] == 1 and len(session.records) == 2
    second = session.records[1].trajectory
    # the new record's prompt is the template's rendering, in which the first thinking is gone
    prompt = qwen.decode(second.prompt_ids, skip_special_tokens=False)
    assert "hmm" not in prompt and prompt.endswith("hello<|im_end|>\n<|im_start|>user\nand now?<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    assert session.last is session.records[1] and session.training_records() == session.records  # both train
    assert_faithful(session, requests, qwen)


def test_qwen3_without_thinking_renders_history_without_the_empty_block_so_a_new_sample_starts(qwen):
    async def agent(chat):
        messages = [{"role": "user", "content": "1+2?"}]
        m = await chat(messages, tools=[CALC])
        messages += [m.model_dump(exclude_none=True), {"role": "tool", "content": "3"}]
        await chat(messages, tools=[CALC])

    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'
    session, requests = converse(qwen, [call, "3"], agent, enable_thinking=False)
    prompt = qwen.decode(session.last.trajectory.prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the template renders an earlier assistant turn without the empty thinking block it was
    # prompted with: the history was rewritten, and the server says so rather than re-tokenizing
    assert session.stats["agent_splits"] == 1
    assert_faithful(session, requests, qwen)


def test_llama3_chat_turns_extend_and_a_trimmed_reply_starts_a_new_sample(llama):
    async def agent(chat):
        messages = [{"role": "user", "content": "hi"}]
        m = await chat(messages)
        messages += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "more"}]
        m = await chat(messages)
        messages += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "end"}]
        await chat(messages)

    # the second reply ends in a space, which Llama's template trims from history
    session, requests = converse(llama, ["hello there", "how are you? ", "bye"], agent, date_string="7 Dec 2026")
    assert session.stats["agent_splits"] == 1 and len(session.records) == 2
    first = session.records[0].trajectory
    assert [t.source for t in first.turns] == [MODEL, ENV, MODEL]
    assert llama.decode(first.turns[1].ids, skip_special_tokens=False) == (
        "<|start_header_id|>user<|end_header_id|>\n\nmore<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert_faithful(session, requests, llama)
