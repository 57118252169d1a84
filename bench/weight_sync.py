"""Weight sync between two role processes on one GPU: torch-backend and megatron senders,
CUDA IPC (direct windows; packed buckets with one or two buffers, bucket sizes) vs host
staging vs memcpy.

    python -m bench.weight_sync [--scale 1.0] [--bucket-mb 512 1024] [--host] [--json FILE]

A sender role holds Qwen3-4B-shaped bf16 weights on the GPU (tied embeddings, as Qwen3-4B:
8.04 GB) twice: under HF names (what the torch backend's actor yields: each tensor owns its
storage) and in megatron's layout (fused QKV per query group, fc1 = gate|up; built by
roles.trainer.megatron.mapper) inside one flat bf16 buffer, as megatron's DDP keeps them.
A receiver role on the same GPU holds a model-shaped copy. Every row runs the real path
(`roles.weight_sync.push_weights`: pack into reused flat buckets, send a CUDA IPC handle,
the receiver copies by name and acks); the megatron rows first map megatron -> HF names
(`mapper.stage_to_hf(views=True)`, what `MegatronCore.named_hf_weights` gives the actor's
sync at TP1 PP1: q/k/v as strided windows, `roles.weight_views.LazyReshape`):

- hf / megatron, buffers 1 or 2 (double buffering: the next bucket is packed while the
  receiver copies the last), per bucket size
- hf / megatron, production: `roles.weight_sync.send_to_engines`, the call
  `ActorRole.sync_weights` (roles.trainer.actor, both backends) makes, at its defaults (bucket size
  `--update-weight-buffer-size`'s default, `SYNC_NUM_BUFFERS` buffers, acks per engine):
  windows into the megatron buffer, q/k/v included, travel as direct buckets (no packing
  copy), mapped to HF names once as the megatron actor does at TP1 PP1; the hf tensors own
  their storages, so that row packs everything. Each production
  row also gets a per-bucket breakdown (`bucket_breakdown`): when the sender sent it, the
  way to the receiver (IPC share and message), the receiver's map of the IPC storages, its
  copy (and synchronize), its unmap, the way back to the sender, in ms
- megatron, production packed: the same call with direct=False (every tensor packed), the
  sender of the production row before direct buckets, side by side in the same run
- megatron pack only: the same packing with no receiver (the sender's share)
- megatron plan only: the production sender's mapping and direct-bucket listing, no receiver
  (the sender's share of the production row, before anything is sent)
- megatron copy only: the receiver's copies of the production row (HF tensors from the
  megatron windows into HF-shaped tensors) in the sender's process, no IPC: by `copy_into`
  (as the receivers: small tensors batched, large and strided ones one `copy_` each) and by
  one `copy_` each (as the memcpy peer)
- host: buckets through host memory (D2H, shared-memory frame, H2D); with --host (slow)
- peer: one process copying the same tensors device to device (the memcpy ceiling)

Each row: the median of 3 timed syncs after a warm-up. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ppo.config.schema import EngineConfig
from roles.weight_sync import SYNC_NUM_BUFFERS
from runtime import Actor, Supervisor, endpoint

DEFAULT_BUFFER_BYTES = EngineConfig.update_weight_buffer_size  # what a run uses unless told otherwise

QWEN3_4B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)


def qwen3_4b_shapes(scale: float = 1.0) -> list[tuple[str, list[int]]]:
    """HF names and shapes of Qwen3-4B's weights (36 layers, tied embeddings: no lm_head);
    `scale` trims the layer count."""
    h, inter, q, kv, d, vocab = 2560, 9728, 4096, 1024, 128, 151936
    out = [("model.embed_tokens.weight", [vocab, h]), ("model.norm.weight", [h])]
    for i in range(num_layers(scale)):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [q, h]), (p + "self_attn.k_proj.weight", [kv, h]),
                (p + "self_attn.v_proj.weight", [kv, h]), (p + "self_attn.o_proj.weight", [h, q]),
                (p + "self_attn.q_norm.weight", [d]), (p + "self_attn.k_norm.weight", [d]),
                (p + "mlp.gate_proj.weight", [inter, h]), (p + "mlp.up_proj.weight", [inter, h]),
                (p + "mlp.down_proj.weight", [h, inter]), (p + "input_layernorm.weight", [h]),
                (p + "post_attention_layernorm.weight", [h])]
    return out


def num_layers(scale: float) -> int:
    return max(1, round(36 * scale))


def _shape(scale: float):
    from roles.trainer.megatron.shape import megatron_spec

    return megatron_spec({**QWEN3_4B, "num_hidden_layers": num_layers(scale)})


def _position_sums(named) -> dict[str, float]:
    """name -> a position-weighted sum: differs when elements move (a wrong q/k/v regroup)."""
    import torch

    out = {}
    for name, t in named:
        flat = t.detach().reshape(-1).float()
        out[name] = float((flat * torch.linspace(0.0, 1.0, flat.numel(), device=flat.device)).sum())
    return out


def bucket_breakdown(sync_start: float, sends: list[dict], receipts: list[dict]) -> list[dict]:
    """Per bucket of one sync, in ms: `sent` (from the sync's start), `to_receiver` (the IPC
    share and the message), the receiver's `map` (rebuilding the IPC storages), `copy` (its
    copies and synchronize), `unmap` (dropping the mappings), `to_sender` (the ack's way
    back: an upper bound, as the sender looks at an ack only when it needs the buffer or at
    the end) and `acked` (from the sync's start).

    `sends`: the sender's records, in bucket order ({"direct", "bytes", "sent", "acked"},
    wall-clock seconds); `receipts`: the receiver's, the last len(sends) of them this sync's
    ({"direct", "bytes", "start", "mapped", "copied", "dropped"}); both on one host's clock."""
    if len(receipts) < len(sends):
        raise ValueError(f"{len(sends)} buckets sent but {len(receipts)} received")
    rows = []
    for s, r in zip(sends, receipts[len(receipts) - len(sends):]):
        if (s["direct"], s["bytes"]) != (r["direct"], r["bytes"]):
            raise ValueError(f"bucket {len(rows)}: sent {s['bytes']} bytes (direct={s['direct']}), "
                             f"received {r['bytes']} (direct={r['direct']}): the records do not pair up")
        spans = {"sent": s["sent"] - sync_start, "to_receiver": r["start"] - s["sent"], "map": r["mapped"] - r["start"],
                 "copy": r["copied"] - r["mapped"], "unmap": r["dropped"] - r["copied"],
                 "to_sender": s["acked"] - r["dropped"], "acked": s["acked"] - sync_start}
        rows.append({"kind": "direct" if s["direct"] else "packed", "mib": s["bytes"] / 2**20,
                     **{k: v * 1e3 for k, v in spans.items()}})
    return rows


