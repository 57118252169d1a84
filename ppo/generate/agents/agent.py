"""Agent functions, miles' `--custom-agent-function-path module:function`:

    async def run_agent(base_url, prompt, request_kwargs, metadata, **kwargs) -> float | dict | None

runs ONE agent session against the session server (ppo.generate.agents.server) with any OpenAI client:
`AsyncOpenAI(base_url=base_url, api_key=kwargs["api_key"])`. `prompt` is the sample's chat
messages where the prompt file had them, else its text; `request_kwargs` the rollout's sampling
in OpenAI's names (pass them on: the server refuses another temperature or top_p); `metadata`
the sample's; kwargs: `api_key`, `label`, `sample_index`.

It returns its reward (a number: the scorer is skipped), or leaves it to the reward scorer
(None, or a dict merged into the sample's metadata for the scorer to read, as miles does).
The training samples are built from what the server recorded: one per record of the session
(ppo.generate.agents.session; several where the chat template rewrote history), all with the
session's reward, the latest last. An agent that raises is counted (rollout/agent_errors) and its
records train like any other; one that raises before any completion stops the run with its error.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Callable

from ppo.generate.agents.server import SessionServer
from ppo.generate.agents.session import Session
from ppo.generate.custom import GenerateArgs, Sample
from roles.reward.custom import load_function

log = logging.getLogger(__name__)


class AgentArgs(GenerateArgs):
    """A generate function's `args` with the rollout's session server, started on first use
    and closed by the rollout (`aclose`)."""

    def __init__(self, config, tokenizer, max_context: int, client, tools=None):
        super().__init__(config, tokenizer, max_context, client, tools)
        self.client = client
        checkpoint = getattr(getattr(config, "checkpoint", None), "hf_checkpoint", None)
        self._server = SessionServer(tokenizer, os.path.basename(str(checkpoint or "").rstrip("/")) or "tandem")
        self._starting: asyncio.Task | None = None

    async def server(self) -> SessionServer:
        """The server, started by the first session that asks (the others wait for that start)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._server.start())
        await asyncio.shield(self._starting)
        return self._server

    async def aclose(self) -> None:
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)  # a start still under way
            await self._server.close()


def request_kwargs(sampling_params: dict) -> dict:
    """The rollout's sampling in OpenAI's names (miles' build_chat_request_kwargs, for what the
    engines read): max_tokens is the whole response's budget, environment tokens included."""
    return {"temperature": sampling_params["temperature"], "top_p": sampling_params["top_p"],
            "max_tokens": sampling_params["max_new_tokens"]}


def agent_generate_function(agent: Callable) -> Callable:
    """The generate function (ppo.generate.custom) that runs `agent` in a session of its own."""

    async def generate(args: AgentArgs, sample: Sample, sampling_params: dict) -> list[Sample]:
        server = await args.server()
        session = Session(sample.index, args.tokenizer, sampling_params, args.max_context, args.client.generate)
        base_url = server.open_session(session)
        try:
            out = await agent(base_url=base_url, prompt=sample.messages or sample.prompt,
                              request_kwargs=request_kwargs(sampling_params), metadata=dict(sample.metadata),
                              api_key=server.api_key, label=sample.label, sample_index=sample.index)
        except Exception as e:  # the agent's own failure; what it recorded still trains (as miles)
            if session.last is None:
                raise RuntimeError(f"sample {sample.index}: the agent function raised before any completion: "
                                   f"{type(e).__name__}: {e}") from e
            log.warning("sample %d: the agent function raised %s: %s", sample.index, type(e).__name__, e)
            session.stats["agent_errors"] += 1
            out = None
        finally:
            server.close_session(base_url)
        if session.last is None:
            raise ValueError(f"sample {sample.index}: the agent function made no chat completion request; it must "
                             "call the model through base_url at least once")
        if out is not None and not isinstance(out, (int, float, dict)):
            raise TypeError(f"the agent function returned {type(out).__name__}; it must return its reward (a number), "
                            "a dict of metadata for the reward scorer, or None")
        # every record trains, the latest last (the one the scorer grades); all share the session's
        # reward, as miles' session server assigns it (ppo.generate.trajectories). The session's
        # counts ride on the latest record only, so that the rollout's sums count them once.
        metadata = {**sample.metadata, **(out if isinstance(out, dict) else {})}
        reward = float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None
        records = session.training_records()
        session.stats["agent_records"] = len(records)
        return [Sample(index=sample.index, group_index=sample.group_index, prompt=sample.prompt,
                       prompt_ids=list(r.trajectory.prompt_ids), label=sample.label, metadata=metadata,
                       messages=sample.messages, trajectory=r.trajectory, weight_version=session.weight_version,
                       num_aborts=session.num_aborts if r is session.last else 0,
                       stats=dict(session.stats) if r is session.last else {}, reward=reward)
                for r in records]

    generate.__name__ = getattr(agent, "__name__", "agent")
    return generate


def load_agent_function(path: str) -> Callable:
    """The function --custom-agent-function-path names; ValueError (one line) if it does not
    load or is not `async def run_agent(base_url, prompt, request_kwargs, metadata, **kwargs)`."""
    fn = load_function(path, "custom_agent_function_path")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"custom_agent_function_path={path!r}: {fn.__name__} must be an async def "
                         "run_agent(base_url, prompt, request_kwargs, metadata, **kwargs)")
    try:
        inspect.signature(fn).bind(base_url="", prompt="", request_kwargs={}, metadata={}, api_key="", label=None,
                                   sample_index=0)
    except TypeError:
        raise ValueError(f"custom_agent_function_path={path!r}: {fn.__name__}{inspect.signature(fn)} must take "
                         "(base_url, prompt, request_kwargs, metadata, **kwargs)") from None
    return fn
