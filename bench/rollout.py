"""Rollout throughput of the built-in torch engine against HF generate, on one GPU.

    python -m bench.rollout [--peers all|short|none] [--json PATH]

Qwen3-4B shape (36 layers, hidden 2560, 32/8 heads of 128, intermediate 9728, vocab 151936,
tied embeddings), random init built in-process (nothing downloaded), bf16. Rows: batch 64
and 256, 256-token prompts, 256 and 2048 new tokens (min = max, eos ignored), greedy.
Columns: the engine; HF `generate` with a dynamic cache; HF `generate` with a static cache
(transformers compiles its forward then); the memory-bandwidth limit from this run's
measured device copy rate: one decode step must read every weight and the batch's KV cache
(at the mean length) once, so limit = batch / ((weight bytes + KV bytes) / copy rate).
Also: a mixed-length run (half the requests stop early) that shows continuous batching
keeping the slots busy, release/resume times and peak memory. Results go to --json after
every stage.

`--peers short` skips the HF peers' slow rows (2048 new tokens; batch 256 with a static
cache); `--peers none` runs the engine alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

BATCHES, PROMPT_LEN, NEW_TOKENS = (64, 256), 256, (256, 2048)


def qwen3_4b_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       eos_token_id=151645, pad_token_id=151643, bos_token_id=151643)


def copy_rate() -> float:
    """Device-to-device copy rate in bytes/s (read + write counted), best of a few 4 GiB copies."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / best


def prompts(batch: int, seed: int) -> torch.Tensor:  # [B, P]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 150000, (batch, PROMPT_LEN), generator=g)


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def engine_requests(ids: torch.Tensor, new: list[int] | int, temperature: float = 0.0) -> list[dict]:
    news = new if isinstance(new, list) else [new] * len(ids)
    return [{"id": i, "prompt_ids": row.tolist(),
             "sampling": {"max_new_tokens": n, "ignore_eos": True, "temperature": temperature, "seed": i}}
            for i, (row, n) in enumerate(zip(ids, news))]


def run_engine(eng, batch: int, new: int, repeat: int) -> dict:
    ids = prompts(batch, seed=batch + new)
    reqs = engine_requests(ids, new)
    for _ in range(repeat - 1):  # warm-up with the same shapes: graphs captured, kernels compiled
        eng.generate(reqs)
    torch.cuda.reset_peak_memory_stats()
    seconds, out = timed(lambda: eng.generate(reqs))
    assert all(len(r["token_ids"]) == new for r in out)
    return {"tok_s": batch * new / seconds, "seconds": seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "stats": eng._backend.scheduler.last_stats, "out": out, "ids": ids}


def run_hf(model, batch: int, new: int, static: bool, repeat: int) -> float:
    ids = prompts(batch, seed=batch + new).cuda()
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        for _ in range(repeat - 1):
            model.generate(**kwargs)
        seconds, out = timed(lambda: model.generate(**kwargs))
    assert out.shape[1] == PROMPT_LEN + new
    return batch * new / seconds


