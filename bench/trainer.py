"""Trainer backends side by side on one GPU: megatron vs torch, Qwen3-4B shape, random init.

    python -m bench.trainer [--tokens 8192 16384] [--backends megatron torch] [--out DIR]

Per backend and packed micro-batch size (one micro-batch of that many tokens, 1024-token
samples: 512 prompt + 512 response): one PPO train step (forward, backward, optimizer) timed
after a warm-up step, reported as model-FLOPs utilisation against the bf16 matmul rate
measured in the same run; the log-prob forward; peak memory. The megatron actor also
reports offload/onload GB/s per tag against the pinned-copy rate measured in the same run,
and the weight-sync packing time (megatron -> HF names -> flat buckets, no receiver).
Both backends recompute activations (megatron: full/uniform/1 layer; torch: HF gradient
checkpointing); MFU counts model FLOPs only (no recompute). Needs CUDA (megatron: megatron-core too). Writes bench_trainer.json/.md into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

QWEN3_4B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2560,
                intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                max_position_embeddings=40960, hidden_act="silu", torch_dtype="bfloat16")
SAMPLE_LEN, PROMPT_LEN = 1024, 512


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def pinned_copy_gbps(nbytes: int = 2 << 30) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = nbytes / (time.perf_counter() - start) / 1e9
    return out


def hf_random_state(shape, device: str = "cuda") -> dict[str, torch.Tensor]:
    """HF-named Qwen3 weights, normal(0, 0.02) (norms 1), bf16: a checkpoint without a disk."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    q, kv = shape.num_heads * d, shape.num_query_groups * d

    def w(*s):
        return torch.empty(*s, device=device, dtype=torch.bfloat16).normal_(0.0, 0.02)

    def ones(n):
        return torch.ones(n, device=device, dtype=torch.bfloat16)

    state = {"model.embed_tokens.weight": w(shape.vocab_size, h), "model.norm.weight": ones(h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                      p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                      p + "self_attn.q_norm.weight": ones(d), p + "self_attn.k_norm.weight": ones(d),
                      p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                      p + "mlp.down_proj.weight": w(h, f), p + "input_layernorm.weight": ones(h),
                      p + "post_attention_layernorm.weight": ones(h)})
    return state


