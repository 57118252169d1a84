"""A PPO job's processes: the run directory, the supervisor and the roles, built from a config.

Roles start in dependency order: reward scorers (CPU), the trainers and the reward model's
ranks, which end their construction offloaded and so need no lease (megatron's build on the
GPU and are waited for), then the engines (they load their weights on spawn, so each takes
its GPU's lease first).
"""

from __future__ import annotations

import functools

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from ppo import config as C
from ppo.state.checkpoint import Checkpoint, locate
from ppo.gpu.phases import Phases
from ppo.gpu.colocation import Colocation, Tenant, engine_tenant, trainer_tenant
from ppo.config import PPOConfig
from ppo.config.schema import GENERATED_PREFIX
from ppo.config.serialize import to_dict
from ppo.observe.console import RunConsole, ready_seconds
from ppo.prompts.dataset import PromptDataset
from ppo.generate.evaluation import EvalSet, load_eval_sets
from ppo.setup.generated import resolve_eval_paths, resolve_paths
from ppo.generate.setup import check_generation
from ppo.generate.stops import stop_token_ids
from ppo.generate.partial_buffer import PartialSource
from ppo.gpu.dry_run import check_memory_plan
from ppo.gpu.memory_plan import MemoryPlan
from ppo.gpu.sizing import DEFAULT_PROMPT_LEN, FAKE_GPU_BYTES, compute_dtype, gpu_capacity_bytes
from ppo.gpu.placement import Placement, plan_placement
from ppo.state.rundir import RunDirError, RunDirLock, claim, load_problem
from ppo.gpu.side_by_side import memory_budgets
from ppo.setup.role_configs import engine_config, reward_model_config, scorer_config, trainer_config
from ppo.setup.user_functions import UserFunctions, load_user_functions
from roles.reward.role import RewardScorer
from roles.reward.model_scorer import RewardModelScorer
from roles.rollout.engine import RolloutEngine
from roles.trainer import BackendUnavailable, TrainerGroup, trainer_classes
from runtime import ActorHandle, Supervisor
from runtime.agent import NodeLost
from runtime.cluster import ClusterSupervisor
from runtime.events import read_events
from runtime.rendezvous import RendezvousFailed
from ppo.setup.nodes import node0_supervisor
from ppo.gpu.weight_group import WeightBroadcast, open_weight_broadcast

logger = logging.getLogger(__name__)
# Quiet, single-threaded library defaults for every role process: roles share the host's
# cores, and per-process thread pools sized for the whole machine fight each other.
ROLE_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}


class JobSetupError(ValueError):
    """The job's inputs (prompt data, the --load checkpoint) are unusable; nothing was started."""


@dataclass
class Job:
    cfg: PPOConfig
    run_dir: Path
    hf_checkpoint: str
    tok: object  # the model's tokenizer (prompts in, responses out)
    data: PromptDataset
    sup: Supervisor | ClusterSupervisor  # across nodes: node 0's and the node agents' (runtime.cluster)
    placement: Placement
    engines: list[ActorHandle]
    engine_tenants: list[Tenant]
    actor: TrainerGroup  # one handle for the actor's ranks (roles.trainer.group)
    actor_tenant: Tenant
    critic: TrainerGroup | None
    critic_tenant: Tenant | None
    scorers: list[ActorHandle]  # rule, custom-function or remote-service scorers (CPU); [] with a reward model alone
    reward_models: list[ActorHandle]  # reward-model ranks, one per GPU (roles.reward.model_scorer); [] without
    reward_model_tenants: list[Tenant]
    colocation: Colocation
    console: RunConsole  # what the run prints (ppo.observe.console)
    run_dir_lock: RunDirLock  # held until the job is closed (ppo.state.rundir)
    resume_from: Checkpoint | None  # the intact --load checkpoint to resume, if any (ppo.state.checkpoint.locate)
    functions: UserFunctions  # the user's dynamic-sampling filter, TIS function, reward post-process
    eval_sets: list[EvalSet] = field(default_factory=list)  # --eval-prompt-data, loaded (ppo.generate.evaluation)
    memory_plan: MemoryPlan | None = None  # what each role holds per phase (ppo.gpu.memory_plan); None unplanned
    weight_broadcast: WeightBroadcast | None = None  # engines on other nodes than the actor's (ppo.gpu.weight_group)

    def by_broadcast(self, engines: list[ActorHandle]) -> list[bool] | None:
        """For the actor's sync_weights: which of `engines` take their weights by broadcast."""
        if self.weight_broadcast is None:
            return None
        return [self.weight_broadcast.by_broadcast[self.engines.index(e)] for e in engines]

    @functools.cached_property
    def phases(self) -> Phases:
        """The phase plan over this job's tenants (ppo.gpu.phases): every GPU memory move of the run."""
        return Phases(self.colocation, {"actor": [self.actor_tenant], "critic": [self.critic_tenant] if self.critic else [],
                                        "engines": self.engine_tenants, "reward_models": self.reward_model_tenants})

    def close(self) -> None:
        try:
            self.sup.shutdown()
        finally:
            self.functions.close()
            self.run_dir_lock.release()


