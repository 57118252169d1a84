"""Checkpoints of a PPO run: written every --save-interval rollouts (and after the last one),
resumed with --load.

    SAVE/                          --save
      latest                       "rollout_00003": the newest complete checkpoint
      rollout_00003/
        model.safetensors          actor weights, HF names          } written by the actor
        optimizer.pt               actor optimizer state            } role (roles/trainer/
        trainer_state.json         optimizer step (= LR schedule), actor RNG  } checkpoint.py)
        driver_state.json          rollout step, weight version, data position, driver RNG,
                                   the run's counters, the run's config and the model's shape
        MANIFEST.json              every file's size and CRC-32 (ppo.state.manifest), checked by --load
    CRITIC/                        critic_save(cfg), by default SAVE + "_critic"
      latest, rollout_00003/       the critic's three trainer files (a resume takes the
                                   critic's folder of the actor's step; this `latest` is for tools)

The critic never shares the actor's folder, and a resumed critic reads critic_load(cfg),
never --load itself (miles' critic loads the actor's checkpoint when both are one folder).

Atomicity: the critic's folder is written first (the role renames it into place), then
the actor's is assembled in `SAVE/.rollout_00003.partial`, completed with the driver
state and renamed, and only then is `latest` replaced (temp file + rename). A crash at
any point leaves `latest` naming the previous complete checkpoint, which is all that a
resume reads. Against a power loss too: every file and directory of a checkpoint is
fsynced before its rename, the parent directory after it, and `latest` is written to a
temp file, fsynced, renamed and its directory fsynced, so the tracker never names a
checkpoint whose bytes are not on the disk (roles.trainer.checkpoint.replace_dir).

With --save-keep-last N only the newest N checkpoints stay (the actor's and the
critic's); older ones are removed after the tracker has moved, and the one the tracker
names is never removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from ppo import config as C
from ppo.config import PPOConfig
from ppo.config.serialize import to_dict
from ppo.prompts.dataset import PromptDataset
from ppo.gpu.handoffs import (OnGPUs, engines_share_trainer_gpus, lent_to_trainers, on_gpus, release_engines,
                          sync_engines)
from ppo.state.manifest import MANIFEST_FILE, damage, write_manifest
from ppo.observe.metrics_file import trim_metrics
from roles.trainer.checkpoint import TRAINER_FILES, replace_dir, sync_dir
from roles.trainer.rng import capture_rng, restore_rng
from runtime import RemoteError

logger = logging.getLogger(__name__)

TRACKER = "latest"
DRIVER_STATE_FILE = "driver_state.json"
FORMAT = 1
_ROLLOUT_DIR = re.compile(r"rollout_\d{5,}")
# HF config keys that fix the weights' names and shapes: a checkpoint of a model that
# differs in any of them cannot be resumed on this one.
MODEL_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "tie_word_embeddings")


class CheckpointError(ValueError):
    """A --load checkpoint that cannot be resumed; the message says what is wrong."""


class SaveFailed(RuntimeError):
    """A checkpoint or HF export could not be written (disk full, unwritable folder); the
    message is one line naming the folder, the cause and the last complete checkpoint."""


class Saver(Protocol):
    """A trainer role handle, or an in-process trainer."""

    def save(self, path: str) -> dict: ...


class RunJob(Protocol):
    """What saving and resuming use of a started job (ppo.setup.job.Job; this module is below it:
    ppo.setup.job checks --load with `locate` before any role starts)."""

    cfg: PPOConfig
    hf_checkpoint: str
    run_dir: Path
    actor: object  # a TrainerGroup
    critic: object | None
    engines: list
    actor_tenant: object  # ppo.gpu.colocation.Tenant: the handoffs of a save or a load (ppo.gpu.handoffs)
    critic_tenant: object | None
    engine_tenants: list
    colocation: object
    placement: object
    sup: object
    resume_from: Checkpoint | None  # what `locate` found under --load at start-up


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A complete checkpoint found under --load, checked against the run."""

    actor_dir: Path
    critic_dir: Path | None
    state: dict  # driver_state.json

    @property
    def step(self) -> int:
        return self.state["rollout_step"]