class Receiver(Actor):
    def __init__(self, shapes):
        import torch
        self.params = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
        self.receipts: list[dict] = []  # per bucket: its phases' wall-clock times (bucket_breakdown)

    @endpoint
    def update_weights(self, bucket: dict) -> int:
        import torch
        from roles.weight_sync import bucket_nbytes, is_direct, received, unpack_bucket
        from roles.weight_views import copy_into

        start = time.time()
        bucket = received(bucket)
        mapped = time.time()
        named = unpack_bucket(bucket)
        copy_into([self.params[n] for n, _ in named], [t for _, t in named])
        torch.cuda.synchronize()  # the ack lets the sender overwrite its buffer
        copied = time.time()
        receipt, num_tensors = {"direct": is_direct(bucket), "bytes": bucket_nbytes(bucket)}, len(named)
        del named, bucket  # drops the mappings (a direct bucket's storages) before the ack
        self.receipts.append({**receipt, "start": start, "mapped": mapped, "copied": copied, "dropped": time.time()})
        return num_tensors

    @endpoint
    def take_receipts(self) -> list[dict]:
        receipts, self.receipts = self.receipts, []
        return receipts

    @endpoint
    def position_sums(self) -> dict[str, float]:
        return _position_sums(self.params.items())


class Sender(Actor):
    def __init__(self, shapes, scale: float):
        import torch
        from roles.trainer.megatron.mapper import hf_to_megatron

        gen = torch.Generator(device="cuda").manual_seed(0)
        self.params = {n: torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16) for n, s in shapes}
        self.shape = _shape(scale)
        separate = hf_to_megatron(self.params, self.shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        # one flat buffer with every parameter a view into it, as megatron's DDP param buffer
        self.flat = torch.empty(sum(t.numel() for t in separate.values()), dtype=torch.bfloat16, device="cuda")
        self.megatron, offset = {}, 0
        for name, t in separate.items():
            self.megatron[name] = self.flat[offset : offset + t.numel()].view(t.shape)
            self.megatron[name].copy_(t)
            offset += t.numel()
        del separate
        self._mapped: list | None = None  # the production rows' megatron pairs (_named)
        torch.cuda.synchronize()

    def _named(self, layout: str, production: bool = False):
        if layout == "hf":
            return self.params.items()
        from roles.trainer.megatron.mapper import stage_to_hf

        if production:  # mapped once, as MegatronCore.named_hf_weights caches its views at TP1 PP1
            if self._mapped is None:
                self._mapped = list(stage_to_hf(lambda name: [self.megatron[name]], self.shape, pp_rank=0,
                                                pp_size=1, views=True))
            return iter(self._mapped)
        return stage_to_hf(lambda name: [self.megatron[name]], self.shape, pp_rank=0, pp_size=1, views=True)

    @endpoint
    def push(self, receiver, layout: str, buffer_bytes: int, num_buffers: int, gpus: list[int] | None,
             reps: int = 3, production: bool = False, direct: bool = False) -> dict:
        """Median seconds of `reps` syncs after a warm-up; receiver=None: packing only (with
        `direct`, planning only: the mapping and the direct bucket's listing, no copy);
        production: the actor's sender (`send_to_engines`, its own buffer count; `direct`
        passed on), with the last sync's per-bucket send and ack times (`bucket_breakdown`)."""
        import torch
        from roles.weight_sync import bucket_nbytes, for_receiver, is_direct, push_weights, send_to_engines

        sends: list[dict] = []

        def acked(bucket: dict, sent: float) -> None:
            sends.append({"direct": is_direct(bucket), "bytes": bucket_nbytes(bucket), "sent": sent,
                          "acked": time.time()})

        def send(bucket):
            if receiver is None:
                return None
            future = receiver.update_weights.call(for_receiver(bucket, gpus))
            return future if num_buffers > 1 else future.result()

        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            sends.clear()  # the last sync's are returned
            sync_start, t0 = time.time(), time.perf_counter()
            if production:
                totals = send_to_engines(self._named(layout, production=True), [receiver], buffer_bytes,
                                         engine_gpus=[gpus], on_bucket=acked, direct=direct)
            else:
                totals = push_weights(self._named(layout), send, buffer_bytes, num_buffers=num_buffers,
                                      direct=(lambda device: True) if direct else None)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        timing = {"sync_start": sync_start, "sends": list(sends)} if production else {}
        return {**totals, "seconds": statistics.median(times[1:]), **timing}

    @endpoint
    def position_sums(self) -> dict[str, float]:
        return _position_sums(self.params.items())

    @endpoint
    def peer_copy(self) -> dict:
        import torch
        dst = {n: torch.empty_like(t) for n, t in self.params.items()}

        def run():
            for n, t in self.params.items():
                dst[n].copy_(t)

        return {"num_bytes": sum(t.numel() * 2 for t in self.params.values()), "seconds": _second_pass_seconds(run)}

    @endpoint
    def local_copy(self, batched: bool) -> dict:
        """The receiver's copies of a megatron sync without IPC or messages: the HF tensors read
        from the megatron windows (q/k/v strided) into HF-shaped tensors of this process, by
        `copy_into` (what the receivers run) or one `copy_` each (what the memcpy peer does)."""
        import torch
        from roles.weight_views import LazyReshape, copy_into

        named = list(self._named("megatron"))
        dst = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for _, t in named]

        def run():
            if batched:
                copy_into(dst, [t for _, t in named])
                return
            for d, (_, t) in zip(dst, named):
                if isinstance(t, LazyReshape):
                    d, t = d.view(t.view.shape), t.view
                d.copy_(t)

        return {"num_bytes": sum(d.nbytes for d in dst), "seconds": _second_pass_seconds(run)}