def uses_rule_reward(cfg: PPOConfig) -> bool:
    """Whether rule (or custom-function, or remote-service) scorers run: not with a reward model alone."""
    return cfg.reward.rm_type is not None or cfg.reward.custom_rm_path is not None


def reward_model_problem(cfg: PPOConfig) -> str | None:
    """Why --reward-model-path cannot score here (not a one-label sequence classifier with its
    score head and chat template; its weights and one micro-batch larger than its GPU), or None."""
    path = cfg.reward.reward_model_path
    if path is None:
        return None
    from roles.reward.model import budget_problem, checkpoint_problem

    if not Path(path).is_dir():
        return f"--reward-model-path {path}: no such directory (models are not downloaded)"
    problem = checkpoint_problem(path)
    capacity = FAKE_GPU_BYTES if cfg.placement.fake_gpus else gpu_capacity_bytes()
    if problem is None and capacity is not None:
        problem = budget_problem(path, dtype=compute_dtype(cfg), max_tokens=cfg.reward.reward_model_max_tokens_per_gpu,
                                 capacity=capacity)
    return problem


def reward_service_problem(cfg: PPOConfig) -> str | None:
    """Why the --rm-url service cannot be reached now (nothing listening), or None."""
    if cfg.reward.rm_url is None or cfg.reward.custom_rm_path is not None:
        return None
    from roles.reward.remote import service_problem

    return service_problem(cfg.reward.rm_url)


def rollout_backend_problem(cfg: PPOConfig) -> str | None:
    """Why the configured rollout backend cannot run on this machine, or None."""
    if cfg.engine.rollout_backend != "sglang":
        return None
    from roles.rollout.sglang_backend import sglang_problem

    problem = sglang_problem()
    if problem is None:
        import torch

        if not torch.cuda.is_available():
            problem = ("rollout backend 'sglang' needs CUDA GPUs and this machine has none; "
                       "use --rollout-backend torch (with --fake-gpus on a CPU machine)")
    return problem


