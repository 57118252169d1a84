"""The tiny checkpoint is a normal HF directory: it loads through the Auto* paths and generates."""

import hashlib
import json
import os

import pytest
import torch

from ppo.model_shapes import BOS_ID, EOS_ID, PAD_ID, TOKEN_CHARS
from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm, load_tokenizer


def _weights_digest(path):
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_checkpoint_is_a_normal_hf_directory(ckpt):
    names = set(os.listdir(ckpt))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    model = load_causal_lm(ckpt, "float32")
    assert model.config.model_type == "qwen3"
    assert (model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id) == (
        PAD_ID, EOS_ID, BOS_ID,
    )
    gen = model.generation_config
    assert (gen.pad_token_id, gen.eos_token_id, gen.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)


def test_tokenizer_ids_round_trip(ckpt):
    tok = load_tokenizer(ckpt)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
    text = "(12+7)*3 = 57 minus x"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, spaces included
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(TOKEN_CHARS, add_special_tokens=False)) == TOKEN_CHARS
    assert len(set(tok.encode(TOKEN_CHARS, add_special_tokens=False))) == len(TOKEN_CHARS)
    assert tok.decode(tok.encode("Ab?", add_special_tokens=False)) == "ab<unk>"


def test_loads_in_bfloat16_and_generates_one_token(ckpt):
    tok = load_tokenizer(ckpt)
    model = load_causal_lm(ckpt, "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = torch.tensor([tok.encode("1+2=", add_special_tokens=False)])
    out = model.generate(prompt, max_new_tokens=1, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 1)
    logits = model(prompt).logits[0, -1]
    assert out[0, -1].item() == logits.argmax().item()
    assert 0 <= out[0, -1].item() < len(tok)


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = build_tiny_checkpoint(str(tmp_path / "a"), seed=3)
    b = build_tiny_checkpoint(str(tmp_path / "b"), seed=3)
    c = build_tiny_checkpoint(str(tmp_path / "c"), seed=4)
    assert _weights_digest(a) == _weights_digest(b)
    assert _weights_digest(a) != _weights_digest(c)


def test_building_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_checkpoint(str(tmp_path / "x"), seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_tied_embeddings_and_bad_heads(tmp_path):
    model = load_causal_lm(build_tiny_checkpoint(str(tmp_path / "t"), tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_checkpoint(str(tmp_path / "bad"), num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize(("task", "digits"), [("arithmetic", 1), ("column_sums", 2), ("column_sums_small", 2)])
def test_the_warm_start_teaches_answers_of_the_tasks_length_and_no_more(tmp_path, task, digits):
    """ppo.setup.generated's warm start: a generated task's prompts get `answer_digits` digits, then EOS."""
    from ppo.config import override
    from ppo.setup.generated import resolve_paths
    from ppo.config.recipes import tiny_ppo

    ckpt, data = resolve_paths(override(tiny_ppo(), prompt_data=f"generated:{task}"), tmp_path)
    model, tok = load_causal_lm(ckpt, "float32"), load_tokenizer(ckpt)
    prompt = json.loads(open(data).readline())["prompt"]
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)] * 64)
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=digits + 2, do_sample=True, pad_token_id=PAD_ID)[:, ids.shape[1]:]
    answers = [row.tolist()[:digits + 1] for row in out]
    assert sum(a[-1] == EOS_ID and all(tok.decode([t]).isdigit() for t in a[:-1]) for a in answers) >= 60
    assert len({tuple(a) for a in answers}) >= 6  # the digits are still a guess