@dataclass(kw_only=True)
class RunCounters:
    """Counts over the whole run, saved in driver_state.json so that a resumed run goes on
    counting instead of starting again from 0. (Samples skipped in --prompt-data are counted
    when the file is read; a resume refuses other data, so that count is the same.)"""

    skipped_updates: float = 0  # optimizer steps skipped for a non-finite loss (--max-skipped-updates)
    engine_restarts: int = 0
    scorer_restarts: int = 0
    skipped_samples: int = 0
    trainer_restarts: int = 0  # recoveries of a dead trainer (--max-trainer-restarts, ppo.recovery)
    rewound_steps: int = 0  # rollout steps those recoveries ran again (finished after the checkpoint they reloaded)


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    step: int  # the first rollout step to run
    version: int  # the engines' weight version
    counters: RunCounters = field(default_factory=RunCounters)  # where the run's counts stand


def rollout_dir_name(step: int) -> str:
    return f"rollout_{step:05d}"


# ---- saving -------------------------------------------------------------------------------


def is_due(cfg: PPOConfig, step: int) -> bool:
    """Every --save-interval rollouts, and after the last rollout, when --save or --save-hf is set."""
    c = cfg.checkpoint
    if c.save is None and c.save_hf is None:
        return False
    return step == cfg.rollout.num_rollout - 1 or (c.save_interval is not None and (step + 1) % c.save_interval == 0)


def save_if_due(job: RunJob, step: int, *, data: PromptDataset, version: int,
                counters: RunCounters | None = None, force: bool = False) -> str | None:
    """The loop's save step: a run checkpoint under --save, an HF export under --save-hf;
    `force` (a signal asked for a save) writes the run checkpoint between intervals too.
    Returns the name of the run checkpoint written, if any."""
    cfg = job.cfg
    due = is_due(cfg, step)
    force = force and cfg.checkpoint.save is not None
    if not (due or force):
        return None
    name = None
    t0 = time.monotonic()
    actor = OnGPUs(job, job.actor, job.actor_tenant)
    with lent_to_trainers(job, version):
        if cfg.checkpoint.save is not None:
            state = driver_state(cfg, step, data=data, version=version, hf_checkpoint=job.hf_checkpoint,
                                 counters=counters)
            critic = OnGPUs(job, job.critic, job.critic_tenant) if job.critic is not None else None
            with save_errors(cfg.checkpoint.save, f"checkpoint {rollout_dir_name(step)}"):
                name = save_checkpoint(cfg.checkpoint.save, step, actor=actor, state=state, critic=critic,
                                       critic_dir=C.critic_save(cfg), keep_last=cfg.checkpoint.save_keep_last).name
        if due and cfg.checkpoint.save_hf is not None:
            path = cfg.checkpoint.save_hf.replace("{rollout_id}", str(step))
            with save_errors(path, "the HF export"):
                actor.save_hf(path)
    # the step's metrics are logged before its save (a checkpoint never claims an unlogged
    # step), so the window's time is the checkpoint event's, not the next step's offload_time
    job.sup.publish("checkpoint", step=step, save=cfg.checkpoint.save,
                    save_hf=cfg.checkpoint.save_hf if due else None, seconds=round(time.monotonic() - t0, 3),
                    handoff_seconds=round(job.colocation.take_time(), 3))
    return name


@contextlib.contextmanager
def save_errors(path: str, what: str):
    """Turn a failed write (the driver's OSError, or a trainer's RemoteError from torch or
    safetensors, which may not say why: torch's "unexpected pos") into SaveFailed, one line
    naming `path` and the cause, with the free space of its filesystem when it is full.
    The save itself has cleaned up: `latest` still names the last complete checkpoint."""
    try:
        yield
    except (OSError, RemoteError) as e:
        if isinstance(e, OSError):
            cause = f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
        else:
            cause = f"{e.exc_type}: {e.remote_message.strip().splitlines()[-1][:200] if e.remote_message else ''}"
        free = _free_bytes(path)
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or (free is not None and free < LOW_SPACE):
            free_text = "?" if free is None else free
            cause = f"no space left on device ({free_text} bytes free; the writer said: {cause})"
        tracker = Path(path) / TRACKER
        last = (f"; the last complete checkpoint is {tracker.read_text().strip()}: make room, then resume with "
                f"--load {path}" if tracker.is_file() else "")
        raise SaveFailed(f"{what} could not be written to {path}: {cause}{last}") from None


