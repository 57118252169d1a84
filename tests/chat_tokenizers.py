"""Byte-level BPE tokenizers built here, with the real chat templates of two model families
(tests/fixtures/chat_templates): the shape of Qwen3's and Llama 3's tokenizers (byte-level BPE
with merges, so text decoded and encoded again can come back as other ids; the markup as
whole special tokens), small enough to train in a fraction of a second."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["the answer is 42", "let me think about the sum", '{"name": "calc", "arguments": {"expr": "1+2"}}',
          "You may call one or more functions to assist with the user query.", "hello there, how are you?",
          "system user assistant tool response function parameters"] * 20


def _bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(QWEN3_SPECIALS), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return tok


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=_bpe(LLAMA3_SPECIALS), bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", pad_token="<|end_of_text|>")
    tok.chat_template = (TEMPLATES / "llama3_2.jinja").read_text()
    return tok
