"""The session server: OpenAI's chat completions API over the rollout's engines, one base URL
per agent session, on the rollout's own event loop (aiohttp; docs/agents.md says why).

    POST {base_url}/chat/completions    base_url = http://127.0.0.1:PORT/sessions/TOKEN/v1
    GET  {base_url}/models

Every request needs `Authorization: Bearer KEY`, the run's key (a fresh one per server).
Bodies over `max_request_bytes` get 413, requests beyond `max_concurrent_requests` in flight
get 429 (the openai client retries those), an unknown session 404, a bad request 400; every
error is shaped as OpenAI's. `close()` closes the listening socket: the rollout calls it on
every path, so no port outlives the rollout.
"""

from __future__ import annotations

import hmac
import json
import secrets
from dataclasses import dataclass

from aiohttp import web

from ppo.generate.agents.openai_api import (APIError, ChatRequest, assistant_message, completion_body, logprobs_content,
                                   parse_request, stream_chunks)
from ppo.generate.agents.session import ContextFull, Session


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the agents run in the driver's process or beside it
    max_request_bytes: int = 8 << 20
    max_concurrent_requests: int = 4096  # a rollout's sessions, each usually with one request in flight

    def __post_init__(self):
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be >= 1024")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests={self.max_concurrent_requests} must be >= 1")


class SessionServer:
    """`await start()`, then `open_session(session) -> base_url` per agent, `close_session`, and
    `await close()` at the end of the rollout. `model` is the name /v1/models reports; requests
    may name any model (agent code often hard-codes one)."""

    def __init__(self, tokenizer, model: str, config: ServerConfig = ServerConfig()):
        self.tok, self.model, self.config = tokenizer, model, config
        self.api_key = "tandem-" + secrets.token_urlsafe(24)
        self._sessions: dict[str, Session] = {}
        self._in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=[self._errors])
        app.add_routes([web.post("/sessions/{token}/v1/chat/completions", self._chat),
                        web.get("/sessions/{token}/v1/models", self._models)])
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        # a rollout's sessions connect at once: a backlog of aiohttp's default 128 drops the rest's
        # SYNs, and their clients' connect timeouts (the openai client's: 5 s) run out under load
        await web.TCPSite(self._runner, self.config.host, 0, backlog=self.config.max_concurrent_requests).start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, session: Session) -> str:
        token = secrets.token_urlsafe(12)
        self._sessions[token] = session
        return f"http://{self.config.host}:{self.port}/sessions/{token}/v1"

    def close_session(self, base_url: str) -> None:
        self._sessions.pop(base_url.rstrip("/").split("/")[-2], None)

    # -- handlers -------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            auth = request.headers.get("Authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError(401, "incorrect API key provided: use the api_key given to the agent function",
                               code="invalid_api_key")
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge:
            e = APIError(413, f"the request is larger than {self.config.max_request_bytes} bytes",
                         code="request_too_large")
            return web.json_response(e.body(), status=413)
        except web.HTTPException as e:  # aiohttp's own: 404 for an unknown path, 405 for a wrong method
            if e.status >= 500:
                raise
            body = APIError(e.status, f"{request.method} {request.path}: {e.reason}").body()
            return web.json_response(body, status=e.status)

    def _session(self, request: web.Request) -> Session:
        session = self._sessions.get(request.match_info["token"])
        if session is None:
            raise APIError(404, "no such session: it ended (the agent function returned) or never existed",
                           code="session_not_found")
        return session

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        if self._in_flight >= self.config.max_concurrent_requests:
            raise APIError(429, f"more than {self.config.max_concurrent_requests} requests in flight",
                           type="rate_limit_error", code="rate_limit_exceeded")
        self._in_flight += 1
        try:
            try:
                body = json.loads(await request.read())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not JSON: {e}") from None
            chat = parse_request(body, session.sampling_params)
            prompt = self._render(chat)
            try:
                completions = await session.complete(prompt, chat.n, chat.max_tokens, chat.stop)
            except ContextFull as e:
                raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        finally:
            self._in_flight -= 1
        request_id = f"chatcmpl-{secrets.token_hex(12)}"
        choices = []
        for k, c in enumerate(completions):
            message, called = assistant_message(c.text, chat.tools, chat.tool_choice)
            choice = {"index": k, "message": message, "logprobs": None,
                      "finish_reason": "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason}
            if chat.logprobs:
                choice["logprobs"] = logprobs_content([session.decode([t]) for t in c.ids], c.log_probs)
            choices.append(choice)
        prompt_tokens = completions[0].num_prompt_tokens
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(len(c.ids) for c in completions),
                 "total_tokens": prompt_tokens + sum(len(c.ids) for c in completions)}
        if not chat.stream:
            return web.json_response(completion_body(request_id, chat.model, choices, usage))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(request_id, chat.model, choices, usage if chat.include_usage else None):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _render(self, chat: ChatRequest) -> str:
        try:
            return self.tok.apply_chat_template(chat.messages, tools=chat.tools, tokenize=False,
                                                add_generation_prompt=True, **chat.chat_template_kwargs)
        except Exception as e:  # the template's own exception (raise_exception, a jinja error): the request's fault
            raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages") from None
