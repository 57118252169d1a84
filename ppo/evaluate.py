"""`python -m ppo.evaluate --hf-checkpoint DIR --eval-prompt-data NAME PATH [...] [FLAGS]`:
evaluate one checkpoint alone, as a training run's eval would (ppo.generate.evaluation), and print a
table and the metrics as JSON.

Every launch.py flag applies (`--recipe` picks the base: tiny_ppo's fake GPUs and torch engine
on the CPU; on a GPU pass `--recipe qwen3_4b_ppo`, or `--rollout-backend torch|sglang` and the
placement flags). Only the rollout engines and reward scorers start: no trainer, no training
data. The run directory (--run-dir, default runs/eval-DATE-TIME) gets eval.json, the samples
(samples/eval_NAME_00000.jsonl) and the roles' logs. Exit 2: a bad flag, eval set or checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ppo.config.cli import build_parser, parse_cli
from ppo.config import ConfigError, PPOConfig

USAGE_FIX = "Please add --eval-prompt-data NAME PATH [NAME PATH ...]"


def parse(argv: list[str]) -> PPOConfig:
    """The config of `argv` (launch.py's flags); --eval-interval and --run-dir get defaults here:
    one eval, its own run directory."""
    argv = list(argv)
    parser = build_parser(prog="python -m ppo.evaluate")
    if {"-h", "--help"} & set(argv):  # before the check below, which would refuse a bare --help
        parser.description = "Evaluate --hf-checkpoint on the --eval-prompt-data sets (launch.py's flags)."
        parser.print_help()
        raise SystemExit(0)
    if not any(a.startswith("--eval-prompt-data") for a in argv):
        raise ConfigError([f"--eval-prompt-data (evaluation.eval_prompt_data) is required. {USAGE_FIX}"])
    if not any(a.startswith("--eval-interval") for a in argv):
        argv += ["--eval-interval", "1"]  # validation asks for one; a single eval has no interval
    if not any(a.startswith("--run-dir") for a in argv):
        argv += ["--run-dir", f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}"]
    cfg, _ = parse_cli(parser, argv)
    if cfg.checkpoint.hf_checkpoint.startswith("generated:"):
        raise ConfigError([f"--hf-checkpoint {cfg.checkpoint.hf_checkpoint}: ppo.evaluate judges a checkpoint "
                           "directory. Please pass --hf-checkpoint DIR"])
    return cfg


def evaluate_checkpoint(cfg: PPOConfig, log=lambda line: print(line, file=sys.stderr)) -> dict[str, float]:
    """Start the engines and scorers on cfg's placement, evaluate --hf-checkpoint on every set
    once (tag 0), stop them; the metrics (also RUN_DIR/eval.json, samples in RUN_DIR/samples).
    Raises JobSetupError, before anything starts, for a bad set or checkpoint."""
    from transformers import AutoTokenizer

    from ppo.generate.evaluation import load_eval_sets
    from ppo.generate.setup import load_generation
    from ppo.setup.generated import resolve_eval_paths
    from ppo.setup.job import JobSetupError, hf_checkpoint_problem, reward_service_problem, rollout_backend_problem

    problems = [p for p in (rollout_backend_problem(cfg), hf_checkpoint_problem(cfg), reward_service_problem(cfg)) if p]
    if problems:
        raise JobSetupError("; ".join(problems))
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = cfg.checkpoint.hf_checkpoint
    tok = AutoTokenizer.from_pretrained(ckpt)
    try:
        sets = load_eval_sets(cfg, resolve_eval_paths(cfg, run_dir), tok)
        generation = load_generation(cfg)  # judged with its tools, as in training
    except (ValueError, FileNotFoundError) as e:  # a bad line names FILE:LINE
        raise JobSetupError(str(e)) from e
    try:
        return _evaluate(cfg, run_dir, tok, sets, generation, log)
    finally:
        if generation is not None:
            generation.close()  # the tools' executor


def _evaluate(cfg: PPOConfig, run_dir: Path, tok, sets, generation, log) -> dict[str, float]:
    from ppo.generate.evaluation import evaluate
    from ppo.generate.setup import check_generation, rollout_function
    from ppo.gpu.sizing import compute_dtype
    from ppo.setup.job import FAKE_GPU_BYTES, ROLE_ENV, JobSetupError, model_context
    from ppo.setup.role_configs import engine_config, scorer_config
    from ppo.observe.logger import write_samples
    from ppo.gpu.placement import plan_placement
    from roles.reward.role import RewardScorer
    from roles.rollout.engine import RolloutEngine
    from runtime import Supervisor

    ckpt = cfg.checkpoint.hf_checkpoint
    try:
        check_generation(generation, tok)
    except ValueError as e:
        raise JobSetupError(str(e)) from e
    rollout = rollout_function(generation, cfg, tok, model_context(ckpt))
    plan = plan_placement(cfg)
    num_gpus = plan.num_gpus_per_node * plan.num_nodes
    sup = Supervisor(run_dir, gpus=range(num_gpus), fake_gpus=num_gpus if cfg.placement.fake_gpus else 0,
                     fake_gpu_bytes=FAKE_GPU_BYTES)
    try:
        log(f"starting {len(plan.engines)} {cfg.engine.rollout_backend} engine(s) on {ckpt}")
        scorers = [sup.spawn(f"reward-{i}", RewardScorer, scorer_config(cfg), restart="one_for_one", env=ROLE_ENV)
                   for i in range(plan.num_reward_workers)]
        engines = []
        for i, gpus in enumerate(plan.engines):
            for g in gpus:
                sup.leases.acquire(g, f"rollout-{i}")
            engines.append(sup.spawn(f"rollout-{i}", RolloutEngine,
                                     engine_config(cfg, ckpt, engine_index=i, dtype=compute_dtype(cfg)),
                                     gpus=gpus, restart="one_for_one", env=ROLE_ENV))
        sup.wait_ready()
        num_prompts = sum(len(s.prompts) for s in sets)
        log(f"evaluating {num_prompts} prompts x {cfg.evaluation.n_samples_per_eval_prompt} samples")
        t0 = time.monotonic()
        # a restarted engine loads the checkpoint again: nothing to sync
        metrics, samples = evaluate(engines, scorers, sets, 0, decode=tok.decode, eos_id=tok.eos_token_id,
                                    recover=lambda role, dead: sup.wait_restarted(role.name, dead), rollout=rollout)
        metrics["perf/eval_time"] = time.monotonic() - t0
    finally:
        sup.shutdown()
    for name, set_samples in samples.items():
        write_samples(run_dir / "samples" / f"eval_{name}_00000.jsonl", set_samples)
    (run_dir / "eval.json").write_text(json.dumps({"hf_checkpoint": ckpt, "metrics": metrics}, indent=2))
    return metrics


def table(metrics: dict[str, float], names: list[str]) -> str:
    """One row per set: mean reward, each pass@k, mean response length, truncated share."""
    ks = sorted({int(k.rsplit("@", 1)[1]) for k in metrics if "-pass@" in k})
    head = ["set", "reward", *(f"pass@{k}" for k in ks), "response_len", "truncated"]
    rows = [[name, metrics[f"eval/{name}"], *(metrics.get(f"eval/{name}-pass@{k}") for k in ks),
             metrics[f"eval/{name}/response_len/mean"], metrics[f"eval/{name}-truncated_ratio"]] for name in names]
    width = max(len(h) for h in head + names) + 2
    lines = ["".join(f"{h:>{width}}" if i else f"{h:<{width}}" for i, h in enumerate(head))]
    for row in rows:
        lines.append("".join(f"{row[0]:<{width}}" if i == 0 else f"{'-':>{width}}" if v is None else f"{v:>{width}.4f}"
                             for i, v in enumerate(row)))
    tokens, seconds = metrics["eval/response_tokens"], metrics["perf/eval_time"]
    lines.append(f"{tokens:.0f} response tokens in {seconds:.2f} s ({tokens / seconds:,.0f} tok/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ppo.generate.rollout import RequestsFailed
    from ppo.setup.job import JobSetupError

    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    try:
        metrics = evaluate_checkpoint(cfg)
    except JobSetupError as err:
        print(f"tandem: {err}", file=sys.stderr)
        return 2
    except RequestsFailed as err:  # an engine gave up on a request: its one line says which and why
        print(f"tandem: {err}", file=sys.stderr)
        return 1
    print(table(metrics, list(cfg.evaluation.eval_prompt_data[0::2])))
    print(json.dumps({"hf_checkpoint": cfg.checkpoint.hf_checkpoint, "metrics": metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
