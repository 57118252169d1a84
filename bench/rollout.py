"""Rollout throughput of the built-in torch engine against HF generate, on one GPU.

    python -m bench.rollout [--peers all|short|none] [--budget-s S] [--json PATH] [--profile] [--batch-invariant]
    python -m bench.rollout --table PATH     # print the table of a saved (maybe cut-short) run

Qwen3-4B shape (36 layers, hidden 2560, 32/8 heads of 128, intermediate 9728, vocab 151936,
tied embeddings), random init built in-process (nothing downloaded), bf16. Rows: batch 64
and 256, 256-token prompts, 256 and 2048 new tokens (min = max, eos ignored), greedy.

Columns: the engine (whole `generate` calls, prefill included); HF `generate` with a
dynamic cache; HF `generate` with a static cache (transformers compiles its forward then);
the memory-bandwidth limit from this run's measured device copy rate: one decode step must
read every weight and the batch's KV cache (at the mean length) once, so
limit = batch / ((weight bytes + KV bytes) / copy rate).

How the peers are timed, so that one device call holds the whole table: the static-cache
row at batch 64 / 256 new tokens (the goal's peer) is whole `generate` calls, as the
engine's, after a warm-up call that compiles. Every other HF cell is a decode-rate window:
prompts as long as the row's mean context (256 + new/2 tokens), WINDOW steps generated, the
time of each step taken by a logits processor, and batch / (mean step time after the first
WARM steps). That leaves out the peer's prefill and, for the static cache, reads a cache
sized to the window rather than to the whole row: both flatter the peer, so the engine's
ratios against these cells are lower bounds.

Also: a mixed-length run (half the requests stop early) whose slot occupancy is split into
"while requests wait" (continuous batching must keep it near 100%) and "drain tail";
release and resume times (the first release pins the host buffer; the second is what each
PPO iteration pays) and peak memory. Results go to --json after every stage; peers run in
priority order until --budget-s, and a cell skipped for time says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback

import torch

from bench.peers import memcpy_gbps

BATCHES, PROMPT_LEN, NEW_TOKENS = (64, 256), 256, (256, 2048)
GOAL = (64, 256)  # (batch, new tokens) of the goal
STOP_AT = 32  # the mixed run's early stops: at about this many tokens
WINDOW, WARM = 40, 8  # decode-rate windows: steps generated, first steps not timed


def qwen3_4b_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       eos_token_id=151645, pad_token_id=151643, bos_token_id=151643)


def copy_rate() -> float:
    """Device-to-device copy rate in bytes/s (read + write counted), best of a few 4 GiB copies."""
    return 2 * memcpy_gbps(4 << 30, repeats=4) * 1e9


def prompts(batch: int, seed: int, length: int = PROMPT_LEN) -> torch.Tensor:  # [B, P]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 150000, (batch, length), generator=g)


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def engine_requests(ids: torch.Tensor, new: list[int] | int) -> list[dict]:
    news = new if isinstance(new, list) else [new] * len(ids)
    return [{"id": i, "prompt_ids": row.tolist(),
             "sampling": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0, "seed": i}}
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
            "out": out, "ids": ids}


def hf_kwargs(ids: torch.Tensor, new: int, static: bool) -> dict:
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    return kwargs


def run_hf_whole(model, batch: int, new: int, static: bool) -> float:
    """tokens/s of whole generate calls (a first call warms up: compiles the static-cache forward)."""
    kwargs = hf_kwargs(prompts(batch, seed=batch + new).cuda(), new, static)
    with torch.no_grad():
        model.generate(**kwargs)
        seconds, out = timed(lambda: model.generate(**kwargs))
    assert out.shape[1] == PROMPT_LEN + new
    return batch * new / seconds


def run_hf_window(model, batch: int, new: int, static: bool) -> float:
    """tokens/s of HF's decode at the row's mean context (see the module docstring)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    clock = StepClock()
    ids = prompts(batch, seed=batch + new, length=PROMPT_LEN + new // 2).cuda()
    with torch.no_grad():
        model.generate(**hf_kwargs(ids, WINDOW, static), logits_processor=LogitsProcessorList([clock]))
    steps = clock.times[WARM:]
    return batch * (len(steps) - 1) / (steps[-1] - steps[0])


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


def peer_plan(peers: str) -> list[tuple[int, int, str, bool]]:
    """(batch, new tokens, column, whole-call timing) in priority order: the goal's peer first."""
    if peers == "none":
        return []
    plan = [(*GOAL, "hf_static", True)]
    plan += [(b, n, "hf_dynamic", False) for n in NEW_TOKENS for b in BATCHES]
    if peers == "all":
        plan += [(b, n, "hf_static", False) for n in NEW_TOKENS for b in BATCHES if (b, n) != GOAL]
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", choices=("all", "short", "none"), default="all",
                        help="HF cells to run: all; short (no static-cache cell but the goal's); none")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="no new peer cell starts after this many seconds of the run")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--table", help="print the table of this saved JSON and exit")
    parser.add_argument("--mem-fraction", type=float, default=0.75,
                        help="engine's share of the GPU (0.75 leaves the goal's peer room beside it)")
    parser.add_argument("--no-triton", dest="triton", action="store_false",
                        help="decode by torch ops and SDPA instead of the engine's Triton kernels")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's batch_invariant option (backend.py), to measure what it costs")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of a batch-64 run")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print_table(json.load(f))
        return
    from transformers import AutoModelForCausalLM

    from roles.rollout import EngineConfig, RolloutEngine
    from roles.weight_sync import push_weights

    began = time.perf_counter()
    torch.manual_seed(0)
    rate = copy_rate()
    config = qwen3_4b_config()
    ckpt = tempfile.mkdtemp(prefix="qwen3-4b-shape-")
    config.save_pretrained(ckpt)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    t0 = time.perf_counter()
    results = {"copy_rate_tb_s": rate / 1e12, "rows": []}

    def build(triton: bool):
        eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16", max_batch_size=max(BATCHES),
                                         mem_fraction=args.mem_fraction,
                            options={"load_format": "dummy", "triton": triton,
                                     "batch_invariant": args.batch_invariant}))
        push_weights(model.state_dict().items(), eng.update_weights, buffer_bytes=1 << 30)
        eng.set_weight_version(1)
        return eng

    eng = build(triton=args.triton)
    if args.triton:  # a kernel that fails on this machine is reported, and the torch path measured instead
        try:
            eng.generate(engine_requests(prompts(8, seed=0), 4))
        except Exception:
            results["triton_error"] = traceback.format_exc()[-3000:]
            print(results["triton_error"], flush=True)
            eng.release(["weights", "kv_cache", "cuda_graph"])
            del eng
            gc.collect()
            eng = build(triton=False)
    backend = eng._backend
    results["triton"] = backend.scheduler.fused
    results["batch_invariant"] = backend.scheduler.batch_invariant
    print(f"engine built and loaded in {time.perf_counter() - t0:.1f}s; KV budget "
          f"{backend.kv_cache_bytes / 2**30:.1f} GiB; copy rate {rate / 1e12:.2f} TB/s", flush=True)
    weight_bytes = backend.weights_bytes
    per_token = backend.kv_bytes_per_token
    results["weight_gib"] = weight_bytes / 2**30
    plan = peer_plan(args.peers)

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)

    # the engine compiles its few ops in-process (decoder.py); the static-cache peer compiles a
    # whole model, which takes minutes on one thread: give it the machine's cores
    from torch._inductor import config as inductor_config  # (a plain `import torch...` here would shadow torch)

    inductor_config.compile_threads = os.cpu_count()

    def run_peer(batch: int, new: int, column: str, whole: bool) -> None:
        row = rows[batch, new]
        cell = column if whole else column + "_window"
        if time.perf_counter() - began > args.budget_s:
            row[cell + "_error"] = "not run: time budget"
            return
        try:
            run = run_hf_whole if whole else run_hf_window
            row[cell] = run(model, batch, new, static=column == "hf_static")
        except Exception as e:  # a peer that cannot run here is a result to report, not the end of the bench
            row[cell + "_error"] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.empty_cache()
        print(f"hf b{batch} n{new} {cell}: {row.get(cell) or row.get(cell + '_error')} "
              f"({time.perf_counter() - began:.0f}s into the run)", flush=True)
        save()

    rows = {(b, n): {"batch": b, "new": n, "engine": None, "peak_gib": None,
                     "limit": b * rate / (weight_bytes + b * (PROMPT_LEN + n / 2) * per_token)}
            for n in NEW_TOKENS for b in BATCHES}
    results["rows"] = list(rows.values())

    def engine_row(batch: int, new: int) -> dict:
        res = run_engine(eng, batch, new, repeat=2 if new == NEW_TOKENS[0] else 1)
        row = rows[batch, new]
        row.update(engine=res["tok_s"], peak_gib=res["peak_gib"])
        if (batch, new) == GOAL:
            row["logprob_gap_vs_hf"] = hf_agreement(model, res)
        print(f"engine b{batch} n{new}: {res['tok_s']:.0f} tok/s ({res['seconds']:.2f}s), limit {row['limit']:.0f}, "
              f"peak {res['peak_gib']:.1f} GiB ({time.perf_counter() - began:.0f}s into the run)", flush=True)
        save()
        return res

    # Order: what the goal needs first; the HF cells that need the engine's memory run
    # while it is released, which is also when release and resume are timed.
    for batch in BATCHES:
        stops = engine_row(batch, NEW_TOKENS[0])  # the last (largest batch) gives the mixed run's stops
    if plan:  # the goal's peer, beside the resident engine
        run_peer(*plan.pop(0))

    # mixed lengths: twice as many requests as slots, all with max_new_tokens 256; every other one
    # stops early on a stop token, as on an eos: the token its prompt got at step STOP_AT in the
    # batch-256 row (greedy), which the scheduler cannot know at admission
    num = 2 * max(BATCHES)
    reqs = engine_requests(torch.cat([stops["ids"], stops["ids"]]), NEW_TOKENS[0])
    for i, r in enumerate(reqs[1::2]):
        stop = stops["out"][(2 * i + 1) % len(stops["ids"])]["token_ids"][STOP_AT - 1]
        r["sampling"].update(ignore_eos=False, stop_token_ids=[stop])
    seconds, out = timed(lambda: eng.generate(reqs))
    stats = backend.scheduler.last_stats
    tail_slots = stats["slot_steps"] - stats["slot_steps_queued"]
    results["mixed"] = {"num_requests": num, "max_new": NEW_TOKENS[0],
                        "tok_s": sum(len(r["token_ids"]) for r in out) / seconds,
                        "seconds": seconds, "stopped": sum(r["finish_reason"] == "stop" for r in out),
                        "mean_new": sum(len(r["token_ids"]) for r in out) / num,
                        "occupancy": stats["busy_steps"] / stats["slot_steps"],
                        "occupancy_while_queued": stats["busy_steps_queued"] / max(1, stats["slot_steps_queued"]),
                        "occupancy_tail": (stats["busy_steps"] - stats["busy_steps_queued"]) / max(1, tail_slots),
                        "tail_share": tail_slots / stats["slot_steps"], "decode_steps": stats["decode_steps"],
                        "admitted_while_decoding": stats["admitted_while_decoding"], "num_slots": stats["num_slots"]}
    print(f"mixed: {results['mixed']}", flush=True)

    # the colocation handoff, timed: the first release pins the host buffer, the second reuses it
    tags = ["weights", "kv_cache", "cuda_graph"]
    for i in (1, 2):
        before = torch.cuda.memory_allocated()
        seconds, _ = timed(lambda: eng.release(tags))
        results[f"release{i}_s"], results["released_gib"] = seconds, (before - torch.cuda.memory_allocated()) / 2**30
        if i == 1:
            results["resume1_s"], _ = timed(lambda: eng.resume(tags))
        else:  # the dynamic-cache cells need the memory
            for peer in [p for p in plan if p[2] == "hf_dynamic"]:
                plan.remove(peer)
                run_peer(*peer)
    results["resume2_s"], _ = timed(lambda: eng.resume(tags))
    print(f"release {results['release1_s']:.2f}s then {results['release2_s']:.2f}s, resume "
          f"{results['resume1_s']:.2f}s / {results['resume2_s']:.2f}s, freed {results['released_gib']:.1f} GiB",
          flush=True)
    save()

    for batch in BATCHES:
        engine_row(batch, NEW_TOKENS[1])
    results["graphs_kept"] = len(backend.graphs._graphs)
    if args.profile:
        profile(eng)
    if plan and time.perf_counter() - began <= args.budget_s:
        eng.release(tags)
    for peer in plan:
        run_peer(*peer)
    results["total_s"] = time.perf_counter() - began
    save()
    print_table(results)