def trainer_layout_problem(cfg: PPOConfig) -> str | None:
    """Why the megatron trainer would refuse this run's layout or recompute settings, or a
    model the layout cannot split (uneven pipeline stages, heads not divisible by TP: read
    from --hf-checkpoint's config.json when it is a local directory), or a checkpoint tensor
    the model has no place for (its safetensors headers) - checked here so the job stops
    before anything starts, not at the trainers' build - or None."""
    if cfg.training.train_backend != "megatron":
        return None
    from roles.trainer.megatron.config import PARALLEL_SIZES  # no megatron import
    from roles.trainer.megatron.shape import megatron_spec

    def layout_problem(e: ValueError) -> str:
        message = str(e).removeprefix("megatron trainer config: ")
        for name in (*PARALLEL_SIZES, "recompute_granularity", "recompute_method", "recompute_num_layers"):
            message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")  # speak in flags
        return f"--train-backend megatron cannot run this run's layout: {message}"

    try:
        trainer_config(cfg, "", critic=False, dtype="bfloat16")  # a MegatronTrainerConfig, checked
    except ValueError as e:
        return layout_problem(e)
    model_config = Path(cfg.checkpoint.hf_checkpoint) / "config.json"
    if not model_config.is_file():
        return None
    try:
        shape = megatron_spec(json.loads(model_config.read_text()))
    except ValueError as e:  # unreadable JSON or a model the mapper does not cover: not a layout problem
        return (f"--hf-checkpoint {cfg.checkpoint.hf_checkpoint}: its config.json is not a model the megatron "
                f"trainer builds: {e}")
    try:
        shape.check_parallel(tp_size=cfg.parallelism.tensor_model_parallel_size,
                             pp_size=cfg.parallelism.pipeline_model_parallel_size)
    except ValueError as e:
        return layout_problem(e)
    from roles.trainer.megatron.env import hf_tensor_names
    from roles.trainer.megatron.mapper import unplaced_problem

    try:
        problem = unplaced_problem(hf_tensor_names(cfg.checkpoint.hf_checkpoint), shape)
    except FileNotFoundError:  # no safetensors: the trainers' build says so
        return None
    return problem and f"--hf-checkpoint {cfg.checkpoint.hf_checkpoint}: {problem}"


def output_problem(flag: str, path: str | None) -> str | None:
    """Why the folder a run writes to (`--save`, `--critic-save`) cannot be written, or None;
    makes the folder when it is missing, as the first save would."""
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot be written ({e.strerror or e}); pass a folder this user can write"
    return None


def setup_problems(cfg: PPOConfig) -> list[str]:
    """Everything on this machine that would stop the run, each naming the flag and the fix,
    all at once: the trainers' layout, the rollout and training backends, the HF checkpoint and
    whether the prompt and response lengths fit its context, the checkpoint folders, the reward
    service, the reward model and the tools."""
    problems = [trainer_layout_problem(cfg), rollout_backend_problem(cfg), hf_checkpoint_problem(cfg),
                reward_service_problem(cfg), reward_model_problem(cfg), optimizer_offload_problem(cfg),
                context_problem(cfg, cfg.checkpoint.hf_checkpoint), output_problem("--save", cfg.checkpoint.save),
                output_problem("--critic-save", C.critic_save(cfg) if C.uses_critic(cfg) else None)]
    try:
        trainer_classes(cfg.training.train_backend)
    except BackendUnavailable as e:  # megatron without megatron-core or CUDA
        problems.insert(1, str(e))
    return [p for p in problems if p is not None]


def optimizer_offload_problem(cfg: PPOConfig) -> str | None:
    """--optimizer-cpu-offload is a memory plan for GPUs under 80 GB (docs/benchmarks.md): the
    megatron trainer's offload by tag does not know megatron-core's CPU optimizer yet."""
    if not cfg.optimizer.optimizer_cpu_offload:
        return None
    return ("--optimizer-cpu-offload: the memory plan counts it (see it with --dry-run), but the megatron "
            "trainer does not build megatron-core's CPU optimizer yet; run on a GPU the plan fits without it")


def hf_checkpoint_problem(cfg: PPOConfig) -> str | None:
    """Why --hf-checkpoint is not a local HF checkpoint directory (there is no model hub), or None."""
    path = cfg.checkpoint.hf_checkpoint
    if path.startswith(GENERATED_PREFIX):
        return None
    fix = ("Please pass a local HF checkpoint directory, or write an untrained one with "
           "`python -m ppo.make_model --arch qwen3-4b DIR`")
    if not Path(path).is_dir():
        return f"--hf-checkpoint {path}: no such directory (models are not downloaded). {fix}"
    if not (Path(path) / "config.json").is_file():
        return f"--hf-checkpoint {path}: not an HF checkpoint (no config.json). {fix}"
    return None


