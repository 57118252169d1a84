"""Trainer backends side by side on one GPU: megatron vs torch, Qwen3-4B shape, random init.

    python -m bench.trainer [--tokens 8192 16384] [--backends megatron torch megatron-critic]
                            [--recompute 8192=full,none 16384=full,block:12] [--budget-s 170] [--out DIR]
                            [--profile]

Per backend and packed micro-batch size (one micro-batch of that many tokens, 1024-token
samples: 512 prompt + 512 response): one PPO train step (forward, backward, optimizer) timed
after a warm-up step, in RUNS runs of 2 steps each, reported as the median run's model-FLOPs
utilisation against the bf16 matmul rate measured in the same run, with the runs' spread
(min-max); the log-prob forward; peak memory and its part above the trainer's resident state
(activations, logits chunks, optimizer temporaries).

megatron rows run each activation-recompute setting of --recompute for that token count
(`full` = full/uniform/1 layer, `block:N` = full recompute of the first N layers, `none`),
actor and critic alike. Run the backends as separate processes (one --backends each) to
start each from an empty device and host (the megatron trainers pin ~64 GB of host memory
for offload). The torch rows recompute every
layer (HF checkpointing through the trainer's own switch), as its peer row always has.
MFU counts model FLOPs only (no recompute).

The megatron actor also reports: offload/onload GB/s per tag against the pinned-copy rate
(the trainers are told that the run offloads every tag, as `--offload-train-level all` does,
so the params keep their construction-time host block), and the params onloaded alone right
after a full offload, the log-prob phase's move, copied by a copy engine and by SMs
(roles.device.host_to_device);
its Adam step alone (torch AdamW as megatron runs it without apex, foreach vs fused); the
weight sync from its tensors (megatron -> HF names -> flat 1 GiB buckets) without and with an
in-process receiver that copies every tensor by name, against a device memcpy of the same
bytes. Needs CUDA (megatron: megatron-core too). Writes bench_trainer.json/.md into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from unittest import mock

import torch

from bench.host_pinning import huge_page_share, numa_pages
from bench.peers import memcpy_gbps, pinned_copy_rates

QWEN3_4B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=2560,
                intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                max_position_embeddings=40960, hidden_act="silu", torch_dtype="bfloat16")
SAMPLE_LEN, PROMPT_LEN = 1024, 512
RECOMPUTE = {"full": ("full", "uniform", 1), "none": (None, None, None)}  # plus block:N
RUNS = 3  # timed runs per row: a row reports their median and spread
ALL_TAGS = ("params", "grads", "optimizer")


def recompute_setting(name: str) -> tuple[str | None, str | None, int | None]:
    """(granularity, method, num_layers) of a --recompute name."""
    if name.startswith("block:"):
        return "full", "block", int(name.split(":", 1)[1])
    return RECOMPUTE[name]


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


def hf_random_state(shape, device: str = "cuda") -> dict[str, torch.Tensor]:
    """HF-named Qwen3 weights, normal(0, 0.02) (norms 1), bf16: a checkpoint without a disk."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d

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
    h, d, f = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
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
    """The trainer config fields both backends' benchmarks share (each adds its own)."""
    return dict(hf_checkpoint=ckpt, seed=0, dtype="bfloat16", lr=1e-6, min_lr=0.0, lr_decay_style="constant",
                lr_warmup_iters=0, weight_decay=0.01, betas=(0.9, 0.98), clip_grad=1.0,
                global_batch_size=num_samples, max_tokens_per_gpu=tokens, eps_clip=0.2, value_clip=0.2,
                loss_agg_mode="token-mean", use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
                entropy_coef=0.0, temperature=1.0, keep_ref=False)


