"""Agent functions in a rollout on real engine processes: miles' signature, the sample built from
what the server recorded, the agent's own reward, its failures, and the server gone afterwards."""

import asyncio
import socket
from types import SimpleNamespace

import pytest

from ppo.generate.agents.agent import AgentArgs, agent_generate_function, load_agent_function
from ppo.config.recipes import tiny_tools_agent
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.generate.batch import build_batch
from ppo.generate.chat import render_ids
from ppo.generate.rollout import SamplingParams, generate_and_score
from ppo.generate.trajectories import generate_trajectories_and_score
from ppo.tiny_model import EOS_ID, TINY_CHAT_TEMPLATE, build_tiny_checkpoint, load_tokenizer

openai = pytest.importorskip("openai", reason="the openai client (in .[test]); the GPU image lacks it")

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

PARAMS = SamplingParams(n_samples_per_prompt=2, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=-1,
                        stop_token_ids=(EOS_ID,), seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny random model, with a chat template for the server to render requests with."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), seed=0, chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def prompts(ckpt):
    tok = load_tokenizer(ckpt)
    out = []
    for i in range(3):
        messages = [{"role": "user", "content": f"{i}+{i}="}]
        out.append({"prompt": f"{i}+{i}=", "messages": messages,
                    "prompt_ids": render_ids(tok, messages)})
    return out


def rollout(engines, ckpt, prompts, agent):
    tok = load_tokenizer(ckpt)
    return generate_trajectories_and_score(
        engines, [], prompts, PARAMS, step=0, decode=tok.decode, eos_id=EOS_ID, recover=lambda role, dead: None,
        generate_fn=agent_generate_function(agent),
        make_args=lambda client: AgentArgs(SimpleNamespace(), tok, 64, client))


def test_an_agents_chat_samples_what_the_default_path_samples_and_its_reward_is_kept(two_engines, ckpt, prompts):
    urls = []

    async def one_chat(base_url, prompt, request_kwargs, metadata, **kwargs):
        urls.append(base_url)
        async with openai.AsyncOpenAI(base_url=base_url, api_key=kwargs["api_key"]) as client:
            r = await client.chat.completions.create(model="tiny", messages=prompt, **request_kwargs)
        return 0.5 if r.choices[0].message.content else 0.25

    default = generate_and_score(two_engines, [], prompts, PARAMS, step=0, decode=str, eos_id=EOS_ID,
                                 recover=lambda role, dead: None)
    agent = rollout(two_engines, ckpt, prompts, one_chat)
    for d, a in zip(default, agent, strict=True):
        assert (a["index"], a["prompt_ids"], a["response_ids"]) == (d["index"], d["prompt_ids"], d["response_ids"])
        assert a["rollout_log_probs"] == pytest.approx(d["rollout_log_probs"], abs=1e-5)
        assert a["reward"] in (0.5, 0.25) and a["stats"]["agent_requests"] == 1 and a["num_turns"] == 1
    assert len(set(urls)) == len(agent)  # a base URL per session
    port = int(urls[0].split(":")[2].split("/")[0])
    with pytest.raises(ConnectionRefusedError):  # the rollout closed the server
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_an_agent_that_fails_after_a_completion_trains_on_its_record_and_one_before_stops_the_run(
        two_engines, ckpt, prompts):
    async def fails_late(base_url, prompt, request_kwargs, metadata, **kwargs):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=kwargs["api_key"]) as client:
            await client.chat.completions.create(model="tiny", messages=prompt, **request_kwargs)
        raise KeyError("the agent's own bug")

    rows = rollout(two_engines, ckpt, prompts[:1], fails_late)
    assert [r["stats"]["agent_errors"] for r in rows] == [1, 1] and all(r["response_ids"] for r in rows)

    async def fails_early(base_url, prompt, request_kwargs, metadata, **kwargs):
        raise KeyError("the agent's own bug")

    with pytest.raises(RuntimeError, match="raised before any completion: KeyError"):
        rollout(two_engines, ckpt, prompts[:1], fails_early)


async def an_agent(base_url, prompt, request_kwargs, metadata, **kwargs):
    return None


def not_async(base_url, prompt, request_kwargs, metadata, **kwargs):
    return None


async def two_args(base_url, prompt):
    return None


def test_agent_functions_are_checked_when_the_job_starts(tmp_path):
    assert load_agent_function("tests.test_agents_run:an_agent").__name__ == "an_agent"
    with pytest.raises(ValueError, match="must be an async def run_agent"):
        load_agent_function("tests.test_agents_run:not_async")
    with pytest.raises(ValueError, match=r"two_args\(base_url, prompt\) must take"):
        load_agent_function("tests.test_agents_run:two_args")
    with pytest.raises(ValueError, match="custom_agent_function_path"):
        load_agent_function("tests.test_agents_run:missing")
    cfg = override(tiny_tools_agent(), run_dir=str(tmp_path), custom_generate_function_path="x:y")
    with pytest.raises(ValueError, match="custom-generate-function-path"):
        ensure_valid(cfg)


def test_sessions_that_start_at_once_share_one_server(ckpt):
    args = AgentArgs(SimpleNamespace(), load_tokenizer(ckpt), 64, client=None)

    async def main():
        servers = await asyncio.gather(*(args.server() for _ in range(8)))
        port = servers[0].port
        await args.aclose()
        return servers, port

    servers, port = asyncio.run(main())
    assert all(s is servers[0] for s in servers)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_every_record_of_a_split_session_trains_with_the_sessions_reward_as_one_member_of_its_group(
        two_engines, ckpt, prompts):
    """An agent that edits its history splits its session (docs/agents.md): each record is a row,
    all with the session's reward and its "session", and the group still has n members."""
    async def edits_history(base_url, prompt, request_kwargs, metadata, **kwargs):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=kwargs["api_key"]) as client:
            await client.chat.completions.create(model="tiny", messages=prompt, **request_kwargs)
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "again"}],
                                                 **request_kwargs)
        return float(kwargs["sample_index"])

    rows = rollout(two_engines, ckpt, prompts[:2], edits_history)
    assert [(r["group_index"], r["session"], r["reward"]) for r in rows] == [
        (g, s, float(s)) for g in (0, 1) for s in (2 * g, 2 * g + 1) for _ in range(2)]
    assert [r["index"] for r in rows] == list(range(8)) and all(r["response_ids"] for r in rows)
    first, latest = rows[0], rows[1]  # the latest record is its session's last row, with the session's counts
    assert first["prompt_ids"] == prompts[0]["prompt_ids"] and first["stats"] == {}
    assert latest["stats"]["agent_splits"] == 1 and latest["stats"]["agent_records"] == 2
    assert build_batch(rows, pad_id=0)["sessions"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
