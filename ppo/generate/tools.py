"""The tools of the built-in tool loop: the checked specs and function, and the executor that
runs the calls, built once per job from the config.

    --generate-tool-specs-path            OpenAI-style specs (roles.tools.specs: a .json file, a
                                          list, or a function returning one)
    --generate-execute-tool-function-path execute(name: str, arguments: dict) -> str, sync or async
    --tool-sandbox (default) / --no-tool-sandbox, and ToolsConfig's limits

With --tool-sandbox every call runs under bubblewrap on supervised worker processes
(roles.tools.executor.ToolExecutor); with --no-tool-sandbox in the driver's process, with the
same timeout, output cut, argument checks and error kinds but no isolation
(roles.tools.in_process.InProcessExecutor: for trusted plain-Python tools). Both answer
`await executor.call(name, arguments) -> roles.tools.result.ToolResult`.

Checked when the job starts (`load_tool_setup`, `check_chat_template`): a path that does not
load, specs of the wrong shape, a function of the wrong signature, a function the sandbox
cannot import, or a chat template that cannot render a tool turn stop the run in one line
(exit 2) before any role starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from roles.tools.sandbox import Limits
from roles.tools.specs import ToolSet, load_specs, load_tools


@dataclass(frozen=True)
class ToolSetup:
    tools: ToolSet
    executor: object | None  # ToolExecutor or InProcessExecutor: .call(name, arguments) -> ToolResult; .close()
    max_turns: int
    parser: str

    @property
    def specs(self) -> list[dict]:
        """As the chat template takes them (tools=...)."""
        return list(self.tools.specs)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.tools.names)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


def tool_limits(cfg) -> Limits:
    """The limits of each tool call, from the run's ToolsConfig."""
    t = cfg.tools
    return Limits(timeout_s=t.tool_timeout, cpu_seconds=t.tool_cpu_seconds, memory_bytes=t.tool_memory_mb << 20,
                  max_processes=t.tool_max_processes, max_file_bytes=t.tool_max_file_mb << 20,
                  max_output_chars=t.tool_max_output_chars)


def load_tool_setup(cfg) -> ToolSetup | None:
    """The tools of a PPOConfig with their executor started, or None without
    --generate-tool-specs-path; ValueError (one line) when a path does not load or names the
    wrong thing. The caller closes it (`ToolSetup.close`)."""
    g = cfg.generate
    if g.generate_tool_specs_path is None:
        return None
    if g.generate_execute_tool_function_path is None:  # specs alone, for a custom generate function
        return ToolSetup(tools=ToolSet(specs=load_specs(g.generate_tool_specs_path), function_path=None), executor=None,
                         max_turns=g.generate_max_turns, parser=g.generate_tool_call_parser)
    tools = load_tools(g.generate_tool_specs_path, g.generate_execute_tool_function_path)
    if cfg.tools.tool_sandbox:
        from roles.tools.executor import ToolExecutor

        executor = ToolExecutor(tools, tool_limits(cfg), num_workers=cfg.tools.num_tool_workers)
    else:
        from roles.tools.in_process import InProcessExecutor

        executor = InProcessExecutor(tools, tool_limits(cfg), num_workers=cfg.tools.num_tool_workers)
    return ToolSetup(tools=tools, executor=executor, max_turns=g.generate_max_turns, parser=g.generate_tool_call_parser)


def check_chat_template(tokenizer, setup: ToolSetup) -> None:
    """ValueError unless the tokenizer's chat template renders a tool turn after an assistant
    turn ending in its eos token, token for token (ppo.generate.chat.tool_turn_ids)."""
    from ppo.generate.chat import ToolCallError, tool_messages, tool_turn_ids

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tool loop renders tool results with the tokenizer's chat template, and "
                         "this tokenizer has none")
    calls = [ToolCallError("error: check")]
    try:
        tool_turn_ids(tokenizer, tool_messages(calls, ["ok"]), calls, tokenizer.eos_token_id, setup.specs)
    except Exception as e:  # jinja errors too: the template is the user's
        raise ValueError(f"the tokenizer's chat template cannot render a tool turn: {e}") from None
