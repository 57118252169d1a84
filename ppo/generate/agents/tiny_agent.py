"""tiny_tools' task written as an agent against the OpenAI client (recipe tiny_tools_agent): the
built-in tool loop's steps (ppo.generate.tool_loop), as agent code would write them.

Ask with the calculator spec; while the model calls tools, run them and send the results; stop
when it calls none, is cut off, has had MAX_TURNS turns, or the server says no room is left
(HTTP 400 context_length_exceeded: the tool loop's "no room left for the model to answer").
The reward is left to the run's scorer (tiny_tools' answer_reward). One difference from the
tool loop: a malformed call comes back as text (OpenAI's API has no malformed tool calls), so
the agent stops where the tool loop would have answered with an error message.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI, BadRequestError, DefaultAsyncHttpxClient

from roles.tools.calculator import TOOL_SPECS, execute_tool

MAX_TURNS = 2  # tiny_tools' --generate-max-turns


async def run_agent(base_url, prompt, request_kwargs, metadata, **kwargs):
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    # plain http to 127.0.0.1: no TLS, so no CA bundle to load (0.1-0.25 s a client on the CPU machine)
    http = DefaultAsyncHttpxClient(verify=False)
    async with AsyncOpenAI(base_url=base_url, api_key=kwargs["api_key"], max_retries=0, http_client=http) as client:
        for turn in range(MAX_TURNS):
            try:
                response = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOL_SPECS,
                                                                **request_kwargs)
            except BadRequestError as e:
                if e.code == "context_length_exceeded":
                    break
                raise
            message = response.choices[0].message
            if not message.tool_calls or turn == MAX_TURNS - 1:  # the last turn's calls would never be read
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": await _run(call.function.name, call.function.arguments)})
    return None  # the scorer grades the answer


async def _run(name: str, arguments: str) -> str:
    """The tool's answer, or what went wrong, as the tool loop's executor words it (ppo.generate.tools)."""
    try:
        return execute_tool(name, json.loads(arguments))
    except Exception as e:  # the tool's failure is the model's to read
        return f"error: {name} raised {type(e).__name__}: {e}"
