"""Weight sync between two role processes on one GPU: CUDA IPC vs host staging vs memcpy.

    python -m bench.weight_sync [--gb 8] [--bucket-mb 512] [--json FILE]

A sender role holds Qwen3-4B-shaped bf16 weights on the GPU; a receiver role on the same
GPU holds a model-shaped copy. Both transports run the real code path
(`roles.weight_sync`: pack into a reused flat bucket, send, receiver copies by name, ack):

- ipc:   buckets travel as CUDA IPC handles (what colocated actor -> engine uses)
- host:  buckets travel through host memory (D2H, shared memory frame, H2D)
- peer:  one process copying the same tensors device to device (the memcpy ceiling)

Needs a CUDA GPU; absolute figures only mean something there.
"""

from __future__ import annotations

import argparse
import json
import time

from runtime import Actor, Supervisor, endpoint


def qwen3_4b_shapes(scale: float = 1.0) -> list[tuple[str, list[int]]]:
    """HF names and shapes of Qwen3-4B's weights (36 layers); `scale` trims the layer count."""
    h, inter, q, kv, vocab = 2560, 9728, 4096, 1024, 151936
    out = [("model.embed_tokens.weight", [vocab, h]), ("lm_head.weight", [vocab, h]),
           ("model.norm.weight", [h])]
    for i in range(max(1, round(36 * scale))):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [q, h]), (p + "self_attn.k_proj.weight", [kv, h]),
                (p + "self_attn.v_proj.weight", [kv, h]), (p + "self_attn.o_proj.weight", [h, q]),
                (p + "mlp.gate_proj.weight", [inter, h]), (p + "mlp.up_proj.weight", [inter, h]),
                (p + "mlp.down_proj.weight", [h, inter]), (p + "input_layernorm.weight", [h]),
                (p + "post_attention_layernorm.weight", [h])]
    return out


def _tensors(shapes, fill: float):
    import torch
    return {n: torch.full(s, fill, dtype=torch.bfloat16, device="cuda") for n, s in shapes}


class Receiver(Actor):
    def __init__(self, shapes):
        self.params = _tensors(shapes, 0.0)

    @endpoint
    def update_weights(self, bucket: dict) -> int:
        import torch
        from roles.weight_sync import received, unpack_bucket

        named = unpack_bucket(received(bucket))
        for name, t in named:
            self.params[name].copy_(t, non_blocking=True)
        torch.cuda.synchronize()  # the ack lets the sender overwrite its buffer
        return len(named)

    @endpoint
    def checksum(self) -> float:
        return float(sum(t.float().sum().item() for t in self.params.values()))


class Sender(Actor):
    def __init__(self, shapes):
        self.params = _tensors(shapes, 1.0)

    @endpoint
    def push(self, receiver, buffer_bytes: int, gpus: list[int] | None) -> dict:
        import torch
        from roles.weight_sync import for_receiver, push_weights

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        totals = push_weights(self.params.items(),
                              lambda b: receiver.update_weights.call(for_receiver(b, gpus)).result(),
                              buffer_bytes)
        return {**totals, "seconds": time.perf_counter() - t0}

    @endpoint
    def peer_copy(self) -> dict:
        import torch
        dst = {n: torch.empty_like(t) for n, t in self.params.items()}
        for _ in range(2):  # first pass warms up the allocator
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for n, t in self.params.items():
                dst[n].copy_(t)
            torch.cuda.synchronize()
        return {"num_bytes": sum(t.numel() * 2 for t in self.params.values()),
                "seconds": time.perf_counter() - t0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of Qwen3-4B's 36 layers")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    shapes = qwen3_4b_shapes(args.scale)
    buffer_bytes = args.bucket_mb << 20
    with Supervisor("runs/bench-weight-sync", heartbeat_interval=1.0) as sup:
        snd = sup.spawn("sender", Sender, shapes, gpus=[0])
        rcv = sup.spawn("receiver", Receiver, shapes, gpus=[0])
        sup.wait_ready(timeout=600)
        results = {}
        for name, gpus in (("ipc", [0]), ("host", None)):
            snd.push(rcv, buffer_bytes, gpus)  # warm-up: allocator, IPC handle cache, shm pool
            r = snd.push(rcv, buffer_bytes, gpus)
            results[name] = {"GB/s": r["num_bytes"] / r["seconds"] / 1e9, "seconds": r["seconds"],
                             "bytes": r["num_bytes"], "buckets": r["num_buckets"]}
        expected = float(sum(_numel(s) for _, s in shapes))
        assert abs(rcv.checksum() - expected) < 1e-3 * expected, "receiver weights differ after the sync"
        p = snd.peer_copy()
        results["peer"] = {"GB/s": p["num_bytes"] / p["seconds"] / 1e9, "seconds": p["seconds"],
                           "bytes": p["num_bytes"]}
    ipc = results["ipc"]["GB/s"]
    print(f"weight sync of {results['ipc']['bytes'] / 1e9:.2f} GB (bf16, Qwen3-4B shapes x{args.scale}), "
          f"{args.bucket_mb} MiB buckets, sender and receiver roles on one GPU")
    print(f"{'transport':<10}{'GB/s':>10}{'seconds':>10}{'ipc / this':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['GB/s']:>10.1f}{r['seconds']:>10.3f}{ipc / r['GB/s']:>12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    main()
