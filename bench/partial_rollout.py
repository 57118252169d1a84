"""Rollout time per step with and without partial rollouts, on a long-tailed length distribution.

GPU, Qwen3-4B shape (random bf16 weights; one engine on GPU 0), one command:

    python -m bench.partial_rollout --gpu

(about 6-8 minutes on one H100: 3 steps per mode, the first of each a warm-up). CPU, the tiny
model (tests/test_bench_partial_rollout.py runs this):

    python -m bench.partial_rollout --steps 3 --rollout-batch-size 4 --over-sampling-batch-size 6

Both modes train the same number of samples per step (--rollout-batch-size groups of
--n-samples-per-prompt) from the same prompts, through the driver's own rollout functions:
plain (ppo.generate.rollout.generate_and_score: every sample to its end) and partial
(ppo.generate.partial: --over-sampling-batch-size groups started, stop at enough, the rest
continued next step). Printed side by side: mean seconds per step after the first, and
plain / partial as a ratio (the issue's goal: at least 1.3x on the GPU).

Lengths. An untrained (here: random) model does not stop on its own, so each response is told
where to end (ppo.generate.rollout.FORCED_LENGTHS_KEY: ignore_eos with max_new_tokens): a
length drawn per sample from a lognormal of mean --mean-len, cut at --max-len. The numbers are
the issue's (mean about 1.5k tokens, cut at 8k; its 4B run's longest/mean length ratio is
6.6x); sigma 0.9 is our choice, not a fitted value: lognormal is a common long-tailed shape for
response lengths, and at this sigma and cut the longest of 64 samples is a median 4.8x their mean
(3.8-6.0 over 200 draws; of 256 samples, 5.6x), near that 6.6 (each mode prints the ratio its
draws gave). The tiny shape scales the same shape down (mean 24, cut at 128).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import numpy as np

SIGMA = 0.9


class ListPrompts:
    """A prompt dataset's interface (ppo.prompts.dataset.PromptDataset.next_batch) over prepared records."""

    def __init__(self, records: list[dict]):
        self.records, self.position = records, 0

    def next_batch(self, n: int) -> list[dict]:
        if self.position + n > len(self.records):
            raise ValueError(f"the benchmark prepared {len(self.records)} prompts, and a step wants more; "
                             "raise --steps' prompt budget (records())")
        out = self.records[self.position:self.position + n]
        self.position += n
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}


def lengths(rng: np.random.Generator, n: int, mean: float, cut: int) -> list[int]:
    """n lognormal lengths of mean `mean` (before the cut), each in [1, cut]."""
    mu = math.log(mean) - SIGMA ** 2 / 2
    return [int(min(cut, max(1, round(x)))) for x in rng.lognormal(mu, SIGMA, n)]


def records(num: int, n: int, prompt_len: int, vocab: int, mean: float, cut: int, seed: int) -> list[dict]:
    from ppo.generate.rollout import FORCED_LENGTHS_KEY

    rng = np.random.default_rng(seed)
    return [{"prompt": f"bench {i}", "prompt_ids": rng.integers(10, vocab - 10, prompt_len).tolist(), "label": None,
             "metadata": {FORCED_LENGTHS_KEY: lengths(rng, n, mean, cut)}} for i in range(num)]


