"""The OpenAI chat completions format: requests in (checked), messages for the chat template,
completions out (whole, or as server-sent-event chunks), errors shaped as OpenAI's.

What the engines cannot do is refused with a 400 naming the parameter, never ignored:
tool_choice "required" or a named function (that needs constrained decoding), top_logprobs
(the engine returns the sampled token's log-prob only), and a temperature or top_p other than
the rollout's (the trainer recomputes log-probs at the rollout's, so a sample drawn at another
would train with wrong importance ratios).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ppo.generate.chat import ToolCall, parse_tool_calls

MAX_N = 16
MAX_STOP = 4  # OpenAI's limit
ROLES = ("system", "developer", "user", "assistant", "tool")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class APIError(Exception):
    """An error answered to the client as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]  # as the chat template takes them
    tools: list[dict] | None
    tool_choice: str  # "auto" or "none"
    n: int
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    stream: bool
    include_usage: bool
    chat_template_kwargs: dict


def parse_request(body: object, sampling_params: dict) -> ChatRequest:
    """The request, checked against the rollout's `sampling_params`; APIError(400) naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "you must provide a model parameter", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)):
        raise APIError(400, 'tools must be an array of {"type": "function", "function": {...}}', param="tools")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none"):
        raise APIError(400, f"tool_choice {tool_choice!r} is not supported: the engines cannot force a tool call; "
                            "use 'auto' or 'none'", param="tool_choice")
    n = _int(body, "n", 1, 1, MAX_N)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _int(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                          None, 1, None)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop must be a non-empty string or an array of at most {MAX_STOP}", param="stop")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or abs(value - sampling_params[name]) > 1e-6):
            raise APIError(400, f"{name}={value!r}: this rollout samples at {name}={sampling_params[name]} (the "
                                f"trainer's log-probs assume it); leave {name} out or pass the request_kwargs given "
                                "to the agent", param=name)
    if body.get("top_logprobs"):
        raise APIError(400, "top_logprobs is not supported: the engine returns the sampled token's log-prob only",
                       param="top_logprobs")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    stream_options = body.get("stream_options") or {}
    return ChatRequest(model=model, messages=[_message(m, i) for i, m in enumerate(messages)], tools=tools,
                       tool_choice=tool_choice, n=n, max_tokens=max_tokens, stop=stop,
                       logprobs=bool(body.get("logprobs")), stream=bool(body.get("stream")),
                       include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
                       chat_template_kwargs=kwargs)


def _int(body: dict, name: str, default, lo: int, hi: int | None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise APIError(400, f"{name}={value!r} must be an integer in [{lo}, {hi if hi is not None else 'inf'}]",
                       param=name)
    return value


def _message(m: object, i: int) -> dict:
    """A message as chat templates read it: text content (parts joined; None as ""), and tool
    call arguments as objects, as sglang hands them to templates (Qwen3's writes a string as is,
    an object with tojson: the same text for the arguments this server returns)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise APIError(400, f"messages[{i}] must be an object with a role in {list(ROLES)}", param=f"messages[{i}]")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise APIError(400, f"messages[{i}]: only text content parts are supported", param=f"messages[{i}]")
        content = "".join(p.get("text", "") for p in content)
    out["content"] = "" if content is None else content
    if not isinstance(out["content"], str):
        raise APIError(400, f"messages[{i}].content must be a string or text parts", param=f"messages[{i}]")
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            # name first, as the model writes it: a template that writes the whole function with
            # tojson (tiny_tools') keeps the order, and the openai client sends arguments first
            fn = {k: fn[k] for k in ("name", "arguments") if k in fn} | fn
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass  # the template writes the string as is
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


# -- out ----------------------------------------------------------------------------------------

def assistant_message(text: str, tools: list[dict] | None, tool_choice: str) -> tuple[dict, bool]:
    """(the message, whether it calls tools) from the completion's text: a leading thinking
    block goes to `reasoning_content` (as sglang's and vLLM's reasoning parsers report it), and
    `<tool_call>` blocks (ppo.generate.chat) to `tool_calls` when every block parses. Fields are
    cut exactly where the Qwen3 template joins them again, so the message renders back to the
    text the model wrote."""
    message: dict = {"role": "assistant"}
    if THINK_CLOSE in text:
        thought, _, text = text.partition(THINK_CLOSE)
        message["reasoning_content"] = thought.split(THINK_OPEN)[-1].strip("\n")
        text = text.lstrip("\n")
    calls = []
    if tools and tool_choice != "none":
        names = frozenset(t["function"].get("name") for t in tools)
        calls = parse_tool_calls(text, names)
        if calls and all(isinstance(c, ToolCall) for c in calls):
            text = text[:text.index("<tool_call>")]
            text = text[:-1] if text.endswith("\n") else text
        else:
            calls = []  # a malformed call stays text: the agent reads what the model wrote
    message["content"] = text
    if calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                                       ensure_ascii=False)}}
                                 for c in calls]
    return message, bool(calls)


def logprobs_content(tokens: list[str], log_probs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, log_probs, strict=True)]}


def completion_body(request_id: str, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}


def stream_chunks(request_id: str, model: str, choices: list[dict], usage: dict | None) -> list[dict]:
    """The completion as chunks: per choice the role, the text (and log-probs), the tool calls,
    and the finish reason; then the usage when asked (stream_options.include_usage)."""
    created = int(time.time())

    def chunk(index: int, delta: dict, finish=None, logprobs=None) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    out = []
    for c in choices:
        m = c["message"]
        out.append(chunk(c["index"], {"role": "assistant", "content": ""}))
        if "reasoning_content" in m:
            out.append(chunk(c["index"], {"reasoning_content": m["reasoning_content"]}))
        out.append(chunk(c["index"], {"content": m["content"]}, logprobs=c.get("logprobs")))
        for k, call in enumerate(m.get("tool_calls", ())):
            out.append(chunk(c["index"], {"tool_calls": [{"index": k, **call}]}))
        out.append(chunk(c["index"], {}, finish=c["finish_reason"]))
    if usage is not None:
        out.append({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": usage})
    return out