def time_steps(trainer, batch: dict, steps: int = 2, runs: int = RUNS) -> dict:
    """Seconds per train step after a warm-up step (the median of `runs` runs of `steps`
    steps, and each run's), the log-prob forward, peak GiB and the peak above what was
    allocated before (activations and temporaries)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated()
    trainer.train(batch)
    run_s = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train(batch)
        torch.cuda.synchronize()
        run_s.append((time.perf_counter() - start) / steps)
    start = time.perf_counter()
    if hasattr(trainer, "compute_log_probs"):
        trainer.compute_log_probs(batch)
    torch.cuda.synchronize()
    logprob_s = time.perf_counter() - start if hasattr(trainer, "compute_log_probs") else float("nan")
    peak = torch.cuda.max_memory_allocated()
    if PROFILE["dir"] and not PROFILE["done"]:
        profile_step(trainer, batch, PROFILE["dir"])
        PROFILE["done"] = True
    return {"step_s": statistics.median(run_s), "step_s_runs": run_s, "logprob_s": logprob_s,
            "peak_gib": peak / 2**30, "above_state_gib": (peak - resident) / 2**30}


PROFILE = {"dir": None, "done": False}  # --profile: the first row's step, once per process


def profile_step(trainer, batch: dict, out_dir: str) -> None:
    """One more train step under torch.profiler: the CUDA kernels by total time, to
    OUT/profile.txt (where the step's time goes beyond the model's matmuls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train(batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write(table)


def run_rows(trainer, label: str, shape, tokens_list, plan: dict | None, peak_tflops: float, results: list,
             deadline: float, *, critic: bool = False) -> None:
    """Rows of `trainer` for each token count and recompute setting in plan[tokens] (megatron;
    None for the torch backend), each appended to `results` and written out (`results.persist`)
    as soon as it is measured: a run stopped by its time limit keeps the rows it finished."""
    head = 6 * shape.vocab_size * shape.hidden_size * (SAMPLE_LEN - PROMPT_LEN)  # the LM head a critic lacks
    for tokens in tokens_list:
        n = tokens // SAMPLE_LEN
        trainer.config = trainer._core.config = dataclasses.replace(trainer.config, global_batch_size=n,
                                                                     max_tokens_per_gpu=tokens)
        batch = make_batch(n, shape.vocab_size)
        if critic:
            batch.update(old_values=torch.zeros_like(batch["advantages"]), returns=batch["advantages"])
        for setting in plan.get(tokens, [None]) if plan is not None else [None]:
            row = {"backend": label, "tokens": tokens, "recompute": setting or "every layer (HF)"}
            if time.monotonic() > deadline:
                results.append({**row, "skipped": "time budget"})
                results.persist()
                continue
            if setting is not None:
                # Bench only: megatron's TransformerBlock reads these at every forward, so one
                # model serves every setting (a rebuild per row would cost the device time).
                tc = trainer._core.tconfig
                tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers = recompute_setting(setting)
            try:
                row.update(time_steps(trainer, batch))
                flops = train_flops(shape, n) - (head * n if critic else 0)
                mfus = [flops / s / (peak_tflops * 1e12) for s in row["step_s_runs"]]
                row.update(mfu=statistics.median(mfus), mfu_min=min(mfus), mfu_max=max(mfus))
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e)[:100]}"
            results.append(row)
            results.persist()
            print(json.dumps(row, default=str), flush=True)
            gc.collect()
            torch.cuda.empty_cache()


