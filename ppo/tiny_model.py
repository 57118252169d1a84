"""Tiny Qwen3 checkpoints for tests and CPU runs, and the loaders shared with real checkpoints.

`build_tiny_checkpoint` writes an ordinary Hugging Face checkpoint directory (config.json,
generation_config.json, model.safetensors, tokenizer files) with random weights, so every
code path that loads Qwen3-4B from disk is exercised unchanged by the tests. Nothing is
downloaded.

The tokenizer is character level: one token per character of `TOKEN_CHARS`, plus the
specials in `SPECIAL_TOKENS` (both in ppo.model_shapes, beside the config's fields). Text is
lower-cased before encoding (the vocabulary has only lower-case letters) and any other
character becomes `<unk>`, so encoding never fails.
"""

from __future__ import annotations

import os

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)

from ppo.model_shapes import BOS_ID, EOS_ID, PAD_ID, tiny_config_fields, tiny_vocab

# A reward model reads the conversation through its chat template; the tiny one's uses only
# characters of the vocabulary: "u 1+1= a 2 ".
TINY_CHAT_TEMPLATE = "{%- for m in messages %}{{ m['role'][0] + ' ' + m['content'] + ' ' }}{%- endfor %}"


def _build_tokenizer(model_max_length: int, extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    vocab = tiny_vocab()
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra_tokens)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # Every character is its own pre-token, spaces included, so WordLevel sees single chars.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without inserting spaces
    # extra tokens are matched whole in the raw text, before the normaliser and the split
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",  # generation batches are left-padded
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def tiny_config(**sizes) -> Qwen3Config:
    """The HF config of the tiny model `build_tiny_checkpoint` writes with the same sizes
    (ppo.model_shapes.tiny_config_fields: hidden_size, num_layers, ... vocab_size)."""
    return Qwen3Config(**tiny_config_fields(**sizes))


def build_tiny_checkpoint(
    out_dir: str,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 64,
    tie_word_embeddings: bool = False,
    reward_model: bool = False,
    extra_tokens: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> str:
    """Write a randomly initialised Qwen3 causal LM and its tokenizer to `out_dir`; return the path.
    With `reward_model`, a Qwen3 sequence classifier with one label (an untrained Bradley-Terry
    reward model, roles.reward.model) whose tokenizer has a chat template. `extra_tokens`: whole
    tokens after the characters (ids from len(tiny_vocab()) on), e.g. tool-call markup;
    `chat_template`: the tokenizer's (a causal LM's has none unless given).

    The same `seed` and sizes always give byte-identical weights. The global torch RNG is
    left untouched. Weights are stored in float32; pick the compute dtype when loading.
    """
    tokenizer = _build_tokenizer(max_position_embeddings, extra_tokens)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = tiny_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                         vocab_size=len(tokenizer))
    if reward_model:
        config.num_labels = 1
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (Qwen3ForSequenceClassification if reward_model else Qwen3ForCausalLM)(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of an HF checkpoint directory (tiny or real)."""
    return AutoTokenizer.from_pretrained(path)


def load_causal_lm(path: str, dtype: str | torch.dtype = "float32") -> PreTrainedModel:
    """Load an HF causal LM from a checkpoint directory on the CPU, in eval mode."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating torch dtype, e.g. 'float32' or 'bfloat16'")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