def model_context(hf_checkpoint: str) -> int | None:
    """The model's context in tokens (config.json's max_position_embeddings), or None when
    --hf-checkpoint is not (yet) a local HF checkpoint."""
    path = Path(hf_checkpoint) / "config.json"
    if hf_checkpoint.startswith(GENERATED_PREFIX) or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("max_position_embeddings")
    except (json.JSONDecodeError, OSError, AttributeError):
        return None  # hf_checkpoint_problem and the roles say what is wrong with it


def context_problem(cfg: PPOConfig, hf_checkpoint: str) -> str | None:
    """Why --rollout-max-prompt-len plus --rollout-max-response-len cannot fit the model's context, or None."""
    context, r = model_context(hf_checkpoint), cfg.rollout
    if context is None:
        return None
    response = r.rollout_max_response_len or 0
    if response >= context:
        return (f"--rollout-max-response-len {response} leaves no room for a prompt in the model's context of "
                f"{context} tokens (max_position_embeddings of {hf_checkpoint}); lower it")
    if r.rollout_max_prompt_len is not None and r.rollout_max_prompt_len + response > context:
        return (f"--rollout-max-prompt-len {r.rollout_max_prompt_len} + --rollout-max-response-len {response} = "
                f"{r.rollout_max_prompt_len + response} tokens, more than the model's context of {context} "
                f"(max_position_embeddings of {hf_checkpoint}); lower one so that they sum to at most {context}")
    return None


def start_job(cfg: PPOConfig, console: RunConsole | None = None,
              role_env: dict[str, dict[str, str]] | None = None) -> Job:
    """Build the run dir and start the roles; `console` (default: as cfg.logging asks) prints
    each start-up stage and its time; `role_env`: {"engine"|"trainer": environment} added to
    those roles' (their MPS share side by side: ppo.gpu.side_by_side)."""
    console = console or RunConsole.for_config(cfg)
    if problem := load_problem(cfg):  # first: the checks below make the --save folder
        raise JobSetupError(problem)
    problems = setup_problems(cfg)
    if problems:  # checked before anything is written or started
        raise JobSetupError(problems[0] if len(problems) == 1 else
                            f"{len(problems)} problems stop this run (nothing was started):\n"
                            + "\n".join(f"  - {p}" for p in problems))
    try:
        functions = load_user_functions(cfg)  # a bad path fails before anything is written
    except ValueError as e:
        raise JobSetupError(str(e)) from None
    try:
        actor_cls, critic_cls = trainer_classes(cfg.training.train_backend)
        try:
            lock = claim(cfg)  # before anything is written: a live run's folder is refused untouched
        except RunDirError as e:
            raise JobSetupError(str(e)) from None
        try:
            return _start(cfg, console, lock, actor_cls, critic_cls, functions, role_env or {})
        except BaseException:
            lock.release()
            raise
    except BaseException:
        functions.close()
        raise


