"""Tools for multi-turn rollouts, each call in a sandbox (docs/tools.md).

- ``roles.tools.executor.ToolExecutor``: ``await executor.call(name, arguments) -> ToolResult``
  on supervised worker processes; ``stats()`` for the rollout's ``rollout/tool_*`` metrics
- ``roles.tools.specs.load_tools``: ``--generate-tool-specs-path`` and
  ``--generate-execute-tool-function-path``, checked
- ``roles.tools.sandbox``: one call under bubblewrap with resource limits
- ``roles.tools.calculator``: an example tool (integer arithmetic)

Nothing is imported here: the sandbox's runner imports this package on every call.
"""