def train_flops(shape, num_samples: int) -> float:
    """Model FLOPs of one train step (forward + backward = 3x forward) over num_samples
    SAMPLE_LEN-token samples: the decoder's matmuls on every token, causal attention, and the
    LM head on response tokens only (the trainers skip it elsewhere)."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    q, kv = shape.num_heads * d, shape.num_query_groups * d
    per_token = 2 * shape.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * f)
    tokens = num_samples * SAMPLE_LEN
    attention = 2 * shape.num_layers * q * SAMPLE_LEN**2 * num_samples  # QK^T and PV, causal half
    head = 2 * shape.vocab_size * h * num_samples * (SAMPLE_LEN - PROMPT_LEN)
    return 3 * (per_token * tokens + attention + head)


def make_batch(num_samples: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    r = SAMPLE_LEN - PROMPT_LEN
    batch = {"input_ids": torch.randint(1, vocab, (num_samples, SAMPLE_LEN), generator=g),
             "prompt_lens": torch.full((num_samples,), PROMPT_LEN), "response_lens": torch.full((num_samples,), r),
             "loss_mask": torch.ones(num_samples, r), "advantages": torch.randn(num_samples, r, generator=g)}
    batch["old_log_probs"] = torch.full((num_samples, r), -11.0)
    return batch


def trainer_config(ckpt: str, tokens: int, num_samples: int) -> dict:
    return dict(hf_checkpoint=ckpt, seed=0, dtype="bfloat16", lr=1e-6, min_lr=0.0, lr_decay_style="constant",
                lr_warmup_iters=0, weight_decay=0.01, betas=(0.9, 0.98), clip_grad=1.0,
                global_batch_size=num_samples, max_tokens_per_gpu=tokens, eps_clip=0.2, value_clip=0.2,
                loss_agg_mode="token-mean", use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
                entropy_coef=0.0, temperature=1.0, keep_ref=False)


def time_steps(trainer, batch: dict, steps: int = 2) -> tuple[float, float, float]:
    """(seconds per train step after a warm-up step, log-prob forward seconds, peak GiB)."""
    torch.cuda.reset_peak_memory_stats()
    trainer.train(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train(batch)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    trainer.compute_log_probs(batch)
    torch.cuda.synchronize()
    return step_s, time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def bench_megatron(ckpt, shape, tokens_list, peak_tflops, results, deadline):
    from roles.trainer.megatron import MegatronActorTrainer
    from roles.weight_sync import push_weights

    cfg = trainer_config(ckpt, max(tokens_list), max(tokens_list) // SAMPLE_LEN)
    # Without transformer-engine's fused kernels a 4B model's activations at 8k tokens do not fit
    # beside its 72 GB of weights, grads and Adam state: recompute every layer (miles' flags).
    cfg.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    actor = MegatronActorTrainer(cfg, hf_state=hf_random_state(shape))
    gc.collect()
    torch.cuda.empty_cache()
    onload = actor.onload(["params", "grads", "optimizer"])["moves"]
    for tokens in tokens_list:
        if time.monotonic() > deadline:
            results.append({"backend": "megatron", "tokens": tokens, "skipped": "time budget"})
            continue
        n = tokens // SAMPLE_LEN
        actor.config = actor._core.config = _with(actor.config, global_batch_size=n, max_tokens_per_gpu=tokens)
        row = {"backend": "megatron", "tokens": tokens}
        try:
            step_s, fwd_s, peak = time_steps(actor, make_batch(n, shape.vocab_size))
            row.update(step_s=step_s, logprob_s=fwd_s, peak_gib=peak,
                       mfu=train_flops(shape, n) / step_s / (peak_tflops * 1e12))
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e)[:120]}"
        results.append(row)
        torch.cuda.empty_cache()
    actor.offload(["grads", "optimizer"])  # the PPO order: only the weights stay for the sync
    start = time.perf_counter()
    totals = push_weights(actor.named_weights(), lambda bucket: torch.cuda.synchronize(), 1 << 30)
    sync_s = time.perf_counter() - start
    actor.onload(["grads", "optimizer"])
    offload = actor.offload(["params", "grads", "optimizer"])["moves"]
    onload2 = actor.onload(["params", "grads", "optimizer"])["moves"]
    actor.offload(["params", "grads", "optimizer"])
    memory = {"offload": offload, "onload_first": onload, "onload": onload2,
              "bytes_in_use_after_offload": actor._core.memory.bytes_in_use(),
              "sync_pack_s": sync_s, "sync_bytes": totals["num_bytes"], "sync_buckets": totals["num_buckets"]}
    del actor
    gc.collect()
    torch.cuda.empty_cache()
    return memory


def bench_megatron_critic(ckpt, shape, tokens_list, peak_tflops, results, deadline):
    """The critic: same trunk, value head instead of the LM head (train FLOPs counted without it)."""
    from roles.trainer.megatron import MegatronCriticTrainer

    cfg = trainer_config(ckpt, max(tokens_list), max(tokens_list) // SAMPLE_LEN)
    cfg.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hf = {"backbone." + k.removeprefix("model."): v for k, v in hf_random_state(shape).items()}
    hf["value_head.weight"] = torch.zeros(1, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    hf["value_head.bias"] = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    critic = MegatronCriticTrainer(cfg, hf_state=hf)
    del hf
    critic.onload(["params", "grads", "optimizer"])
    head = 6 * shape.vocab_size * shape.hidden_size * (SAMPLE_LEN - PROMPT_LEN)
    for tokens in tokens_list:
        if time.monotonic() > deadline:
            results.append({"backend": "megatron critic", "tokens": tokens, "skipped": "time budget"})
            continue
        n = tokens // SAMPLE_LEN
        critic.config = critic._core.config = _with(critic.config, global_batch_size=n, max_tokens_per_gpu=tokens)
        batch = make_batch(n, shape.vocab_size)
        batch.update(old_values=torch.zeros_like(batch["advantages"]), returns=batch["advantages"])
        torch.cuda.reset_peak_memory_stats()
        critic.train(batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        critic.train(batch)
        torch.cuda.synchronize()
        step_s = time.perf_counter() - start
        results.append({"backend": "megatron critic", "tokens": tokens, "step_s": step_s, "logprob_s": float("nan"),
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                        "mfu": (train_flops(shape, n) - head * n) / step_s / (peak_tflops * 1e12)})
    critic.offload(["params", "grads", "optimizer"])
    del critic
    gc.collect()
    torch.cuda.empty_cache()


def bench_torch(ckpt_dir, shape, tokens_list, peak_tflops, results, deadline):
    from safetensors.torch import save_file

    from roles.trainer import ActorTrainer, TrainerConfig

    state = {k: v.cpu() for k, v in hf_random_state(shape).items()}
    save_file(state, os.path.join(ckpt_dir, "model.safetensors"))
    del state
    n_max = max(tokens_list) // SAMPLE_LEN
    actor = ActorTrainer(TrainerConfig.from_dict(trainer_config(ckpt_dir, max(tokens_list), n_max)))
    # Activation checkpointing, as the megatron side recomputes every layer. Enabled here rather
    # than with gradient_checkpointing=True, whose call (activation_checkpointing_enable) is not
    # a method of transformers 5 models.
    actor.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    actor.onload(["params", "optimizer"])
    for tokens in tokens_list:
        if time.monotonic() > deadline:
            results.append({"backend": "torch", "tokens": tokens, "skipped": "time budget"})
            continue
        n = tokens // SAMPLE_LEN
        actor.config = actor._core.config = _with(actor.config, global_batch_size=n, max_tokens_per_gpu=tokens)
        row = {"backend": "torch", "tokens": tokens}
        try:
            step_s, fwd_s, peak = time_steps(actor, make_batch(n, shape.vocab_size))
            row.update(step_s=step_s, logprob_s=fwd_s, peak_gib=peak,
                       mfu=train_flops(shape, n) / step_s / (peak_tflops * 1e12))
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e)[:120]}"
        results.append(row)
        torch.cuda.empty_cache()
    actor.offload(["params", "optimizer"])
    del actor
    gc.collect()
    torch.cuda.empty_cache()


def _with(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def markdown(report: dict) -> str:
    lines = [f"bf16 matmul {report['matmul_tflops']:.0f} TFLOP/s; pinned copy d2h {report['pinned']['d2h']:.1f} GB/s, "
             f"h2d {report['pinned']['h2d']:.1f} GB/s", "",
             "| backend | tokens / micro-batch | train step s | MFU | log-prob fwd s | peak GiB |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "step_s" in r:
            lines.append(f"| {r['backend']} | {r['tokens']} | {r['step_s']:.3f} | {r['mfu']:.1%} | "
                         f"{r['logprob_s']:.3f} | {r['peak_gib']:.1f} |")
        else:
            lines.append(f"| {r['backend']} | {r['tokens']} | {r.get('error') or r.get('skipped')} | | | |")
    mem = report.get("megatron_memory")
    if mem:
        lines += ["", "| megatron tag | offload GB/s | vs d2h | onload GB/s | vs h2d | GB |", "|---|---|---|---|---|---|"]
        for tag in ("params", "grads", "optimizer"):
            off, on = mem["offload"][tag], mem["onload"][tag]
            lines.append(f"| {tag} | {off['gb_per_s']:.1f} | {off['gb_per_s'] / report['pinned']['d2h']:.2f}x | "
                         f"{on['gb_per_s']:.1f} | {on['gb_per_s'] / report['pinned']['h2d']:.2f}x | "
                         f"{off['bytes'] / 1e9:.1f} |")
        lines += ["", f"after offload: {mem['bytes_in_use_after_offload'] / 2**20:.0f} MiB in use; weight-sync packing "
                  f"(megatron -> HF -> 1 GiB buckets, no receiver): {mem['sync_pack_s'] * 1e3:.0f} ms for "
                  f"{mem['sync_bytes'] / 1e9:.2f} GB in {mem['sync_buckets']} buckets"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--backends", nargs="+", default=["megatron", "torch"],
                        choices=["megatron", "megatron-critic", "torch"])
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip what would start after this long")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    from transformers import Qwen3Config

    from roles.trainer.megatron.shape import shape_from_hf

    ckpt = tempfile.mkdtemp(prefix="qwen3_4b_shape_")
    Qwen3Config(**{k: v for k, v in QWEN3_4B.items() if k not in ("model_type",)}).save_pretrained(ckpt)
    shape = shape_from_hf(QWEN3_4B)
    report = {"device": torch.cuda.get_device_name(), "matmul_tflops": matmul_tflops(), "pinned": pinned_copy_gbps(),
              "rows": []}
    for backend in args.backends:
        try:
            if backend == "megatron":
                report["megatron_memory"] = bench_megatron(ckpt, shape, args.tokens, report["matmul_tflops"],
                                                           report["rows"], deadline)
            elif backend == "megatron-critic":
                bench_megatron_critic(ckpt, shape, args.tokens, report["matmul_tflops"], report["rows"], deadline)
            else:
                bench_torch(ckpt, shape, args.tokens, report["matmul_tflops"], report["rows"], deadline)
        finally:
            with open(os.path.join(args.out, "bench_trainer.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)
    text = markdown(report)
    with open(os.path.join(args.out, "bench_trainer.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
