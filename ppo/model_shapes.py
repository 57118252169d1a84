"""The HF config fields of the models this repo makes, as plain dicts: the tiny character-level
Qwen3 (ppo.tiny_model builds it) and the architectures `python -m ppo.make_model` writes
(`ARCHS`). Neither torch nor transformers is imported here, so that `launch.py --dry-run` sizes
its memory plan (ppo.gpu.sizing.plan_spec) in a fraction of a second."""

from __future__ import annotations

import string

# Ids 0..3 are fixed so tests and recipes can name them without loading the tokenizer.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
TOKEN_CHARS = string.digits + "+-*=() " + string.ascii_lowercase


def tiny_vocab() -> dict[str, int]:
    """Token -> id for the tiny model's character-level tokenizer (specials first, then
    `TOKEN_CHARS`)."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(TOKEN_CHARS))}


def tiny_config_fields(*, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                       head_dim: int = 16, intermediate_size: int = 128, max_position_embeddings: int = 64,
                       tie_word_embeddings: bool = False, vocab_size: int | None = None) -> dict:
    """The config.json fields of the tiny model with these sizes; `vocab_size` defaults to its
    tokenizer's (ppo.tiny_model.tiny_config makes the Qwen3Config of them)."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} "
            "(grouped-query attention shares each kv head among num_heads/num_kv_heads heads)"
        )
    return dict(model_type="qwen3", vocab_size=len(tiny_vocab()) if vocab_size is None else vocab_size,
                hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="float32")


TOKENIZER_VOCAB = 8192  # ppo.make_model's BPE tokenizer's size, its specials included

# Qwen3-4B's config.json as Qwen publishes it (the fields that shape the model).
ARCHS: dict[str, dict] = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
ARCHS["qwen3-4b-rm"] = dict(ARCHS["qwen3-4b"], tie_word_embeddings=False)  # no LM head to tie
# a reward model small enough for a test or a CPU run, with the BPE tokenizer's vocabulary
ARCHS["qwen3-tiny-rm"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=TOKENIZER_VOCAB,
                              max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
REWARD_MODELS = frozenset({"qwen3-4b-rm", "qwen3-tiny-rm"})  # one-label sequence classifiers