def profile(eng) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    reqs = engine_requests(prompts(64, seed=1), 64)
    eng.generate(reqs)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate(reqs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70), flush=True)


def print_table(results: dict) -> None:
    def cell(r: dict, column: str) -> str:
        for key, mark in ((column, ""), (column + "_window", "*")):
            if r.get(key):
                return f"{r[key]:,.0f}{mark}"
        return "not run"

    def ratio(r: dict, column: str) -> str:
        peer = r.get(column) or r.get(column + "_window")
        return f"{r['engine'] / peer:.1f}x" if peer and r["engine"] else "—"

    print(f"\ncopy rate {results['copy_rate_tb_s']:.2f} TB/s; weights {results['weight_gib']:.2f} GiB; "
          f"engine decode by {'Triton kernels' if results.get('triton') else 'torch ops + SDPA'}"
          + (", batch invariant" if results.get("batch_invariant") else "")
          + (" (the Triton path failed: see triton_error in the JSON)" if "triton_error" in results else ""))
    print("| batch | new tokens | engine tok/s | HF dynamic | HF static+compile | bandwidth limit | "
          "engine / limit | engine / HF static | engine / HF dynamic | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        if not r["engine"]:
            print(f"| {r['batch']} | {r['new']} | not run | {cell(r, 'hf_dynamic')} | {cell(r, 'hf_static')} | "
                  f"{r['limit']:,.0f} | — | — | — | — |")
            continue
        print(f"| {r['batch']} | {r['new']} | {r['engine']:,.0f} | {cell(r, 'hf_dynamic')} | "
              f"{cell(r, 'hf_static')} | {r['limit']:,.0f} | {r['engine'] / r['limit']:.0%} | "
              f"{ratio(r, 'hf_static')} | {ratio(r, 'hf_dynamic')} | {r['peak_gib']:.1f} |")
    print("* decode-rate window at the row's mean context (module docstring): flatters the peer")
    skipped = {f"b{r['batch']} n{r['new']} {k[:-6]}": v for r in results["rows"] for k, v in r.items()
               if k.endswith("_error")}
    if skipped:
        print(f"peer cells not run: {skipped}")
    if "mixed" in results:
        m = results["mixed"]
        print(f"mixed lengths ({m['num_requests']} requests of up to {m['max_new']} new tokens, {m['stopped']} stopped "
              f"early on a stop token, mean {m['mean_new']:.0f} tokens; {m['num_slots']} slots): "
              f"{m['tok_s']:,.0f} tok/s; slot occupancy {m['occupancy_while_queued']:.0%} while requests "
              f"wait, {m['occupancy_tail']:.0%} in the drain tail ({m['tail_share']:.0%} of slot-steps), "
              f"{m['occupancy']:.0%} over the whole call; {m['admitted_while_decoding']} admitted mid-call")
    if "release1_s" in results:
        print(f"release (weights, kv_cache, cuda_graph) of {results['released_gib']:.1f} GiB: first "
              f"{results['release1_s']:.2f}s (pins the host buffer), then {results['release2_s']:.2f}s; resume "
              f"{results['resume1_s']:.2f}s / {results.get('resume2_s', float('nan')):.2f}s (weights from "
              "pinned memory, KV cache zeroed; graphs captured again at first use)")
    gap = [r["logprob_gap_vs_hf"] for r in results["rows"] if "logprob_gap_vs_hf" in r]
    if gap:
        print(f"engine vs HF teacher-forced log-probs (bf16, b64): max |diff| {gap[0]:.3f}")
    if "total_s" in results:
        print(f"graphs kept after the engine rows: {results.get('graphs_kept')}; whole run {results['total_s']:.0f}s")


if __name__ == "__main__":
    main()
