"""Multi-turn rollout throughput: trajectories of several turns with KV reuse across turns, against
the same trajectories recomputing their whole context every turn, and against single-turn
generation of as many tokens.

GPU, Qwen3-4B shape (random bf16 weights, load_format dummy; one engine on GPU 0), one command:

    python -m bench.multi_turn --gpu

(about 3-4 minutes on one H100: two engine starts, a warm-up on each, four timed rollouts). CPU,
the tiny model (tests/test_bench_multi_turn.py runs this):

    python -m bench.multi_turn

Workload (GPU; CPU in brackets): 64 [4] trajectories of 4 [3] model turns of 512 [8] tokens each,
a tool turn of 100 [4] random token ids after each model turn but the last, prompts of 256 [8]
tokens. A random model does not stop on its own, so each turn is told where to end (ignore_eos
with max_new_tokens, as bench.partial_rollout forces lengths). Every way runs through the
driver's own functions:

- multi-turn: ppo.generate.trajectories with a generate function of those turns; the turns are
  streamed into the engine's running batch (RolloutEngine.stream) and each continues its slot's
  K/V (kv_reuse on): a turn prefills only its tool turn.
- recompute: the same trajectories on an engine with kv_reuse off: each turn prefills its whole
  context, as an engine without KV reuse across turns does.
- single-turn: ppo.generate.rollout.generate_and_score (the default path, one blocking generate
  call), one response per trajectory as long as its model turns together.

The turns go to the engine as a run sends them (ppo.generate.setup.lockstep): in lockstep on the
CPU (ppo.generate.engines: a call waits for every running trajectory), free-running on the GPU (a
call goes as soon as the last returns, with whatever was queued); `--lockstep`/`--no-lockstep`
choose either way, and `--tool-seconds S` makes each tool turn
take a wall-clock time drawn in [0, S] (seeded by the sample), where lockstep's cost shows: the
engine does not decode while a tool runs.

tokens/s counts model tokens only (the loss-masked ones), over the rollout's wall clock. The
engine's slots are fixed (the torch option slot_len) at the trajectory's whole length, so every
way runs with the same geometry and the turns find their slots. Goals (issue 42): multi-turn at
least 0.85x single-turn and at least 1.5x recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time



def make_generate(turns: int, turn_len: int, tool_len: int, vocab: int, tool_seconds: float = 0.0):
    """The benchmark's generate function: `turns` model turns of `turn_len` tokens, a tool turn of
    `tool_len` random ids (drawn from the sample's index) after each but the last, which takes a
    time drawn in [0, tool_seconds]."""

    async def generate(args, sample, sampling_params):
        rng, clock = random.Random(sample.index), random.Random(-1 - sample.index)
        for turn in range(turns):
            told = dict(sampling_params, max_new_tokens=len(sample.trajectory.response_ids) + turn_len, ignore_eos=True)
            if await args.generate(sample, told) is None:
                break
            if turn < turns - 1:
                if tool_seconds:
                    await asyncio.sleep(clock.uniform(0, tool_seconds))
                sample.trajectory.add_env_turn([rng.randrange(10, vocab - 10) for _ in range(tool_len)])
        return sample

    return generate


def prompts(num: int, prompt_len: int, vocab: int, response_len: int) -> list[dict]:
    from ppo.generate.rollout import FORCED_LENGTHS_KEY

    rng = random.Random(0)
    return [{"prompt": f"bench {i}", "prompt_ids": [rng.randrange(10, vocab - 10) for _ in range(prompt_len)],
             "label": None, "metadata": {FORCED_LENGTHS_KEY: [response_len]}} for i in range(num)]


def timed(name: str, rollout) -> dict:
    t0 = time.perf_counter()
    samples = rollout()
    seconds = time.perf_counter() - t0
    # a single-turn sample has no loss mask: all its tokens are the model's
    tokens = sum(sum(s["loss_mask"]) if "loss_mask" in s else len(s["response_ids"]) for s in samples)
    print(f"  {name}: {seconds:.2f}s, {len(samples)} samples, {tokens} model tokens, {tokens / seconds:,.0f} tok/s",
          flush=True)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "samples": len(samples)}


def run_engine(args, ckpt: str, engine_args: dict, kv_reuse: bool, eos_id: int, vocab: int) -> dict:
    """One engine (kv_reuse on or off): a warm-up (short turns: the same slots, so the graphs and
    compiled kernels it builds serve the timed runs), then the multi-turn rollout, then (kv reuse
    on) the single-turn one."""
    from ppo.generate.custom import GenerateArgs
    from ppo.generate.rollout import SamplingParams, generate_and_score
    from ppo.generate.trajectories import generate_trajectories_and_score
    from roles.rollout import EngineConfig, RolloutEngine
    from runtime import Supervisor

    model_tokens = args.turns * args.turn_len
    max_context = args.prompt_len + model_tokens + (args.turns - 1) * args.tool_len
    params = SamplingParams(n_samples_per_prompt=1, max_new_tokens=max_context - args.prompt_len, temperature=1.0,
                            top_p=1.0, top_k=-1, stop_token_ids=(eos_id,), seed=1)
    records = prompts(args.trajectories, args.prompt_len, vocab, model_tokens)

    def no_recovery(role, dead):
        raise RuntimeError(f"{role.name} died during the benchmark")

    def multi_turn(engines, turn_len: int, step: int):
        return generate_trajectories_and_score(
            engines, [], records, params, step, decode=lambda ids: "", eos_id=eos_id, recover=no_recovery,
            generate_fn=make_generate(args.turns, turn_len, args.tool_len, vocab, args.tool_seconds),
            make_args=lambda client: GenerateArgs(None, None, max_context, client), lockstep=args.lockstep)

    options = dict(engine_args.pop("options"), kv_reuse=kv_reuse, slot_len=max_context + 64)
    sup = Supervisor(tempfile.mkdtemp(prefix="bench-multi-turn-run-"))
    try:
        engines = [sup.spawn("rollout-0", RolloutEngine,
                             EngineConfig(hf_checkpoint=ckpt, options=options, **engine_args),
                             gpus=(0,) if args.gpu else (), env={"OMP_NUM_THREADS": "1"})]
        sup.wait_ready(timeout=600)
        timed("warm-up", lambda: multi_turn(engines, max(1, args.turn_len // 16), step=0))
        name = "multi-turn" if kv_reuse else "recompute"
        results = {name: timed(name, lambda: multi_turn(engines, args.turn_len, step=1))}
        if kv_reuse:
            results["single-turn"] = timed("single-turn", lambda: generate_and_score(
                engines, [], records, params, 2, decode=lambda ids: "", eos_id=eos_id, recover=no_recovery))
    finally:
        sup.shutdown()
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="Qwen3-4B shape on GPU 0 (else the tiny model on the CPU)")
    parser.add_argument("--trajectories", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None, help="model turns a trajectory")
    parser.add_argument("--turn-len", type=int, default=None, help="tokens a model turn")
    parser.add_argument("--tool-len", type=int, default=None, help="tokens a tool turn")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--mem-fraction", type=float, default=0.8, help="--gpu: the engine's share of the GPU")
    parser.add_argument("--tool-seconds", type=float, default=0.0, help="a tool turn takes up to this long")
    parser.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=None,
                        help="turns in lockstep (default: as a run sends them, on the CPU only)")
    args = parser.parse_args(argv)
    gpu_defaults = dict(trajectories=64, turns=4, turn_len=512, tool_len=100, prompt_len=256)
    cpu_defaults = dict(trajectories=4, turns=3, turn_len=8, tool_len=4, prompt_len=8)
    for key, value in (gpu_defaults if args.gpu else cpu_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.lockstep is None:
        args.lockstep = not args.gpu
    for key in ("trajectories", "turns", "turn_len", "prompt_len"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.tool_len < 0:
        raise ValueError(f"--tool-len={args.tool_len} must be >= 0")
    if not 0 <= args.tool_seconds <= 60:
        raise ValueError(f"--tool-seconds={args.tool_seconds} must be in [0, 60]")

    from roles.model_spec import ModelSpec

    ckpt = tempfile.mkdtemp(prefix="bench-multi-turn-")
    if args.gpu:
        from bench.rollout import qwen3_4b_config

        qwen3_4b_config().save_pretrained(ckpt)  # weights: load_format dummy (random, on the GPU)
        engine_args = dict(dtype="bfloat16", max_batch_size=max(64, args.trajectories), mem_fraction=args.mem_fraction,
                           options={"load_format": "dummy"})
    else:
        from ppo.tiny_model import build_tiny_checkpoint

        length = args.prompt_len + args.turns * (args.turn_len + args.tool_len)
        build_tiny_checkpoint(ckpt, seed=0, max_position_embeddings=length + 128)
        engine_args = dict(dtype="float32", max_batch_size=max(8, args.trajectories), options={})
    spec = ModelSpec.from_checkpoint(ckpt)
    eos_id = spec.eos_ids[0]
    results = {}
    for kv_reuse in (True, False):
        results.update(run_engine(args, ckpt, dict(engine_args), kv_reuse, eos_id, spec.vocab_size))
    multi, single, recompute = (results[k]["tokens_per_s"] for k in ("multi-turn", "single-turn", "recompute"))
    results["vs_single_turn"], results["vs_recompute"] = multi / single, multi / recompute
    shape = "Qwen3-4B shape, GPU" if args.gpu else "tiny, CPU"
    tools = f"tool turns of {args.tool_len}" + (f" taking up to {args.tool_seconds} s" if args.tool_seconds else "")
    print(f"\nmulti-turn rollout ({shape}; {args.trajectories} trajectories x {args.turns} turns of {args.turn_len} "
          f"tokens, {tools}, prompts of {args.prompt_len}; {'lockstep' if args.lockstep else 'free-running'})")
    print(f"{'multi-turn':>12} {'recompute':>12} {'single-turn':>12} {'vs single':>10} {'vs recompute':>13}")
    print(f"{multi:>8,.0f} t/s {recompute:>8,.0f} t/s {single:>8,.0f} t/s {results['vs_single_turn']:>9.2f}x "
          f"{results['vs_recompute']:>12.2f}x")
    print("goals: >= 0.85x single-turn, >= 1.5x recompute")
    return results


if __name__ == "__main__":
    main()
