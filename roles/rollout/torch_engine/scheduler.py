"""Continuous batching over the slot KV cache: prefill packed, decode on the device.

A blocking `generate` call runs this loop until every request is done; a `stream` call adds its
requests to the running batch (running.py), which outlives the call, and runs the loop until
some request has finished (or a short wait has passed), returning the finished ones: requests
that arrive while others decode (a trajectory's next turn) take slots as they free, as any
waiting request does. The running batch keeps one slot geometry; a request too long for it
waits until the batch drains, then starts one of its own.

1. admit: waiting requests take the free slots (lowest first), those with the most
   max_new_tokens first (the only length known ahead: it shortens the tail in which the
   last long requests run in a mostly idle batch; each request's draws are keyed by its own
   seed, so the order changes no result where the forward is batch invariant: in fp32, see
   sampler.py); their prompts are packed into prefill forwards of at most PREFILL_TOKENS
   tokens (one prompt each under `batch_invariant`), and each one's first token is sampled
   from its last prompt position.
2. decode: `n` steps over the slots [0, B) (B: the graph batch size covering the highest
   busy slot; every slot under `batch_invariant`), entirely on the device: each step feeds
   every slot's last token, writes its K/V at its position, attends, samples, and appends
   (token, log-prob) to a ring of `sync_every` rows. `n` is at most `sync_every` and at most
   the fewest tokens any busy row still may take, so length finishes are never overrun.
3. sync: the ring comes to the host once; finishes are decided there (max_new_tokens first,
   then stop ids, as sampling.py says) and freed slots are refilled at step 1 of the same
   call, so a long tail does not idle the batch.

With an abort board (a partial rollout, roles/rollout/abort_board.py) each finish is marked on
it, and the board's abort is read at every sync: once set, the call ends there and every request
not finished returns with finish_reason "abort" and the tokens it has (none if still waiting).

A row that stopped on a token keeps decoding garbage until the next sync (at most
`sync_every - 1` steps); its slot has room for that, and nothing it computes is kept.

KV reuse across turns (prefixes.py): a finished request's slot keeps its tokens' K/V; a later
request that continues it (a trajectory's next turn) takes that slot and prefills only its new
tokens, attending to the kept positions. Idle slots decode their garbage past what they keep.
Off under `batch_invariant` (a reused prefix changes the shapes a request is computed with).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from roles.rollout.abort_board import AbortBoard
from roles.rollout.sampling import GenerateRequest
from roles.rollout.torch_engine.decoder import Decoder
from roles.rollout.torch_engine.graphs import DecodeGraphs, batch_bucket
from roles.rollout.torch_engine.kv_cache import Geometry, KVCache
from roles.rollout.torch_engine.prefixes import SlotPrefixes
from roles.rollout.torch_engine.running import Held, RunningBatch
from roles.rollout.torch_engine.sampler import SamplingRows, sample

PREFILL_TOKENS = 16384  # packed prompt tokens per prefill forward (activations scale with it)


class SlotState:
    """The per-slot tensors a decode step reads and updates in place ([max_slots] each)."""

    def __init__(self, num_slots: int, sync_every: int, vocab: int, max_slot_len: int, device: torch.device):
        self.tokens = torch.zeros(num_slots, dtype=torch.long, device=device)  # last token of each slot
        self.positions = torch.zeros(num_slots, dtype=torch.long, device=device)  # that token's position
        self.rows = SamplingRows.empty(num_slots, vocab, device)
        self.ring_tokens = torch.zeros(sync_every, num_slots, dtype=torch.long, device=device)
        self.ring_logprobs = torch.zeros(sync_every, num_slots, dtype=torch.float32, device=device)
        self.ring_index = torch.zeros(1, dtype=torch.long, device=device)
        self.slot_ids = torch.arange(num_slots, device=device)
        self.key_positions = torch.arange(max_slot_len, device=device)  # cache positions (torch attention's mask)

    def mutable(self) -> list[torch.Tensor]:
        """What a decode step changes (restored after a graph's warm-up run)."""
        return [self.tokens, self.positions, self.ring_tokens, self.ring_logprobs, self.ring_index]


class Scheduler:
    def __init__(self, decoder: Decoder, cache: KVCache, graphs: DecodeGraphs, *, sync_every: int,
                 slot_quantum: int, span_quantum: int, fused: bool, batch_invariant: bool = False,
                 kv_reuse: bool = True, slot_len: int | None = None):
        self.decoder = decoder
        self.spec = decoder.spec
        self.cache = cache
        self.graphs = graphs
        self.sync_every = sync_every
        self.slot_quantum = slot_quantum  # slot lengths rounded up to it, so graph keys repeat
        self.span_quantum = span_quantum  # likewise the attended span of the slots (torch attention)
        # fused: decode by the Triton kernels (kernels.py): they read lengths on the device, so
        # the attended span is not part of a graph's key
        self.fused = fused
        # batch_invariant: a request's forward has the same shapes in any batch (one prompt per
        # prefill, decode over every slot, attention unsplit), so the same rounding (backend.py)
        self.batch_invariant = batch_invariant
        self.kv_reuse = kv_reuse and not batch_invariant  # off under batch_invariant: module docstring
        self.slot_len = slot_len  # fixed slots (backend.py's option), else shaped per batch
        # the longest slot a call can shape (_geometry: prompt + max_new_tokens <= max_positions)
        self.max_slot_len = self.spec.max_positions + sync_every + slot_quantum
        self.state: SlotState | None = None
        self.prefixes = SlotPrefixes()
        self.batch: RunningBatch | None = None  # the requests being served (running.py)
        self.last_stats: dict = {}

    def drop_state(self) -> None:
        """Forget the device state and the decode steps (graphs) that read it (the KV cache or
        weights are going away)."""
        self.graphs.free()
        self.state = None
        self.batch = None
        self.decoder.drop_rope()
        self.prefixes.clear()

    def forget_prefixes(self) -> None:
        """The cache's K/V no longer match the weights (an update): nothing is reused."""
        self.prefixes.clear()

    # -- the loop ---------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[GenerateRequest], seeds: list[int], board: AbortBoard | None = None
                 ) -> list[dict]:
        """Every request to its finish (or to the board's abort), results in request order."""
        if self.batch is not None:
            raise RuntimeError(f"generate() while {len(self.batch.held())} streamed requests are in the running "
                               "batch; let them finish (stream) or drop them (drop_stream) first")
        held = self._admit(requests, seeds)
        self._run(board, until_all=True)
        if self.batch is not None:  # aborted mid-way: their K/V stay for a continuation
            for s in self.batch.busy():
                self._finished(s, self.batch.slots[s])
            self.last_stats["aborted"] = sum(h.finish is None for h in held)
            self.batch = None
        else:
            self.last_stats["aborted"] = 0
        return [h.result() for h in held]

    @torch.no_grad()
    def stream(self, requests: list[GenerateRequest], seeds: list[int], wait_s: float | None) -> list[dict]:
        """`requests` join the running batch (taking slots as they free, as any waiting request);
        decode until at least one held request has finished or `wait_s` has passed (None: no time
        limit: the call then ends at a sync its requests decide), and return
        the results of those finished, in finishing order. The others stay in their slots for
        the next call."""
        self._admit(requests, seeds)
        return [h.result() for h in self._run(None, until_all=False, wait_s=wait_s)]

    def held_ids(self) -> list[int]:
        """The ids of the requests in the running batch (streamed, not yet returned)."""
        return [h.request.id for h in self.batch.held()] if self.batch is not None else []

    def drop_stream(self) -> None:
        """Forget the running batch (its caller is gone): no slot keeps anything for a later turn."""
        self.prefixes.clear()
        self.batch = None

    def _admit(self, requests: list[GenerateRequest], seeds: list[int]) -> list[Held]:
        eos = frozenset(self.spec.eos_ids)
        held = [Held(r, seed, frozenset() if r.sampling.ignore_eos else frozenset(r.sampling.stop_token_ids) | eos)
                for r, seed in zip(requests, seeds)]
        if held and self.batch is None:
            self._start(held)
        for h in held:
            self.batch.add(h)
        return held

    def _start(self, held: list[Held]) -> None:
        """A new running batch, its slots shaped for `held`."""
        geometry = self._geometry([h.request for h in held])
        if geometry != self.cache.geometry:
            self.prefixes.clear()  # the slots' contents move under a new geometry
        self.cache.shape(geometry)
        if self.state is None:
            device = self.cache.memory.device
            self.state = SlotState(self.cache.max_slots, self.sync_every, self.spec.vocab_size, self.max_slot_len,
                                   device)
            self.decoder.build_rope(self.max_slot_len, device)
        self._park_idle(range(geometry.num_slots))  # slots idle since the last batch restart past what they keep
        self.batch = RunningBatch(geometry, self.sync_every)
        self.last_stats = self.batch.stats

    def _run(self, board: AbortBoard | None, *, until_all: bool, wait_s: float | None = 0.0) -> list[Held]:
        """Admit, decode, sync (module docstring) until the batch is done, or (until_all False) until
        a request finished or wait_s passed; the requests finished meanwhile. The batch is None
        once it holds nothing."""
        finished: list[Held] = []
        started = time.monotonic()

        def take(h: Held, token: int, logprob: float) -> bool:
            """Append one sampled token; True when h is finished."""
            h.tokens.append(token)
            h.logprobs.append(logprob)
            if len(h.tokens) >= h.budget:
                h.finish = "length"  # checked before stop tokens, as sglang does
            elif token in h.stops:
                h.finish = "stop"
            if h.finish is not None:
                finished.append(h)
                if board is not None:
                    board.finish(h.request.id)
            return h.finish is not None

        while board is None or not board.aborted():
            b = self.batch
            stats, geometry, mode = b.stats, b.geometry, b.mode
            while b.waiting and None in b.slots:  # 1. admit
                free = [s for s, h in enumerate(b.slots) if h is None]
                admitted = self._pack(b.waiting[:1 if self.batch_invariant else len(free)])
                del b.waiting[:len(admitted)]
                slots, offsets = self._place([h.request for h in admitted], free)
                stats["num_prefills"] += 1
                stats["prefill_tokens"] += sum(len(h.request.prompt_ids) - o for h, o in zip(admitted, offsets))
                stats["reused_tokens"] += sum(offsets)
                if stats["decode_steps"]:
                    stats["admitted_while_decoding"] += len(admitted)
                first = self._prefill([h.request for h in admitted], [h.seed for h in admitted], slots, mode,
                                      offsets)
                for s, h, (tok, lp) in zip(slots, admitted, first):
                    b.slots[s] = h
                    if take(h, tok, lp):
                        self._finished(s, h)
            busy = b.busy()
            if not busy:
                if b.deferred:
                    self._start(b.deferred)
                    for h in b.deferred:
                        self.batch.add(h)
                    continue
                self.batch = None
                break
            # 2. decode
            batch = geometry.num_slots if self.batch_invariant else batch_bucket(busy[-1] + 1, geometry.num_slots)
            steps = min([self.sync_every] + [b.slots[s].budget - len(b.slots[s].tokens) for s in busy])
            # attention reads only the cache positions these steps can reach (rounded, so graphs repeat)
            reach = max(len(b.slots[s].request.prompt_ids) + len(b.slots[s].tokens) for s in busy)
            span = None if self.fused else min(geometry.slot_len,
                                               -(-(reach + steps) // self.span_quantum) * self.span_quantum)
            key = (batch, geometry, mode, span)
            for _ in range(steps):
                self.graphs.run(key, lambda: self._step(key), self.state.mutable())
            ring_tokens = self.state.ring_tokens[:steps, :batch].tolist()  # 3. sync (one transfer each)
            ring_logprobs = self.state.ring_logprobs[:steps, :batch].tolist()
            self.state.ring_index.zero_()
            stats["decode_steps"] += steps
            stats["slot_steps"] += steps * batch
            busy_before = stats["busy_steps"]
            for s in busy:
                h = b.slots[s]
                for j in range(steps):
                    stats["busy_steps"] += 1
                    if take(h, ring_tokens[j][s], ring_logprobs[j][s]):
                        self._finished(s, h)
                        break
            if b.waiting:
                stats["slot_steps_queued"] += steps * batch
                stats["busy_steps_queued"] += stats["busy_steps"] - busy_before
            # idle slots in the batch decode garbage in their own slot, past what it keeps: harmless,
            # and within the slot, as long as they restart there at every sync
            idle = [s for s in range(batch) if b.slots[s] is None]
            if idle:
                self._park_idle(idle)
            if not until_all and (finished or (wait_s is not None and time.monotonic() - started >= wait_s)):
                break
        if self.batch is not None and not self.batch.held():
            self.batch = None
        return finished

    def _finished(self, slot: int, held: Held) -> None:
        self.batch.slots[slot] = None
        if self.kv_reuse:
            self.prefixes.record(slot, held.request.prompt_ids, held.tokens)

    def _park_idle(self, slots) -> None:
        """Idle slots restart just past the tokens they keep (0 when none), so that the garbage they
        decode never overwrites a prefix a later turn may reuse."""
        slots = list(slots)
        at = torch.tensor([self.prefixes.held_len(s) for s in slots], device=self.state.positions.device)
        self.state.positions[torch.tensor(slots, device=at.device)] = at

    def _place(self, reqs: list[GenerateRequest], free: list[int]) -> tuple[list[int], list[int]]:
        """Each request's slot and the positions of its prompt it reuses there (prefixes.py):
        continuations first, so that no request of the same admission takes their slots."""
        num_slots, free = self.batch.geometry.num_slots, list(free)
        busy = sorted(set(range(num_slots)) - set(free))
        # what decodes anyway: the slots up to the highest busy one, and room for every request
        width = batch_bucket(max(len(busy) + len(reqs), busy[-1] + 1 if busy else 0), num_slots)
        slots, offsets = [None] * len(reqs), [0] * len(reqs)
        for j, r in enumerate(reqs):
            hit = self.prefixes.match(r.prompt_ids, free) if self.kv_reuse else None
            if hit is not None:
                slots[j], offsets[j] = hit
                free.remove(hit[0])
        for j in range(len(reqs)):
            if slots[j] is None:
                slots[j] = self.prefixes.spare(free, width) if self.kv_reuse else free[0]
                free.remove(slots[j])
        for s in slots:
            self.prefixes.take(s)
        return slots, offsets

    def _geometry(self, requests: list[GenerateRequest]) -> Geometry:
        longest = max(requests, key=lambda r: len(r.prompt_ids) + r.sampling.max_new_tokens)
        # the last sampled token is never fed back, but up to sync_every - 1 steps may run past it
        need = len(longest.prompt_ids) + longest.sampling.max_new_tokens + self.sync_every - 1
        if self.slot_len is not None and need > self.slot_len:
            raise ValueError(f"request id={longest.id}: prompt {len(longest.prompt_ids)} + max_new_tokens "
                             f"{longest.sampling.max_new_tokens} (+ {self.sync_every - 1} decode steps past the end) "
                             f"need slots of {need} positions; the engine's option slot_len={self.slot_len}")
        rounded = -(-max(need, self.slot_len or 0) // self.slot_quantum) * self.slot_quantum
        current = self.cache.geometry
        if self.prefixes and current is not None and current.slot_len >= need:
            return current  # keep the slots whose prefixes the next turns reuse
        geometry = self.cache.geometry_for(rounded)
        if geometry.num_slots == 0:
            geometry = self.cache.geometry_for(need)
        if geometry.num_slots == 0:
            raise ValueError(
                f"request id={longest.id}: prompt {len(longest.prompt_ids)} + max_new_tokens "
                f"{longest.sampling.max_new_tokens} tokens need {need * self.cache.bytes_per_token} bytes of "
                f"KV cache, more than kv_cache_bytes={self.cache.num_bytes}; raise kv_cache_bytes (or "
                "mem_fraction) or shorten the request"
            )
        return geometry

    @staticmethod
    def _pack(waiting: list[Held]) -> list[Held]:
        """The first of `waiting` that fit one prefill forward (counted whole: a reused prefix is
        found later), sorted so equal prompt lengths are adjacent."""
        chosen, total = [], 0
        for h in waiting:
            n = len(h.request.prompt_ids)
            if chosen and total + n > PREFILL_TOKENS:
                break
            chosen.append(h)
            total += n
        return sorted(chosen, key=lambda h: len(h.request.prompt_ids))

    # -- prefill ----------------------------------------------------------------------
    def _prefill(self, reqs: list[GenerateRequest], seeds: list[int], slots: list[int],
                 mode: str, offsets: list[int]) -> list[tuple[int, float]]:
        """Run the packed prompts (each from its offset: the positions before it are in its slot
        already), fill their slots' cache and state; return each first (token, logprob)."""
        device = self.state.tokens.device
        lengths = [len(r.prompt_ids) for r in reqs]
        new = [n - o for n, o in zip(lengths, offsets)]  # tokens each prompt runs
        tokens = torch.tensor([t for r, o in zip(reqs, offsets) for t in r.prompt_ids[o:]], device=device)  # [N]
        positions = torch.cat([torch.arange(o, n) for n, o in zip(lengths, offsets)]).to(device)  # [N]
        slot_of_token = torch.repeat_interleave(torch.tensor(slots), torch.tensor(new)).to(device)
        # groups: [first token, number of prompts, prompt length, offset]: runs of whole prompts of
        # equal length (one batched causal attention); a prompt with an offset is a group alone
        groups = []
        start = 0
        for n, o, slot in zip(new, offsets, slots):
            if o == 0 and groups and groups[-1][3] == 0 and groups[-1][2] == n:
                groups[-1][1] += 1
            else:
                groups.append([start, 1, n, o, slot])
            start += n
        s = self.spec

        cos, sin = self.decoder.rope_at(positions)

        def attend(layer: int, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = self.decoder.attention_inputs(layer, qkv, cos, sin)
            keys, values = self.cache.layer(layer)
            keys[slot_of_token, :, positions] = k  # [N, KV, D] into [S, KV, T, D]
            values[slot_of_token, :, positions] = v
            out = torch.empty_like(q)
            for first, num, length, offset, slot in groups:
                span = slice(first, first + num * length)
                if offset:  # its new tokens attend to the slot's kept positions and to each other, causally
                    end = offset + length
                    qg = q[span].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
                    visible = (torch.arange(end, device=device)[None, :]
                               <= torch.arange(offset, end, device=device)[:, None])  # [n, end]
                    og = F.scaled_dot_product_attention(qg, keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end],
                                                        attn_mask=visible, enable_gqa=True)
                    out[span] = og[0].transpose(0, 1)
                    continue
                qg, kg, vg = (t[span].reshape(num, length, -1, s.head_dim).transpose(1, 2) for t in (q, k, v))
                og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
                out[span] = og.transpose(1, 2).reshape(num * length, s.num_heads, s.head_dim)
            return out

        hidden = self.decoder.forward(tokens, attend)
        last = torch.tensor(new).cumsum(0).to(device) - 1
        logits = self.decoder.logits(hidden[last])  # [R, V]
        rows = SamplingRows.build([r.sampling for r in reqs], seeds, s.vocab_size, device)
        length_t = torch.tensor(lengths, device=device)
        first, logprob = sample(logits, rows, length_t, mode=mode)
        index = torch.tensor(slots, device=device)
        self.state.tokens[index] = first
        self.state.positions[index] = length_t
        self.state.rows.assign(index, rows)
        return list(zip(first.tolist(), logprob.tolist()))

    # -- decode -----------------------------------------------------------------------
    def _step(self, key: tuple[int, Geometry, str, int | None]):
        """The decode step over slots [0, batch): it reads only the state, the cache, the weights
        and the rope tables (views of them), so a graph of it replays correctly for as long as
        those live. Torch attention reads cache positions [0, span); the fused kernels read each
        row's own length. Built once per key (DecodeGraphs keeps it with its graph)."""
        batch, geometry, mode, span = key
        st, s = self.state, self.spec
        device = st.tokens.device
        if self.fused:
            from roles.rollout.torch_engine.kernels import decode_attention, num_splits

            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = 1 if self.batch_invariant else num_splits(batch, s.num_kv_heads, geometry.slot_len, sms)
        else:
            group = s.num_heads // s.num_kv_heads
            key_positions = st.key_positions[:span]

        def step() -> None:
            tokens, positions, rows = st.tokens[:batch], st.positions[:batch], st.rows.head(batch)
            slot_ids = st.slot_ids[:batch]
            if self.fused:
                lengths = positions + 1

                def attend(layer: int, qkv: torch.Tensor) -> torch.Tensor:
                    keys, values = self.cache.layer(layer)
                    q = self.decoder.rope_and_store(layer, qkv, positions, slot_ids, keys, values)
                    return decode_attention(q, keys, values, lengths, splits=splits)
            else:
                cos, sin = self.decoder.rope_at(positions)
                visible = (key_positions[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, T]

                def attend(layer: int, qkv: torch.Tensor) -> torch.Tensor:
                    q, k, v = self.decoder.attention_inputs(layer, qkv, cos, sin)
                    keys, values = self.cache.layer(layer)
                    keys[slot_ids, :, positions] = k  # [B, KV, D]
                    values[slot_ids, :, positions] = v
                    # one query token per row: the G query heads of a kv head are G "query positions"
                    qg = q.reshape(batch, s.num_kv_heads, group, s.head_dim)
                    out = F.scaled_dot_product_attention(qg, keys[:batch, :, :span], values[:batch, :, :span],
                                                         attn_mask=visible)
                    return out.reshape(batch, s.num_heads, s.head_dim)

            hidden = self.decoder.forward(tokens, attend)
            new, logprob = sample(self.decoder.logits(hidden), rows, positions + 1, mode=mode)
            ring = (st.ring_index.expand(batch), slot_ids)
            st.ring_tokens.index_put_(ring, new)
            st.ring_logprobs.index_put_(ring, logprob)
            tokens.copy_(new)
            positions.add_(1)
            st.ring_index.add_(1)

        return step