def _start(cfg: PPOConfig, console: RunConsole, lock: RunDirLock, actor_cls, critic_cls,
           functions: UserFunctions, role_env: dict[str, dict[str, str]]) -> Job:
    run_dir = lock.run_dir
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    transformers.logging.set_verbosity_error()  # the driver loads tokenizers and builds tiny models too
    transformers.logging.disable_progress_bar()
    hf_checkpoint, prompt_data = resolve_paths(cfg, run_dir, begin=console.begin)
    # Bad prompt data and a damaged --load checkpoint fail here, before any role starts.
    console.begin("loading the tokenizer and data")
    tok = AutoTokenizer.from_pretrained(hf_checkpoint)
    try:
        if problem := context_problem(cfg, hf_checkpoint):  # a generated model's context is known only now
            raise ValueError(problem)
        check_generation(functions.generation, tok)
        stop_token_ids(cfg, tok)  # --rollout-stop's strings are one token each
        data = PromptDataset(prompt_data, input_key=cfg.rollout.input_key, label_key=cfg.rollout.label_key,
                             tokenizer=tok, apply_chat_template=cfg.rollout.apply_chat_template,
                             max_prompt_len=cfg.rollout.rollout_max_prompt_len,
                             context_len=model_context(hf_checkpoint),
                             response_len=cfg.rollout.rollout_max_response_len or 0, seed=cfg.rollout.rollout_seed,
                             shuffle=cfg.rollout.rollout_shuffle, skip_bad_samples=cfg.rollout.skip_bad_samples)
        if cfg.rollout.partial_rollout:  # the unfinished groups come first, and checkpoints keep them
            data = PartialSource(data)
        eval_sets = load_eval_sets(cfg, resolve_eval_paths(cfg, run_dir), tok)
        resume_from = None
        if cfg.checkpoint.load is not None:  # checked against its manifest (ppo.state.manifest)
            resume_from = locate(cfg.checkpoint.load, critic_load=C.critic_load(cfg), uses_critic=C.uses_critic(cfg),
                                 hf_checkpoint=hf_checkpoint)
    except (ValueError, FileNotFoundError) as e:  # BadSample and CheckpointError are ValueErrors
        raise JobSetupError(str(e)) from e
    if cfg.checkpoint.load is not None and resume_from is None:  # as miles and Megatron do
        logger.warning("--load %s holds no checkpoint yet: starting from --hf-checkpoint %s",
                       cfg.checkpoint.load, cfg.checkpoint.hf_checkpoint)
    plan = plan_placement(cfg)
    try:  # refused in one line before any role starts (ppo.gpu.memory_plan)
        memory = check_memory_plan(cfg, prompt_len=data.longest_prompt or DEFAULT_PROMPT_LEN)
    except ValueError as e:
        raise JobSetupError(str(e)) from None
    if memory is not None:
        (run_dir / "memory_plan.json").write_text(json.dumps(memory.to_dict(), indent=1))
    dtype = compute_dtype(cfg)
    try:  # across nodes: node 0's and the other nodes' supervisors as one (ppo.setup.nodes)
        sup = node0_supervisor(cfg, run_dir, os.environ)
    except (RendezvousFailed, NodeLost) as e:
        raise JobSetupError(str(e)) from None
    engine_env, trainer_env = ({**ROLE_ENV, **role_env.get(kind, {})} for kind in ("engine", "trainer"))
    try:
        if C.side_by_side(cfg):  # each shared GPU split into the engine's and the trainers' budgets
            capacity = FAKE_GPU_BYTES if cfg.placement.fake_gpus else gpu_capacity_bytes()
            if capacity is None:
                raise JobSetupError("side by side (--train-async --colocate) splits each GPU's memory, and "
                                    "nvidia-smi did not say how much GPU 0 has")
            for g, budgets in memory_budgets(cfg, plan, capacity).items():
                sup.leases.split(g, budgets)
        console.begin("spawning the roles")
        # Restart policy: engines and scorers hold no state a restart loses (the driver
        # re-syncs a restarted engine's weights and re-issues its work), so they restart
        # alone. A trainer holds the run's state: its death stops the job, to be resumed
        # from the last checkpoint with --load, unless --max-trainer-restarts lets the driver
        # bring it back from that checkpoint itself (ppo.recovery).
        scorers = [sup.spawn(f"reward-{i}", RewardScorer, scorer_config(cfg), restart="one_for_one", env=ROLE_ENV)
                   for i in range(plan.num_reward_workers if uses_rule_reward(cfg) else 0)]
        # one rank per GPU, built offloaded; stateless, so a dead rank restarts alone and scores again
        reward_models = [sup.spawn(f"reward-model-{i}", RewardModelScorer, reward_model_config(cfg, dtype=dtype),
                                   gpus=[g], restart="one_for_one", env=ROLE_ENV)
                         for i, g in enumerate(plan.reward_model_gpus)]
        t0 = time.monotonic()
        colocation = Colocation(sup.leases)
        # megatron builds its buffers on the GPU and offloads them at the end of its construction:
        # the trainers are built before the engines take their memory, at once where the memory
        # plan says both fit, else one after the other, each under its GPUs' leases (on one 80 GB
        # GPU, two Qwen3-4B trainers building at once do not fit)
        megatron = cfg.training.train_backend == "megatron"
        in_turn = memory is not None and memory.builds_in_turn  # only megatron plans have build phases
        groups = [("actor", actor_cls, False, plan.actor_gpus)]
        if C.uses_critic(cfg):
            groups.append(("critic", critic_cls, True, plan.critic_gpus))
        trainers = []
        for name, cls, is_critic, gpus in groups:
            # Trainers are rank groups, one process per GPU (roles.trainer.group); they die as one.
            config = trainer_config(cfg, hf_checkpoint, critic=is_critic, dtype=dtype)
            group = TrainerGroup.spawn(sup, name, cls, config, gpus=gpus, env=trainer_env)
            trainers.append(group)
            if in_turn:
                console.begin(f"building the {name} on its GPUs")
                colocation.build(trainer_tenant(group, tuple(gpus), frees=C.train_offload_tags(cfg)),
                                 lambda: sup.wait_ready([r.name for r in group.ranks]))
        actor, critic = trainers[0], (trainers[1] if len(trainers) > 1 else None)
        if megatron and not in_turn:
            console.begin("waiting for the trainers to build on their GPUs")
            sup.wait_ready()
        engines, engine_tenants = [], []
        for i, gpus in enumerate(plan.engines):
            name = f"rollout-{i}"
            for g in gpus:
                sup.leases.acquire(g, name)
            colocation.holding.add(name)
            config = engine_config(cfg, hf_checkpoint, engine_index=i, dtype=dtype)
            engines.append(sup.spawn(name, RolloutEngine, config, gpus=gpus, restart="one_for_one", env=engine_env))
            engine_tenants.append(engine_tenant(engines[-1], tuple(gpus), frees=C.rollout_offload_tags(cfg)))
        console.begin("waiting for the roles to load their weights")
        sup.wait_ready()
        console.roles_ready(ready_seconds(read_events(run_dir)))
        sup.publish("job_ready", seconds=round(time.monotonic() - t0, 3))
    except BaseException:
        sup.shutdown()
        raise
    job = Job(cfg=cfg, run_dir=run_dir, hf_checkpoint=hf_checkpoint, tok=tok, data=data, sup=sup, console=console,
               run_dir_lock=lock, resume_from=resume_from, functions=functions,
               placement=plan, engines=engines, engine_tenants=engine_tenants, actor=actor,
               actor_tenant=trainer_tenant(actor, tuple(plan.actor_gpus), frees=C.train_offload_tags(cfg)),
               critic=critic,
               critic_tenant=(trainer_tenant(critic, tuple(plan.critic_gpus), frees=C.train_offload_tags(cfg))
                              if critic else None),
               scorers=scorers, eval_sets=eval_sets, reward_models=reward_models,
               # on the engines' GPUs a rank offloads its weights when it gives its GPU up; on its own it stays
               reward_model_tenants=[trainer_tenant(rm, (g,), frees=() if cfg.reward.reward_model_num_gpus
                                                    else ("weights",))
                                     for rm, g in zip(reward_models, plan.reward_model_gpus)],
               colocation=colocation, memory_plan=memory)
    if isinstance(sup, ClusterSupervisor):
        try:
            job.weight_broadcast = open_weight_broadcast(job)
        except BaseException:
            sup.shutdown()
            raise
    return job