def _second_pass_seconds(run) -> float:
    """Seconds of `run()`'s second pass, synchronized (the first warms up the allocator)."""
    import torch

    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def print_breakdown(row: str, buckets: list[dict]) -> None:
    print(f"\n{row}: per bucket of the last sync, ms (sent, acked: from the sync's start; to_sender: "
          "an upper bound)")
    keys = ("sent", "to_receiver", "map", "copy", "unmap", "to_sender", "acked")
    print(f"{'#':>3} {'kind':<7}{'MiB':>8}" + "".join(f"{k:>12}" for k in keys))
    for i, b in enumerate(buckets):
        print(f"{i:>3} {b['kind']:<7}{b['mib']:>8.0f}" + "".join(f"{b[k]:>12.2f}" for k in keys))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of Qwen3-4B's 36 layers")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--host", action="store_true", help="also time the host-staging transport (seconds)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    shapes = qwen3_4b_shapes(args.scale)
    rows = []
    with Supervisor("runs/bench-weight-sync", heartbeat_interval=1.0) as sup:
        snd = sup.spawn("sender", Sender, shapes, args.scale, gpus=[0])
        rcv = sup.spawn("receiver", Receiver, shapes, gpus=[0])
        sup.wait_ready(timeout=600)
        expected = snd.position_sums()

        def timed(row: str, layout: str, buffer_bytes: int, buffers: int, **kw) -> None:
            out = snd.push(rcv, layout, buffer_bytes, buffers, [0], **kw)
            receipts = rcv.take_receipts()
            if "sends" in out:
                out["buckets"] = bucket_breakdown(out.pop("sync_start"), out.pop("sends"), receipts)
            rows.append({"row": row, "bucket_mb": buffer_bytes >> 20, **out})
            got = rcv.position_sums()
            bad = [n for n in expected if abs(got[n] - expected[n]) > 1e-3 * (1 + abs(expected[n]))]
            assert not bad, f"{row}: receiver weights differ after the sync: {bad[:3]}"

        for mb in args.bucket_mb:
            for layout in ("hf", "megatron"):
                for buffers in (1, 2):
                    timed(f"{layout}, {buffers} buffer{'s' if buffers > 1 else ''}", layout, mb << 20, buffers)
            rows.append({"row": "megatron pack only", "bucket_mb": mb, **snd.push(None, "megatron", mb << 20, 1, None)})
        for layout in ("hf", "megatron"):
            timed(f"{layout}, production", layout, DEFAULT_BUFFER_BYTES, SYNC_NUM_BUFFERS, production=True,
                  direct=True)
        timed("megatron, production packed", "megatron", DEFAULT_BUFFER_BYTES, SYNC_NUM_BUFFERS, production=True)
        rows.append({"row": "megatron plan only", "bucket_mb": DEFAULT_BUFFER_BYTES >> 20,
                     **snd.push(None, "megatron", DEFAULT_BUFFER_BYTES, SYNC_NUM_BUFFERS, None, direct=True)})
        for batched in (True, False):
            rows.append({"row": f"megatron copy only, {'copy_into' if batched else 'copy_ each'}", "bucket_mb": None,
                         **snd.local_copy(batched)})
        if args.host:
            rows.append({"row": "hf, host staging", "bucket_mb": args.bucket_mb[0],
                         **snd.push(rcv, "hf", args.bucket_mb[0] << 20, 1, None, reps=1)})
        rows.append({"row": "peer memcpy", "bucket_mb": None, **snd.peer_copy()})
    peer = rows[-1]["seconds"]
    print(f"weight sync of {rows[0]['num_bytes'] / 1e9:.2f} GB (bf16, Qwen3-4B shapes x{args.scale}), "
          "sender and receiver roles on one GPU, CUDA IPC")
    print(f"production: ActorRole.sync_weights' sender, {SYNC_NUM_BUFFERS} buffers, "
          f"{DEFAULT_BUFFER_BYTES >> 20} MiB buckets (--update-weight-buffer-size default)")
    print(f"{'row':<30}{'bucket MiB':>11}{'buckets':>8}{'direct GB':>10}{'ms':>9}{'GB/s':>9}{'vs memcpy':>11}")
    for r in rows:
        direct = f"{r['direct_bytes'] / 1e9:.2f}" if "direct_bytes" in r else "-"
        print(f"{r['row']:<30}{str(r['bucket_mb'] or '-'):>11}{str(r.get('num_buckets', '-')):>8}{direct:>10}"
              f"{r['seconds'] * 1e3:>9.1f}{r['num_bytes'] / r['seconds'] / 1e9:>9.0f}{r['seconds'] / peer:>10.1f}x")
    for r in rows:
        if "buckets" in r:
            print_breakdown(r["row"], r["buckets"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return {"rows": rows}


if __name__ == "__main__":
    main()