def adam_step_ms(core) -> dict:
    """The optimizer step alone (megatron's prepare_grads + step_with_ready_grads, over the
    zeroed grad buffer), with torch AdamW's foreach form (what megatron falls back to without
    apex) and its fused kernel (which keeps its step counters on the device; the trainer's
    choice on a GPU)."""
    inner = [opt.optimizer for opt in getattr(core.optimizer, "chained_optimizers", [core.optimizer])]
    built = [[(g["foreach"], g["fused"]) for g in opt.param_groups] for opt in inner]
    out = {}
    for mode in ("foreach", "fused"):
        for opt in inner:
            for group in opt.param_groups:
                group["foreach"], group["fused"] = mode == "foreach", mode == "fused"
            for state in opt.state.values():
                if "step" in state:
                    state["step"] = state["step"].to("cuda" if mode == "fused" else "cpu")
        times = []
        try:  # the foreach form's temporaries (~15 GiB for Qwen3-4B) do not fit beside the state on 80 GB
            for _ in range(3):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start = time.perf_counter()
                core.optimizer.prepare_grads()
                core.optimizer.step_with_ready_grads()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        except torch.cuda.OutOfMemoryError as e:
            out[mode] = {"error": f"OOM: {str(e)[:100]}"}
            torch.cuda.empty_cache()
            continue
        out[mode] = {"ms": statistics.median(times) * 1e3,
                     "temp_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
    for opt, flags in zip(inner, built):  # back to what the trainer built
        for group, (foreach, fused) in zip(opt.param_groups, flags):
            group["foreach"], group["fused"] = foreach, fused
        for state in opt.state.values():
            if "step" in state:
                state["step"] = state["step"].to("cuda" if opt.param_groups[0]["fused"] else "cpu")
    return out


def sync_rows(actor, bucket_bytes: int = 1 << 30) -> dict:
    """Weight sync from the megatron actor: packing alone, packing + an in-process receiver
    (unpack, one batched copy into HF-shaped tensors), with one and two buffers; medians of 3."""
    from roles.weight_sync import push_weights, unpack_bucket

    receiver = {n: torch.empty_like(t) for n, t in actor.named_weights()}

    def receive(bucket):
        named = unpack_bucket(bucket)
        torch._foreach_copy_([receiver[n] for n, _ in named], [t for _, t in named])

    out = {}
    for label, send, buffers in (("pack only", lambda b: None, 1), ("pack + receiver", receive, 1),
                                 ("pack + receiver, 2 buffers", receive, 2)):
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            start = time.perf_counter()
            totals = push_weights(actor.named_weights(), send, bucket_bytes, num_buffers=buffers)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[label] = {"s": statistics.median(times[1:]), **totals}
    sent = dict(actor.named_weights())
    out["exact"] = all(torch.equal(receiver[n], sent[n]) for n in receiver)
    del receiver, sent
    return out


def bench_megatron(ckpt, shape, tokens_list, plan, peak_tflops, results, deadline) -> dict:
    from roles.trainer.megatron import MegatronActorTrainer, MegatronTrainerConfig

    cfg = MegatronTrainerConfig(**trainer_config(ckpt, max(tokens_list), max(tokens_list) // SAMPLE_LEN),
                                offload_tags=ALL_TAGS)
    actor = MegatronActorTrainer(cfg, hf_state=hf_random_state(shape))
    gc.collect()
    torch.cuda.empty_cache()
    onload = actor.onload(["params", "grads", "optimizer"])["moves"]
    run_rows(actor, "megatron", shape, tokens_list, plan, peak_tflops, results, deadline)
    adam = adam_step_ms(actor._core)
    actor.offload(["grads", "optimizer"])  # the PPO order: only the weights stay for the sync
    sync = sync_rows(actor)
    actor.onload(["grads", "optimizer"])
    # the first full offload reuses the params' construction-time host block (offload_tags) and the
    # optimizer's made at the offload above; a PPO iteration from the second on: the steady state
    offload_first = actor.offload(["params", "grads", "optimizer"])["moves"]
    actor.onload(["params", "grads", "optimizer"])
    offload = actor.offload(["params", "grads", "optimizer"])["moves"]
    onload2 = actor.onload(["params", "grads", "optimizer"])["moves"]
    actor.offload(["params", "grads", "optimizer"])
    # the params alone right after the offload returned 72 GB to the driver (the log-prob phase's
    # move), copied by a copy engine and by SMs
    params_alone = {}
    for how, through_sms in (("copy engine", False), ("SMs", True)):
        with mock.patch("roles.device.SM_COPIES", through_sms):
            actor.onload(["params", "grads", "optimizer"])
            actor.offload(["params", "grads", "optimizer"])
            params_alone[how] = actor.onload(["params"])["moves"]["params"]
            actor.offload(["params"])
    blocks = {tag: {"huge_pages": huge_page_share(block.views[0].data_ptr()),
                    "numa": numa_pages(block.views[0].data_ptr())}
              for tag, block in actor._core.offloader._host.items() if block.views}
    memory = {"offload_first": offload_first, "offload": offload, "onload_first": onload, "onload": onload2,
              "onload_params_alone": params_alone,
              "adam": adam, "sync": sync, "host_blocks": blocks,
              "bytes_in_use_after_offload": actor._core.memory.bytes_in_use()}
    del actor
    gc.collect()
    torch.cuda.empty_cache()
    return memory


def bench_megatron_critic(ckpt, shape, tokens_list, plan, peak_tflops, results, deadline) -> None:
    """The critic: same trunk, value head instead of the LM head (train FLOPs counted without it)."""
    from roles.trainer.megatron import MegatronCriticTrainer, MegatronTrainerConfig

    cfg = MegatronTrainerConfig(**trainer_config(ckpt, max(tokens_list), max(tokens_list) // SAMPLE_LEN),
                                offload_tags=ALL_TAGS)
    hf = {"backbone." + k.removeprefix("model."): v for k, v in hf_random_state(shape).items()}
    hf["value_head.weight"] = torch.zeros(1, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
    hf["value_head.bias"] = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    critic = MegatronCriticTrainer(cfg, hf_state=hf)
    del hf
    critic.onload(["params", "grads", "optimizer"])
    run_rows(critic, "megatron critic", shape, tokens_list, plan, peak_tflops, results, deadline, critic=True)
    critic.offload(["params", "grads", "optimizer"])
    del critic
    gc.collect()
    torch.cuda.empty_cache()


def bench_torch(ckpt_dir, shape, tokens_list, peak_tflops, results, deadline) -> None:
    from safetensors.torch import save_file

    from roles.trainer import TrainerConfig
    from roles.trainer.torch import ActorTrainer

    state = {k: v.cpu() for k, v in hf_random_state(shape).items()}
    save_file(state, os.path.join(ckpt_dir, "model.safetensors"))
    del state
    n_max = max(tokens_list) // SAMPLE_LEN
    # gradient_checkpointing: HF checkpointing of every layer (roles.trainer.torch.model.enable_checkpointing)
    config = TrainerConfig(**trainer_config(ckpt_dir, max(tokens_list), n_max), gradient_checkpointing=True)
    actor = ActorTrainer(config)
    actor.onload(["params", "optimizer"])
    run_rows(actor, "torch", shape, tokens_list, None, peak_tflops, results, deadline)
    del actor
    gc.collect()
    torch.cuda.empty_cache()


def markdown(report: dict) -> str:
    pinned, peak = report["pinned"], report["matmul_tflops"]
    lines = [f"bf16 matmul {peak:.0f} TFLOP/s; pinned copy d2h {pinned['d2h']:.1f} GB/s, h2d {pinned['h2d']:.1f} GB/s; "
             f"device memcpy {report['memcpy_gbps']:.0f} GB/s", "",
             f"| backend | tokens / micro-batch | recompute | train step s (median of {RUNS}) | MFU (min-max) "
             "| log-prob fwd s | peak GiB | above state GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "step_s" in r:
            lines.append(f"| {r['backend']} | {r['tokens']} | {r['recompute']} | {r['step_s']:.3f} | {r['mfu']:.1%} "
                         f"({r['mfu_min']:.1%}-{r['mfu_max']:.1%}) | {r['logprob_s']:.3f} | {r['peak_gib']:.1f} | "
                         f"{r['above_state_gib']:.1f} |")
        else:
            lines.append(f"| {r['backend']} | {r['tokens']} | {r['recompute']} | {r.get('error') or r.get('skipped')} "
                         "| | | | |")
    mem = report.get("megatron_memory")
    if mem:
        lines += ["", "| megatron tag (steady state: host blocks reused) | offload GB/s | vs d2h | onload GB/s "
                  "| vs h2d | of it allocating s | GB | first full offload GB/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for tag in ("params", "grads", "optimizer"):
            off, on, first = mem["offload"][tag], mem["onload"][tag], mem["offload_first"][tag]
            lines.append(f"| {tag} | {off['gb_per_s']:.1f} | {off['gb_per_s'] / pinned['d2h']:.2f}x | "
                         f"{on['gb_per_s']:.1f} | {on['gb_per_s'] / pinned['h2d']:.2f}x | {on['alloc_seconds']:.3f} | "
                         f"{off['bytes'] / 1e9:.1f} | {first['gb_per_s']:.1f} |")
        lines += [f"params onloaded alone right after a full offload, by {how}: {m['gb_per_s']:.1f} GB/s "
                  f"({m['gb_per_s'] / pinned['h2d']:.2f}x h2d)" for how, m in mem["onload_params_alone"].items()]
        lines += [f"host block of {tag}: {b['numa']} pages per NUMA node, "
                  + ("?" if b["huge_pages"] is None else f"{b['huge_pages']:.0%}") + " in huge pages"
                  for tag, b in mem.get("host_blocks", {}).items()]
        adam = mem["adam"]
        step = {mode: a.get("error") or f"{a['ms']:.1f} ms (+{a['temp_gib']:.1f} GiB temporaries)"
                for mode, a in adam.items()}
        lines += ["", f"Adam step alone: foreach {step['foreach']}, fused {step['fused']}",
                  f"after offload: {mem['bytes_in_use_after_offload'] / 2**20:.0f} MiB in use", "",
                  "| weight sync (megatron -> HF, 1 GiB buckets) | ms | GB | buckets | vs memcpy of the bytes |",
                  "|---|---|---|---|---|"]
        for label, r in mem["sync"].items():
            if label == "exact":
                continue
            memcpy_s = r["num_bytes"] / (report["memcpy_gbps"] * 1e9)
            lines.append(f"| {label} | {r['s'] * 1e3:.1f} | {r['num_bytes'] / 1e9:.2f} | {r['num_buckets']} | "
                         f"{r['s'] / memcpy_s:.1f}x |")
        lines.append(f"receiver bit-identical to the sender: {mem['sync']['exact']}")
    return "\n".join(lines)


class _Rows(list):
    """The report's rows; `persist()` writes the whole report (after every row)."""

    def __init__(self, persist):
        super().__init__()
        self.persist = persist


def parse_plan(items: list[str]) -> dict[int, list[str]]:
    """['8192=full,none', ...] -> {8192: ['full', 'none']}; names checked here, not mid-run."""
    plan = {}
    for item in items:
        tokens, _, names = item.partition("=")
        plan[int(tokens)] = names.split(",")
        for name in plan[int(tokens)]:
            recompute_setting(name)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--backends", nargs="+", default=["megatron", "torch", "megatron-critic"],
                        choices=["megatron", "megatron-critic", "torch"])
    parser.add_argument("--recompute", nargs="+", default=["8192=none,full", "16384=block:16,full"],
                        help="megatron settings per token count, tried in order (full, none, block:N)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="skip rows that would start after this long (building a 4B trainer takes ~40-60 s of it)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--profile", action="store_true",
                        help="profile one train step of the first row; kernels by time to OUT/profile.txt")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)  # before the ~40 s of building, not after
    PROFILE["dir"] = args.out if args.profile else None
    deadline = time.monotonic() + args.budget_s
    plan = parse_plan(args.recompute)
    from transformers import Qwen3Config

    from roles.trainer.megatron.shape import megatron_spec

    # the torch backend reads an 8 GB safetensors file: from memory when /dev/shm has room
    shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 20e9
    ckpt = tempfile.mkdtemp(prefix="qwen3_4b_shape_", dir="/dev/shm" if shm else None)
    Qwen3Config(**{k: v for k, v in QWEN3_4B.items() if k not in ("model_type",)}).save_pretrained(ckpt)
    shape = megatron_spec(QWEN3_4B)
    report = {"device": torch.cuda.get_device_name(), "matmul_tflops": matmul_tflops(), "pinned": pinned_copy_rates(),
              "memcpy_gbps": memcpy_gbps()}

    def persist() -> None:
        with open(os.path.join(args.out, "bench_trainer.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)

    report["rows"] = rows = _Rows(persist)
    for backend in args.backends:
        try:
            if backend == "megatron":
                report["megatron_memory"] = bench_megatron(ckpt, shape, args.tokens, plan, report["matmul_tflops"],
                                                           rows, deadline)
            elif backend == "megatron-critic":
                bench_megatron_critic(ckpt, shape, args.tokens, plan, report["matmul_tflops"], rows, deadline)
            else:
                bench_torch(ckpt, shape, args.tokens, report["matmul_tflops"], rows, deadline)
        except Exception as e:  # one backend failing must not lose the others' rows
            report.setdefault("errors", {})[backend] = f"{type(e).__name__}: {e}"[:500]
            print(f"{backend} failed: {e!r}", flush=True)
        finally:
            persist()
    text = markdown(report)
    with open(os.path.join(args.out, "bench_trainer.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
