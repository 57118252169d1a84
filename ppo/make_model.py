"""Write an UNTRAINED checkpoint of a named architecture, and math prompts, with no model hub.

    python -m ppo.make_model --arch qwen3-4b OUT_DIR
    python -m ppo.make_model --arch qwen3-4b-rm OUT_DIR    # a reward model (--reward-model-path)

OUT_DIR becomes an ordinary Hugging Face checkpoint directory (config.json,
generation_config.json, model.safetensors, tokenizer files with a chat template, and a
README.md saying it is untrained) with random-init weights of the architecture's shape,
and OUT_DIR/dapo_math_prompts.jsonl holds locally generated prompts in the DAPO-Math-17k
format (ppo.prompts.dapo). `qwen3_4b_ppo` then runs on a machine without downloads:

    python launch.py --recipe qwen3_4b_ppo --hf-checkpoint OUT_DIR \\
        --prompt-data OUT_DIR/dapo_math_prompts.jsonl ...

The model's answers are noise, so the rewards stay at their floor: the checkpoint is for
measuring the pipeline (memory, handoffs, throughput), not for learning curves. Its
tokenizer is a byte-level BPE trained on the generated prompts (every text encodes; fewer
tokens than Qwen's own). `--override key=value` changes the architecture's config (tests
write a small model through this same code); `parameter_count` sizes an architecture on
the meta device without allocating its weights. The `-rm` architectures are reward models:
a sequence classifier with one label (a score head in place of the LM head), as
`--reward-model-path` reads them (roles.reward.model); untrained, their scores are noise too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig,
                          PreTrainedTokenizerFast, Qwen3Config)

from ppo.model_shapes import ARCHS, REWARD_MODELS, TOKENIZER_VOCAB
from ppo.prompts.dapo import dapo_math_records, write_dapo_math_prompts
from roles.model_spec import ModelSpec

# Qwen's special tokens; <|im_end|> ends a chat turn, and so a response.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
PROMPTS_FILE = "dapo_math_prompts.jsonl"


def arch_config(arch: str, overrides: dict | None = None) -> Qwen3Config:
    """The HF config of `arch` with `overrides` (config field -> value) applied, refused (before
    minutes of random init) when the engine and trainers would refuse it (roles.model_spec)."""
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is unknown; known: {', '.join(ARCHS)}")
    fields = {**ARCHS[arch], **(overrides or {})}
    unknown = sorted(set(fields) - set(Qwen3Config().to_dict()) - {"rope_theta"})
    if unknown:
        raise ValueError(f"--override {unknown[0]}: not a field of Qwen3Config")
    config = Qwen3Config(**fields)
    if arch in REWARD_MODELS:
        config.num_labels = 1
    try:
        ModelSpec.from_hf(config)
    except ValueError as e:
        raise ValueError(f"--arch {arch} with --override {overrides}: {e}") from None
    return config


def model_class(config: Qwen3Config):
    """A reward model's (one label) sequence-classifier class, else the causal LM's."""
    return AutoModelForSequenceClassification if config.num_labels == 1 else AutoModelForCausalLM


def parameter_count(config: Qwen3Config) -> int:
    """Parameters of the model (tied weights once), built on the meta device: no memory."""
    with torch.device("meta"):
        model = model_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_tokenizer(texts: list[str], *, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` (any text encodes), Qwen's specials first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                  clean_up_tokenization_spaces=False, model_max_length=max_length)
    out.chat_template = CHAT_TEMPLATE
    return out


def write_checkpoint(out_dir: str | os.PathLike, *, arch: str, overrides: dict | None = None, seed: int = 0,
                     dtype: str = "bfloat16", num_prompts: int = 2048, device: str = "cpu") -> dict:
    """Write the untrained checkpoint and the prompts to `out_dir`; returns a summary.
    `device`: where the random init runs ("cuda": seconds instead of minutes at 4B)."""
    out = Path(out_dir)
    config = arch_config(arch, overrides)
    records = dapo_math_records(num_prompts, seed)
    texts = [m["content"] for r in records for m in r["prompt"]] + [r["label"] for r in records]
    tokenizer = build_tokenizer(texts, max_length=config.max_position_embeddings)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"vocab_size={config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    eos, pad = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = eos, pad, None
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = model_class(config).from_config(config, dtype=getattr(torch, dtype))
    if model.can_generate():
        model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    prompts = write_dapo_math_prompts(out / PROMPTS_FILE, num_prompts=num_prompts, seed=seed)
    summary = {"path": str(out), "arch": arch, "parameters": num_params, "dtype": dtype, "seed": seed,
               "overrides": overrides or {}, "prompts": prompts, "trained": False}
    (out / "README.md").write_text(_readme(summary, config))
    return summary


def _readme(summary: dict, config: Qwen3Config) -> str:
    shape = {k: getattr(config, k) for k in ARCHS[summary["arch"]] if hasattr(config, k)}
    return (
        f"# UNTRAINED {summary['arch']}-shaped checkpoint\n\n"
        f"Random-init weights (seed {summary['seed']}, {summary['dtype']}, {summary['parameters']:,} parameters) "
        "written by `python -m ppo.make_model` from the architecture's config, not a trained model: "
        "its outputs are noise and rewards stay at their floor. Use it to run and measure the pipeline "
        "(memory, handoffs, throughput) where no model can be downloaded.\n\n"
        "The tokenizer is a byte-level BPE trained on the generated prompts, not Qwen's.\n\n"
        f"Shape: `{json.dumps(shape)}`\n\nOverrides: `{json.dumps(summary['overrides'])}`\n\n"
        f"Prompts (DAPO-Math-17k format, generated): `{Path(summary['prompts']).name}`\n")


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--override {text!r} must be KEY=VALUE, e.g. num_hidden_layers=2")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppo.make_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="checkpoint directory to write")
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--override", type=_parse_override, action="append", default=[], metavar="KEY=VALUE",
                        help="change one config field (e.g. num_hidden_layers=2); repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=2048)
    parser.add_argument("--device", default="cpu", help="where to run the random init (cuda is much faster)")
    args = parser.parse_args(argv)
    transformers.logging.disable_progress_bar()
    try:
        config = arch_config(args.arch, dict(args.override))
    except ValueError as e:
        parser.error(str(e))
    size = parameter_count(config) * torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    print(f"writing an UNTRAINED {args.arch}-shaped checkpoint (random init, {size / 1e9:.1f} GB) "
          f"to {args.out_dir}", flush=True)
    summary = write_checkpoint(args.out_dir, arch=args.arch, overrides=dict(args.override), seed=args.seed,
                               dtype=args.dtype, num_prompts=args.num_prompts, device=args.device)
    print(f"wrote an UNTRAINED checkpoint: {summary['parameters']:,} random-init parameters in {summary['path']} "
          f"(its answers are noise; see README.md there); prompts: {summary['prompts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
