"""The built-in rollout backend: an HF causal LM, batched sampling with a KV cache.

Good for CPU runs, fake-GPU tests and small models on one GPU; production uses sglang.

Memory model (mirrors sglang's static pools so colocation behaves the same):
- "weights": the model's parameters. Releasing them offloads to pinned CPU memory on a
  real GPU (and only updates the ledger on fake GPUs / CPU); resuming brings them back.
  The weights are kept, not freed, so an engine resumed without a weight sync still
  serves the last weights it had.
- "kv_cache": a byte budget reserved while resumed. Each generate call splits its requests
  into batches whose KV cache fits the budget; the cache itself lives only for the call.
"""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from roles.device import DeviceMemory, nbytes_of
from roles.rollout.sampling import GenerateRequest, sample_next
from roles.weight_sync import checksum_named_tensors, dtype_name, unpack_bucket

TORCH_OPTIONS = frozenset({"attn_implementation"})


class TorchBackend:
    def __init__(
        self,
        hf_checkpoint: str,
        *,
        memory: DeviceMemory,
        dtype: str,
        max_batch_size: int,
        kv_cache_bytes: int | None,
        mem_fraction: float | None,
        options: dict,
    ):
        unknown = sorted(set(options) - TORCH_OPTIONS)
        if unknown:
            raise ValueError(f"backend 'torch': unknown options {unknown}; allowed: {sorted(TORCH_OPTIONS)}")
        self.memory = memory
        self.max_batch_size = max_batch_size
        model = AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=getattr(torch, dtype)).eval()
        if "attn_implementation" in options:
            model.set_attn_implementation(options["attn_implementation"])
        self.model = memory.move(model, "device", tag="weights")
        # transformers renamed forward's `past_key_values` to `cache` (5.2x); passing the
        # wrong name would silently drop the cache, so ask the signature.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        config = self.model.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_bytes_per_token = (
            2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * self.model.dtype.itemsize
        )
        self.kv_cache_bytes = self._kv_budget(kv_cache_bytes, mem_fraction)
        memory.account("kv_cache", self.kv_cache_bytes)

    def _kv_budget(self, kv_cache_bytes: int | None, mem_fraction: float | None) -> int:
        if kv_cache_bytes is not None and mem_fraction is not None:
            raise ValueError("backend 'torch': give kv_cache_bytes or mem_fraction, not both")
        if kv_cache_bytes is not None:
            return kv_cache_bytes
        if mem_fraction is not None:
            capacity = self.memory.capacity_bytes()
            if capacity is None:
                raise ValueError("mem_fraction needs a GPU or fake GPU to take a fraction of; "
                                 "on the CPU give kv_cache_bytes instead")
            budget = int(capacity * mem_fraction) - nbytes_of(self.model)
            if budget <= 0:
                raise ValueError(
                    f"mem_fraction={mem_fraction} of {capacity} bytes leaves no room for a KV cache "
                    f"after {nbytes_of(self.model)} bytes of weights; raise mem_fraction"
                )
            return budget
        # Default: room for max_batch_size sequences of the model's full context.
        return self.max_batch_size * self.model.config.max_position_embeddings * self.kv_bytes_per_token

    # -- memory -----------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        if "weights" in tags:
            self.model = self.memory.move(self.model, "cpu", tag="weights")
        if "kv_cache" in tags:
            self.memory.account("kv_cache", 0)
            if self.memory.kind == "cuda":
                torch.cuda.empty_cache()  # the last call's cache blocks go back to the driver

    def resume(self, tags: list[str]) -> None:
        if "weights" in tags:
            self.model = self.memory.move(self.model, "device", tag="weights")
        if "kv_cache" in tags:
            self.memory.account("kv_cache", self.kv_cache_bytes)

    def bytes_in_use(self) -> int:
        return self.memory.bytes_in_use()

    # -- weights ----------------------------------------------------------------------
    def load_weights(self, bucket: dict) -> int:
        """Copy the bucket's tensors into the model by HF name; all-or-nothing checks first."""
        named = unpack_bucket(bucket)
        targets = self.model.state_dict(keep_vars=True)  # fresh: offloading replaces buffers
        for name, tensor in named:
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"update_weights: unknown tensor {name!r}: the model has no parameter or "
                    f"persistent buffer of that name (HF names, e.g. {next(iter(targets))!r})"
                )
            if list(tensor.shape) != list(target.shape):
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {list(tensor.shape)}, "
                    f"the model's is {list(target.shape)}"
                )
            if tensor.dtype != target.dtype:
                raise ValueError(
                    f"update_weights: tensor {name!r} has dtype {dtype_name(tensor.dtype)}, "
                    f"the model's is {dtype_name(target.dtype)}; cast on the sender"
                )
        with torch.no_grad():
            for name, tensor in named:
                targets[name].copy_(tensor)  # blocking: the sender reuses the buffer after our ack
        return len(named)

    def finish_weight_update(self) -> None:
        """Nothing is cached across calls here, so a finished update needs no flush."""

    def weights_checksum(self) -> dict[str, str]:
        return checksum_named_tensors(self.model.state_dict().items())

    # -- generation -------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], seeds: list[int]) -> list[dict]:
        results: list[dict | None] = [None] * len(requests)
        for batch in self._plan_batches(requests):
            outs = self._generate_batch([requests[i] for i in batch], [seeds[i] for i in batch])
            for i, out in zip(batch, outs):
                results[i] = out
        return results

    def _plan_batches(self, requests: list[GenerateRequest]) -> list[list[int]]:
        """Group request indices so each batch's KV cache fits the budget.

        A left-padded batch caches (longest prompt + largest max_new_tokens) positions per
        row. Sorting by prompt length keeps padding small; results keep the input order.
        """
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        batches: list[list[int]] = []
        batch: list[int] = []
        prompt_len = new_len = 0
        for i in order:
            req = requests[i]
            alone = (len(req.prompt_ids) + req.sampling.max_new_tokens) * self.kv_bytes_per_token
            if alone > self.kv_cache_bytes:
                raise ValueError(
                    f"request id={req.id}: prompt {len(req.prompt_ids)} + max_new_tokens "
                    f"{req.sampling.max_new_tokens} tokens need {alone} bytes of KV cache, more than "
                    f"kv_cache_bytes={self.kv_cache_bytes}; raise kv_cache_bytes or shorten the request"
                )
            p, n = max(prompt_len, len(req.prompt_ids)), max(new_len, req.sampling.max_new_tokens)
            cost = (len(batch) + 1) * (p + n) * self.kv_bytes_per_token
            if batch and (len(batch) == self.max_batch_size or cost > self.kv_cache_bytes):
                batches.append(batch)
                batch, p, n = [], len(req.prompt_ids), req.sampling.max_new_tokens
            batch.append(i)
            prompt_len, new_len = p, n
        if batch:
            batches.append(batch)
        return batches

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerateRequest], seeds: list[int]) -> list[dict]:
        device = self.memory.device
        num_rows, width = len(requests), max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((num_rows, width), self.pad_id, dtype=torch.long)  # [B, P]
        mask = torch.zeros((num_rows, width), dtype=torch.long)  # [B, P], left padding
        for row, req in enumerate(requests):
            input_ids[row, width - len(req.prompt_ids):] = torch.tensor(req.prompt_ids)
            mask[row, width - len(req.prompt_ids):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]: real tokens count from 0
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        stops = [
            frozenset() if r.sampling.ignore_eos else frozenset(r.sampling.stop_token_ids) | self.eos_ids
            for r in requests
        ]
        tokens_out: list[list[int]] = [[] for _ in requests]
        logprobs_out: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * num_rows

        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions,
            use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache},
        ).logits[:, -1].float()  # [B, V]
        alive = list(range(num_rows))  # request row of each batch row still generating
        next_pos = positions[:, -1] + 1  # [B]
        while True:
            tokens, logprobs = sample_next(
                logits, [requests[r].sampling for r in alive], [generators[r] for r in alive]
            )
            keep = []
            for j, (row, tok, lp) in enumerate(zip(alive, tokens.tolist(), logprobs.tolist())):
                tokens_out[row].append(tok)
                logprobs_out[row].append(lp)
                if len(tokens_out[row]) >= requests[row].sampling.max_new_tokens:
                    finish[row] = "length"  # checked before stop tokens, as sglang does
                elif tok in stops[row]:
                    finish[row] = "stop"
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(alive):  # finished rows leave the batch and the cache
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, next_pos, tokens = mask[index], next_pos[index], tokens[index]
                alive = [alive[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
            logits = self.model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                use_cache=True, **{self._cache_kwarg: cache},
            ).logits[:, -1].float()
            next_pos = next_pos + 1
        return [
            {"id": r.id, "token_ids": tokens_out[i], "logprobs": logprobs_out[i], "finish_reason": finish[i]}
            for i, r in enumerate(requests)
        ]
