"""Tandem entry point: python launch.py [--recipe NAME] [--flag value ...] [--dry-run].

With no arguments it runs the `tiny_ppo` recipe on fake GPUs; `--list-recipes` lists the
others. Configuration errors are all printed at once and exit with status 2.
"""

from __future__ import annotations

import json
import os
import sys

from ppo.config.cli import build_parser, parse_cli
from ppo.config.cluster import from_environment, job_secret
from ppo.config import ConfigError, PPOConfig, derived_values, to_dict
from ppo.gpu.placement import format_nodes, format_placement, plan_placement


def main(argv: list[str] | None = None) -> None:
    parser = build_parser(prog="launch.py")
    parser.add_argument("--dry-run", action="store_true", default=False,
                        help="print the resolved config, the GPU placement and the memory plan; start nothing")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, metavar="N",
                        help="with --dry-run: plan memory for GPUs of N GiB instead of this machine's "
                             "(nvidia-smi; fake GPUs: their 80 GiB), which a run plans for, refusing a plan "
                             "that does not fit before any role starts")
    try:
        scheduler = from_environment(os.environ)  # Slurm's or torchrun's node rank and master
    except ValueError as err:  # they contradict each other: one line
        print(f"tandem: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        cfg, args = parse_cli(parser, argv, scheduler=scheduler)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    if cfg.checkpoint.ref_load is not None:  # a miles command line carries it; say what happens instead
        print(f"tandem: note: --ref-load {cfg.checkpoint.ref_load} is not read: the trainers start from "
              f"--hf-checkpoint {cfg.checkpoint.hf_checkpoint}, the reference policy is the actor's "
              "initial weights", file=sys.stderr)
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        print(f"--gpu-memory-gb {args.gpu_memory_gb}: must be > 0 (GiB of one GPU)", file=sys.stderr)
        sys.exit(2)
    if args.dry_run:
        print(json.dumps({"config": to_dict(cfg), "derived": derived_values(cfg)}, indent=2))
        plan = plan_placement(cfg)
        print(format_placement(plan))
        if cfg.cluster.nnodes is not None or plan.num_nodes > 1:
            c = cfg.cluster
            print(format_nodes(plan, master=c.master_addr and f"{c.master_addr}:{c.master_port}",
                               this_node=c.node_rank))
        from ppo.gpu.dry_run import memory_plan_text  # torch for a megatron recipe only

        text, refused = memory_plan_text(cfg, gpu_memory_gb=args.gpu_memory_gb)
        print(text)
        if refused:
            print(f"tandem: {refused}", file=sys.stderr)
            sys.exit(2)
        return
    if (cfg.cluster.nnodes or 1) > 1:
        check_job_secret(cfg)
        if cfg.cluster.node_rank != 0:
            serve_node(cfg)  # node 0 runs the driver below, which places roles on every node
    try:
        from ppo.state.checkpoint import SaveFailed
        from ppo.setup.job import JobSetupError  # imported late: they pull in torch and the roles
        from ppo.loop import TrainerDied, train
        from ppo.generate.rollout import RequestsFailed
        from ppo.state.signals import RunStopped, resume_command
        from runtime import SupervisionFailed
    except KeyboardInterrupt:  # Ctrl-C before the run installed its handlers
        print("tandem: interrupted before the run started; nothing was written", file=sys.stderr)
        sys.exit(130)

    from ppo.gpu.side_by_side import choose

    sm = choose(cfg)  # side by side: MPS splits the SMs, or the synchronous plan runs, said in one line
    if sm is not None and sm.fallback:
        print(f"tandem: {sm.fallback}", file=sys.stderr)
    try:
        train(cfg if sm is None else sm.cfg, sm=sm)
    except JobSetupError as err:  # bad --prompt-data, --load, --run-dir or --save: nothing was started
        print(f"tandem: {err}", file=sys.stderr)
        sys.exit(2)
    except (TrainerDied, SupervisionFailed, SaveFailed, RequestsFailed) as err:  # says what failed and what to do
        print(f"tandem: {err}", file=sys.stderr)
        sys.exit(1)
    except OSError as err:  # the driver's own files (metrics, events, config.json): disk full, removed folder
        where = f" ({err.filename})" if err.filename else ""
        print(f"tandem: the run stopped: {err.strerror or err}{where}", file=sys.stderr)
        sys.exit(1)
    except RunStopped as stop:  # Ctrl-C, SIGTERM, SIGUSR1: the roles are stopped (ppo.state.signals)
        resume = f"; resume with: {resume_command(sys.argv[1:] if argv is None else argv, cfg)}" \
            if stop.checkpoint else ""
        print(f"tandem: {stop}{resume}", file=sys.stderr)
        sys.exit(stop.exit_code)
    finally:
        if sm is not None:  # stops the MPS daemon if we started it
            sm.close()


def check_job_secret(cfg: PPOConfig) -> None:
    """A job across nodes: exit 2, one line, before anything starts, without its secret."""
    try:
        job_secret(os.environ, cfg.cluster.nnodes)
    except ValueError as err:
        print(f"tandem: node {cfg.cluster.node_rank}: {err}", file=sys.stderr)
        sys.exit(2)


def serve_node(cfg: PPOConfig) -> None:
    """A node > 0: its node agent serves node 0's driver until the job ends; exits."""
    from ppo.setup.nodes import run_node
    from runtime.rendezvous import RendezvousFailed

    try:
        reason = run_node(cfg, os.environ)
    except (RendezvousFailed, ValueError) as err:  # node 0 unreachable, a node missing, a bad address
        print(f"tandem: node {cfg.cluster.node_rank}: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"tandem: node {cfg.cluster.node_rank}: {reason}", file=sys.stderr)
    sys.exit(0 if reason.startswith("node 0 stopped the job") else 1)


if __name__ == "__main__":
    main()
