"""The functions a run loads from the user's files by path (as --custom-rm-path is): the
dynamic-sampling filter, the TIS function, the reward post-process, the generate function with
its tools (whose executor starts here: the sandbox's workers). Loaded once per job, by
ppo.setup.job.start_job before anything is written or any role starts, so a bad path fails
first and the user's module runs once; closed with the job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from algorithms import truncated_is
from ppo.generate import rewards
from ppo.config import PPOConfig
from ppo.generate.dynamic_sampling import DynamicSampling
from ppo.generate.setup import Generation, load_generation
from roles.reward.custom import load_function


@dataclass(frozen=True)
class UserFunctions:
    dynamic_sampling: DynamicSampling  # with --dynamic-sampling-filter-path's filter, if given
    tis_function: Callable  # --custom-tis-function-path, else algorithms.truncated_is
    post_process: Callable | None  # --custom-reward-post-process-path
    generation: Generation | None  # --custom-generate-function-path / the tool loop; None: one response per prompt

    def close(self) -> None:
        """Stop what they started: the tools' executor."""
        if self.generation is not None:
            self.generation.close()


def load_user_functions(cfg: PPOConfig) -> UserFunctions:
    path = cfg.ppo.custom_tis_function_path
    return UserFunctions(dynamic_sampling=DynamicSampling.from_config(cfg),
                         tis_function=load_function(path, "custom_tis_function_path") if path else truncated_is,
                         post_process=rewards.load_post_process(cfg), generation=load_generation(cfg))
