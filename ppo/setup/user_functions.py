"""The functions a run loads from the user's files by path (as --custom-rm-path is): the
dynamic-sampling filter, the TIS function, the reward post-process, the generate function with
its tools. Loaded once per job, by ppo.setup.job.start_job before anything is written or
started, so a bad path fails first and the user's module runs once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from algorithms import truncated_is
from ppo.generate import rewards
from ppo.config import PPOConfig
from ppo.generate.dynamic_sampling import DynamicSampling
from ppo.generate.setup import Generation, load_generation
from roles.reward.custom import load_function
from roles.tools.sandbox import Limits
from roles.tools.specs import ToolSet, load_tools


@dataclass(frozen=True)
class UserFunctions:
    dynamic_sampling: DynamicSampling  # with --dynamic-sampling-filter-path's filter, if given
    tis_function: Callable  # --custom-tis-function-path, else algorithms.truncated_is
    post_process: Callable | None  # --custom-reward-post-process-path
    generation: Generation | None  # --custom-generate-function-path / the tool loop; None: one response per prompt


def load_user_functions(cfg: PPOConfig) -> UserFunctions:
    path = cfg.ppo.custom_tis_function_path
    return UserFunctions(dynamic_sampling=DynamicSampling.from_config(cfg),
                         tis_function=load_function(path, "custom_tis_function_path") if path else truncated_is,
                         post_process=rewards.load_post_process(cfg), generation=load_generation(cfg))


def load_tool_set(cfg: PPOConfig) -> ToolSet | None:
    """The run's tools for the sandbox's executor (roles.tools; not yet what the tool loop runs its
    calls through: ppo.generate.tools), checked (ValueError of one line); None without
    --generate-tool-specs-path."""
    t = cfg.generate
    if t.generate_tool_specs_path is None:
        return None
    return load_tools(t.generate_tool_specs_path, t.generate_execute_tool_function_path)


def tool_limits(cfg: PPOConfig) -> Limits:
    """The sandbox limits of each tool call: ``ToolExecutor(tools, tool_limits(cfg), num_workers=...)``."""
    t = cfg.tools
    return Limits(timeout_s=t.tool_timeout, cpu_seconds=t.tool_cpu_seconds, memory_bytes=t.tool_memory_mb << 20,
                  max_processes=t.tool_max_processes, max_file_bytes=t.tool_max_file_mb << 20,
                  max_output_chars=t.tool_max_output_chars)