def hf_agreement(model, res: dict, n: int = 4) -> float:
    """Max |engine log-prob - HF teacher-forced log-prob| over n rows' first 32 tokens (bf16 sanity)."""
    worst = 0.0
    with torch.no_grad():
        for r in res["out"][:n]:
            toks = r["token_ids"][:32]
            seq = torch.tensor([res["ids"][r["id"]].tolist() + toks], device="cuda")
            lp = torch.log_softmax(model(seq).logits[0, PROMPT_LEN - 1:-1].float(), -1)
            ref = lp.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0].cpu()
            worst = max(worst, float((ref - torch.tensor(r["logprobs"][:32])).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", choices=("all", "short", "none"), default="all",
                        help="HF rows to run: all, short (skip the slow ones), none")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--mem-fraction", type=float, default=0.8, help="engine's share of the GPU")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of a batch-64 run")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from roles.rollout import RolloutEngine
    from roles.weight_sync import push_weights

    torch.manual_seed(0)
    rate = copy_rate()
    config = qwen3_4b_config()
    ckpt = tempfile.mkdtemp(prefix="qwen3-4b-shape-")
    config.save_pretrained(ckpt)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    t0 = time.perf_counter()
    eng = RolloutEngine(ckpt, dtype="bfloat16", max_batch_size=max(BATCHES), mem_fraction=args.mem_fraction,
                        options={"load_format": "dummy"})
    push_weights(model.state_dict().items(), eng.update_weights, buffer_bytes=1 << 30)
    eng.set_weight_version(1)
    print(f"engine built and loaded in {time.perf_counter() - t0:.1f}s; KV budget "
          f"{eng._backend.kv_cache_bytes / 2**30:.1f} GiB; copy rate {rate / 1e12:.2f} TB/s", flush=True)
    weight_bytes = eng._backend.weights_bytes
    per_token = eng._backend.kv_bytes_per_token

    rows, results = [], {"copy_rate_tb_s": rate / 1e12, "weight_gib": weight_bytes / 2**30}
    for new in NEW_TOKENS:
        for batch in BATCHES:
            res = run_engine(eng, batch, new, repeat=2 if new <= 256 else 1)
            kv = batch * (PROMPT_LEN + new / 2) * per_token
            limit = batch * rate / (weight_bytes + kv)
            row = {"batch": batch, "new": new, "engine": res["tok_s"], "limit": limit, "peak_gib": res["peak_gib"],
                   "hf_dynamic": None, "hf_static": None}
            if new == 256 and batch == 64:
                row["logprob_gap_vs_hf"] = hf_agreement(model, res)
            print(f"engine b{batch} n{new}: {res['tok_s']:.0f} tok/s ({res['seconds']:.2f}s), "
                  f"limit {limit:.0f}, peak {res['peak_gib']:.1f} GiB", flush=True)
            rows.append(row)
    if args.profile:
        profile(eng)
    results["rows"] = rows

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    # mixed lengths: twice as many requests as slots, half stop after 32 tokens, half run 256
    num = 2 * max(BATCHES)
    news = [32 if i % 2 else 256 for i in range(num)]
    seconds, _ = timed(lambda: eng.generate(engine_requests(prompts(num, seed=7), news)))
    stats = eng._backend.scheduler.last_stats
    results["mixed"] = {"num_requests": num, "tok_s": sum(news) / seconds,
                        "occupancy": stats["busy_steps"] / stats["slot_steps"],
                        "occupancy_while_queued": stats["busy_steps_queued"] / max(1, stats["slot_steps_queued"]),
                        "admitted_while_decoding": stats["admitted_while_decoding"], "num_slots": stats["num_slots"]}
    print(f"mixed: {results['mixed']}", flush=True)
    # the HF peers need the memory: the engine gives it back (timed: that is the colocation handoff)
    before = torch.cuda.memory_allocated()
    t_release, _ = timed(lambda: eng.release(["weights", "kv_cache", "cuda_graph"]))
    results["release_s"], results["released_gib"] = t_release, (before - torch.cuda.memory_allocated()) / 2**30
    print(f"release {t_release:.2f}s, freed {results['released_gib']:.1f} GiB", flush=True)
    save()
    # the goal's peer first (batch 64, static cache), then the rest, slowest last
    plan = [(r, True) for r in rows if args.peers == "all" or (args.peers == "short" and r["new"] <= 256
                                                                and r["batch"] <= 64)]
    plan += [(r, False) for r in rows if args.peers == "all" or (args.peers == "short" and r["new"] <= 256)]
    for row, static in plan:
        column = "hf_static" if static else "hf_dynamic"
        try:
            row[column] = run_hf(model, row["batch"], row["new"], static=static, repeat=2 if static else 1)
        except Exception as e:  # a peer that cannot run here is a result to report, not the end of the bench
            row[column + "_error"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.empty_cache()
        print(f"hf b{row['batch']} n{row['new']} {column}: {row.get(column) or row.get(column + '_error')}", flush=True)
        save()
    del model
    torch.cuda.empty_cache()
    results["resume_s"], _ = timed(lambda: eng.resume(["weights", "kv_cache", "cuda_graph"]))
    save()
    print_table(results)


def profile(eng) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    reqs = engine_requests(prompts(64, seed=1), 64)
    eng.generate(reqs)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate(reqs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)


def print_table(results: dict) -> None:
    def fmt(x):
        return "—" if x is None else f"{x:,.0f}"

    print(f"\ncopy rate {results['copy_rate_tb_s']:.2f} TB/s; weights {results['weight_gib']:.2f} GiB")
    print("| batch | new tokens | engine tok/s | HF dynamic | HF static+compile | bandwidth limit | "
          "engine / limit | engine / HF static | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        vs_static = f"{r['engine'] / r['hf_static']:.1f}x" if r["hf_static"] else "—"
        print(f"| {r['batch']} | {r['new']} | {fmt(r['engine'])} | {fmt(r['hf_dynamic'])} | {fmt(r['hf_static'])} | "
              f"{fmt(r['limit'])} | {r['engine'] / r['limit']:.0%} | {vs_static} | {r['peak_gib']:.1f} |")
    gap = [r["logprob_gap_vs_hf"] for r in results["rows"] if "logprob_gap_vs_hf" in r]
    m = results["mixed"]
    print(f"\nrelease (weights, kv_cache, cuda_graph): {results['release_s']:.2f}s, freed "
          f"{results['released_gib']:.1f} GiB; resume: {results['resume_s']:.2f}s "
          "(weights back from pinned memory, KV cache zeroed; graphs are captured again at first use)")
    print(f"mixed lengths ({m['num_requests']} requests, half 32 / half 256 new tokens, {m['num_slots']} slots): "
          f"{m['tok_s']:,.0f} tok/s, slot occupancy {m['occupancy_while_queued']:.0%} while requests wait, "
          f"{m['occupancy']:.0%} over the whole call (tail included), "
          f"{m['admitted_while_decoding']} requests admitted into freed slots mid-call")
    if gap:
        print(f"engine vs HF teacher-forced log-probs (bf16, b64): max |diff| {gap[0]:.3f}")


if __name__ == "__main__":
    main()