def run_mode(partial: bool, engines, prompts: list[dict], args, eos_id: int) -> dict:
    from ppo.generate.partial import partial_rollout
    from ppo.generate.partial_buffer import PartialSource
    from ppo.generate.rollout import SamplingParams, generate_and_score

    params = SamplingParams(n_samples_per_prompt=args.n_samples_per_prompt, max_new_tokens=args.max_len,
                            temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(eos_id,), seed=1)

    def no_recovery(role, dead):
        raise RuntimeError(f"{role.name} died during the benchmark")

    source = PartialSource(ListPrompts(prompts))
    seconds, tokens, ratios = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        if partial:
            samples, _ = partial_rollout(engines, [], source, params, step, num_groups=args.rollout_batch_size,
                                         over_sampling=args.over_sampling_batch_size, mask_offpolicy=False,
                                         decode=lambda ids: "", eos_id=eos_id, recover=no_recovery,
                                         lockstep=True)  # the built-in engine's
        else:
            samples = generate_and_score(engines, [], source.next_batch(args.rollout_batch_size), params, step,
                                         decode=lambda ids: "", eos_id=eos_id, recover=no_recovery)
        seconds.append(time.perf_counter() - t0)
        lens = [len(s["response_ids"]) for s in samples]
        tokens.append(sum(lens))
        ratios.append(max(lens) / (sum(lens) / len(lens)))
        print(f"  {'partial' if partial else 'plain'} step {step}: {seconds[-1]:.2f}s, {len(samples)} samples, "
              f"{tokens[-1]} tokens, longest/mean {ratios[-1]:.1f}", flush=True)
    measured = seconds[1:] or seconds
    return {"seconds": sum(measured) / len(measured), "samples": len(samples), "longest_over_mean": ratios[-1]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="Qwen3-4B shape on GPU 0 (else the tiny model on the CPU)")
    parser.add_argument("--steps", type=int, default=3, help="rollouts per mode; the first is a warm-up")
    parser.add_argument("--num-engines", type=int, default=1)
    parser.add_argument("--rollout-batch-size", type=int, default=None, help="groups trained per step")
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--over-sampling-batch-size", type=int, default=None, help="groups started per partial step")
    parser.add_argument("--mean-len", type=float, default=None)
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--mem-fraction", type=float, default=0.8, help="--gpu: the engine's share of the GPU")
    args = parser.parse_args(argv)
    gpu_defaults = dict(rollout_batch_size=8, over_sampling_batch_size=12, mean_len=1500.0, max_len=8192, prompt_len=256)
    cpu_defaults = dict(rollout_batch_size=4, over_sampling_batch_size=6, mean_len=24.0, max_len=128, prompt_len=8)
    for key, value in (gpu_defaults if args.gpu else cpu_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.over_sampling_batch_size < args.rollout_batch_size:
        raise ValueError(f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= "
                         f"--rollout-batch-size {args.rollout_batch_size}")

    from roles.rollout import EngineConfig, RolloutEngine
    from roles.model_spec import ModelSpec
    from runtime import Supervisor

    ckpt = tempfile.mkdtemp(prefix="bench-partial-")
    if args.gpu:
        from bench.rollout import qwen3_4b_config

        qwen3_4b_config().save_pretrained(ckpt)  # weights: load_format dummy (random, on the GPU)
        engine_args = dict(dtype="bfloat16", max_batch_size=128, mem_fraction=args.mem_fraction,
                           options={"load_format": "dummy"})
    else:
        from ppo.tiny_model import build_tiny_checkpoint

        build_tiny_checkpoint(ckpt, seed=0, max_position_embeddings=args.prompt_len + args.max_len + 8)
        engine_args = dict(dtype="float32", max_batch_size=64)
    spec = ModelSpec.from_checkpoint(ckpt)
    eos_id = spec.eos_ids[0]
    # both modes read the same prompts; the partial one reads more (the groups it over-samples)
    prompts = records(args.steps * args.over_sampling_batch_size, args.n_samples_per_prompt, args.prompt_len,
                      spec.vocab_size, args.mean_len, args.max_len, seed=0)
    sup = Supervisor(tempfile.mkdtemp(prefix="bench-partial-run-"))
    try:
        engines = [sup.spawn(f"rollout-{i}", RolloutEngine,
                             EngineConfig(hf_checkpoint=ckpt, engine_index=i, **engine_args),
                             gpus=(i,) if args.gpu else (), env={"OMP_NUM_THREADS": "1"})  # as ppo.setup.job starts engines
                   for i in range(args.num_engines)]
        sup.wait_ready(timeout=600)
        results = {mode: run_mode(mode == "partial", engines, prompts, args, eos_id) for mode in ("plain", "partial")}
    finally:
        sup.shutdown()
    plain, partial = results["plain"]["seconds"], results["partial"]["seconds"]
    results["ratio"] = plain / partial
    shape = "Qwen3-4B shape, GPU" if args.gpu else "tiny, CPU"
    print(f"\nrollout time per step ({shape}; {args.rollout_batch_size} x {args.n_samples_per_prompt} samples trained "
          f"per step; lengths lognormal mean {args.mean_len:g}, cut at {args.max_len})")
    print(f"{'plain':>10} {'partial':>10} {'plain/partial':>14}")
    print(f"{plain:>9.2f}s {partial:>9.2f}s {results['ratio']:>13.2f}x")
    return results


if __name__ == "__main__":
    main()