LOW_SPACE = 64 << 20  # less free than this after a failed write: the disk is full


def _free_bytes(path: str) -> int | None:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def driver_state(cfg: PPOConfig, step: int, *, data: PromptDataset, version: int, hf_checkpoint: str,
                 counters: RunCounters | None = None) -> dict:
    """What the driver process must restore besides the trainers: driver_state.json."""
    config = to_dict(cfg)
    # absolute: a resume compares it with its --run-dir (ppo.state.rundir), maybe from another cwd
    config["logging"]["run_dir"] = os.path.abspath(cfg.logging.run_dir)
    return {"format": FORMAT, "rollout_step": step, "weight_version": version, "data": data.state_dict(),
            "rng": capture_rng(), "counters": asdict(counters or RunCounters()),
            "model": model_signature(hf_checkpoint), "config": config}


def save_checkpoint(save_dir: str, step: int, *, actor: Saver, state: dict, critic: Saver | None = None,
                    critic_dir: str | None = None, keep_last: int | None = None) -> Path:
    """Write SAVE/rollout_NNNNN (actor + `state`) and the critic's, then point `latest` at it;
    with `keep_last`, remove all but the newest `keep_last` checkpoints afterwards."""
    name = rollout_dir_name(step)
    if critic is not None:
        assert critic_dir is not None, "a critic needs its own folder (critic_save(cfg))"
        critic.save(os.path.join(critic_dir, name))  # the role fsyncs it (replace_dir)
        write_manifest(os.path.join(critic_dir, name))  # before its tracker and the actor's move
        sync_dir(os.path.join(critic_dir, name))
        write_tracker(critic_dir, name)
    os.makedirs(save_dir, exist_ok=True)
    partial = os.path.join(save_dir, f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
    final = os.path.join(save_dir, name)
    try:
        actor.save(partial)
        with open(os.path.join(partial, DRIVER_STATE_FILE), "w") as f:
            json.dump(state, f)
        write_manifest(partial)  # every file's size and checksum: --load checks them (ppo.state.manifest)
        replace_dir(partial, final)  # fsyncs every file, the folder, then the rename
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    write_tracker(save_dir, name)
    if keep_last is not None:
        prune(save_dir, keep_last)
        if critic is not None:
            prune(critic_dir, keep_last)
    return Path(final)


def write_tracker(save_dir: str, name: str) -> None:
    """Point SAVE/latest at `name`, atomically (a reader sees the old name or the new one)
    and durably (after a power loss, the old name or the new one, never an empty file)."""
    tmp = os.path.join(save_dir, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    sync_dir(save_dir)


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Remove all but the newest `keep_last` rollout_NNNNN folders of `save_dir`, never the
    one that `latest` names; returns the names removed."""
    tracker = Path(save_dir) / TRACKER
    current = tracker.read_text().strip() if tracker.is_file() else None
    found = sorted((p.name for p in Path(save_dir).iterdir() if p.is_dir() and _ROLLOUT_DIR.fullmatch(p.name)),
                   key=lambda n: int(n.split("_")[1]))
    removed = [n for n in found[:-keep_last] if n != current]
    for n in removed:
        shutil.rmtree(os.path.join(save_dir, n))
    if removed:
        sync_dir(save_dir)
    return removed


# ---- resuming -----------------------------------------------------------------------------


def model_signature(hf_checkpoint: str) -> dict:
    """The MODEL_KEYS of the HF config: what the weights' names and shapes depend on."""
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
        hf_config = json.load(f)
    return {k: hf_config[k] for k in MODEL_KEYS if k in hf_config}


def saved_names(folder: str) -> list[str]:
    """What a run saved in `folder` that a later run's saves would replace or prune: its
    `latest` and rollout_NNNNN folders (none when the folder does not exist)."""
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n == TRACKER or _ROLLOUT_DIR.fullmatch(n))


def newest_state(load_dir: str) -> dict | None:
    """The driver_state.json of the newest checkpoint under `load_dir` that has a readable one
    (the one `latest` names first), unverified; None when there is none. For the checks made
    before anything is written (ppo.state.rundir); `locate` verifies the checkpoint later."""
    load = Path(load_dir)
    tracker = load / TRACKER
    named = tracker.read_bytes().decode("utf-8", "replace").strip() if tracker.is_file() else ""
    found = sorted((p.name for p in load.glob("rollout_*") if _ROLLOUT_DIR.fullmatch(p.name)),
                   key=lambda n: -int(n.split("_")[1])) if load.is_dir() else []
    for name in ([named] if named in found else []) + found:
        try:
            state = json.loads((load / name / DRIVER_STATE_FILE).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            return state
    return None


def locate(load_dir: str, *, critic_load: str | None, uses_critic: bool, hf_checkpoint: str) -> Checkpoint | None:
    """The checkpoint that LOAD/latest names, checked to be complete, intact (every file
    against its manifest) and of this model; when it is damaged (or the tracker is), the
    newest older one that is intact, with one warning naming the damaged file.

    None when `load_dir` holds no checkpoint at all (a fresh run with --load and --save on
    one folder, as in miles); CheckpointError when no checkpoint is intact, or for one of
    another model or format (an older one would not be either).
    """
    load = Path(load_dir)
    tracker = load / TRACKER
    found = sorted((p.name for p in load.glob("rollout_*") if _ROLLOUT_DIR.fullmatch(p.name)),
                   key=lambda n: -int(n.split("_")[1])) if load.is_dir() else []
    if not tracker.is_file():
        if not found:
            return None
        raise CheckpointError(
            f"--load {load_dir}: holds {sorted(found)} but no '{TRACKER}' file naming the complete one (a crash "
            f"during the first save leaves this). Write the name of the one to resume into {tracker} "
            f"(e.g. `echo {found[0]} > {tracker}`), or remove the folder to start over")
    name = tracker.read_bytes().decode("utf-8", "replace").strip()
    if not _ROLLOUT_DIR.fullmatch(name):
        first = f"{tracker} should name a rollout_NNNNN folder but holds {name[:40]!r}"
        candidates = found
    else:
        older = [n for n in found if int(n.split("_")[1]) < int(name.split("_")[1])]
        if (load / name).is_dir():
            first, candidates = None, [name, *older]
        else:
            first, candidates = f"{tracker} names {name}, but {load / name} does not exist", older
    for candidate in candidates:
        problem = _damage(load_dir, load / candidate, critic_load=critic_load, uses_critic=uses_critic,
                          hf_checkpoint=hf_checkpoint)
        if problem is None:
            ckpt = Checkpoint(actor_dir=load / candidate,
                              critic_dir=Path(critic_load) / candidate if uses_critic else None,
                              state=json.loads((load / candidate / DRIVER_STATE_FILE).read_text()))
            if first is not None:
                logger.warning("--load %s: %s; resuming from %s instead, the newest intact checkpoint",
                               load_dir, first, ckpt.actor_dir)
            return ckpt
        first = first or problem
    older = "" if len(candidates) < 2 else f" and no older checkpoint is intact ({', '.join(candidates[1:])})"
    raise CheckpointError(f"--load {load_dir}: {first}{older}; nothing to resume from")


def _damage(load_dir: str, actor_dir: Path, *, critic_load: str | None, uses_critic: bool,
            hf_checkpoint: str) -> str | None:
    """What makes one checkpoint unusable but may spare an older one (missing, truncated or
    corrupted files), or None; CheckpointError for what no older checkpoint mends (another
    model, another format, a renamed folder, no critic folder known)."""
    name = actor_dir.name
    missing = [f for f in (*TRAINER_FILES, DRIVER_STATE_FILE) if not (actor_dir / f).is_file()]
    if missing:
        hint = (" (this looks like a critic folder: pass the actor's --save folder to --load)"
                if missing == [DRIVER_STATE_FILE] else "")
        return f"checkpoint {actor_dir} is incomplete, missing {missing}{hint}"
    try:
        state = json.loads((actor_dir / DRIVER_STATE_FILE).read_bytes())
        if not isinstance(state, dict):
            raise ValueError("not an object")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"{actor_dir / DRIVER_STATE_FILE} is not valid JSON (truncated?): {e}"
    if state.get("format") != FORMAT:
        raise CheckpointError(f"--load {load_dir}: {actor_dir / DRIVER_STATE_FILE} has format "
                              f"{state.get('format')!r}; this version of Tandem reads format {FORMAT}")
    if rollout_dir_name(state["rollout_step"]) != name:
        raise CheckpointError(f"--load {load_dir}: {name} holds the driver state of rollout "
                              f"{state['rollout_step']}; the folder was renamed or mixed up")
    mine = model_signature(hf_checkpoint)
    diff = [f"{k}: checkpoint {state['model'].get(k)!r}, --hf-checkpoint {mine.get(k)!r}"
            for k in MODEL_KEYS if state["model"].get(k) != mine.get(k)]
    if diff:
        raise CheckpointError(f"--load {load_dir}: the checkpoint is of another model than --hf-checkpoint "
                              f"{hf_checkpoint}: {'; '.join(diff)}")
    if uses_critic:
        if critic_load is None:
            raise CheckpointError(f"--load {load_dir}: this run trains a critic but no critic checkpoint folder is "
                                  "known; pass --critic-load DIR")
        critic_dir = Path(critic_load) / name
        missing = [f for f in TRAINER_FILES if not (critic_dir / f).is_file()]
        if missing:
            return (f"the actor's checkpoint is {name} but the critic's {critic_dir} "
                    f"{'does not exist' if not critic_dir.is_dir() else f'is incomplete, missing {missing}'} "
                    "(the critic saves to --critic-save, by default --save + '_critic'; point --critic-load at it)")
    folders = [actor_dir, *([Path(critic_load) / name] if uses_critic else [])]
    for folder in folders:
        if not (folder / MANIFEST_FILE).exists():  # written by a Tandem before manifests: take it as it is
            logger.warning("--load %s: %s has no %s (an older checkpoint): its files are not verified",
                           load_dir, folder, MANIFEST_FILE)
        elif problem := damage(folder):
            return problem
    return None


def resume(job: RunJob, data: PromptDataset) -> ResumePoint:
    """Bring a fresh job to the state of the --load checkpoint: trainers, data position,
    driver RNG, and the engines (a weight sync, so they sample from the saved policy).

    A --load folder with no checkpoint yet starts the run from the beginning (said in one line
    by start_job); ppo.state.rundir let it only into a run dir that holds no earlier run.
    """
    cfg = job.cfg
    ckpt = job.resume_from  # found and verified by start_job, before any role started
    if ckpt is None:
        return ResumePoint(step=0, version=0)
    if ckpt.step + 1 >= cfg.rollout.num_rollout:
        raise CheckpointError(f"--load {cfg.checkpoint.load}: the checkpoint is after rollout {ckpt.step}, and "
                              f"--num-rollout {cfg.rollout.num_rollout} leaves nothing to run; raise --num-rollout")
    trim_metrics(job.run_dir, ckpt.step)
    point = restore(job, data, ckpt)
    job.sup.publish("resumed", path=str(ckpt.actor_dir), step=ckpt.step, weight_version=point.version,
                    counters=asdict(point.counters))
    return point


def restore(job: RunJob, data: PromptDataset, ckpt: Checkpoint) -> ResumePoint:
    """Bring the job's trainers (offloaded after), data position, driver RNG and engines
    (holding their GPUs) to the state that `ckpt` saved; returns where the run goes on."""
    data.load_state_dict(ckpt.state["data"])
    version = ckpt.state["weight_version"]
    # The trainers load with their state on the GPUs (ppo.gpu.handoffs), the actor keeping its
    # weights for the sync: the engines loaded --hf-checkpoint, the actor now holds the checkpoint's policy.
    if engines_share_trainer_gpus(job):
        release_engines(job, 0)
    if job.critic is not None:
        with on_gpus(job, job.critic_tenant):
            job.critic.load(str(ckpt.critic_dir))
    with on_gpus(job, job.actor_tenant, keep="params"):
        job.actor.load(str(ckpt.actor_dir))
    sync_engines(job, version)
    restore_rng(ckpt.state["rng"])
    counters = RunCounters(**ckpt.state.get("counters", {}))  # absent in checkpoints of older versions
    return ResumePoint(step=ckpt.step + 1, version=version, counters=counters)
