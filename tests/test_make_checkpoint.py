"""ppo.make_model: an untrained Qwen3-4B-shaped checkpoint and DAPO-format prompts,
with no hub. CI writes a small shape through the same code; the full shape is checked on
the meta device (no 8 GB written)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo.prompts.dataset import PromptDataset
from ppo.make_model import PROMPTS_FILE, arch_config, main, parameter_count
from roles.reward.rules import REWARD_RULES

SMALL = ["hidden_size=64", "intermediate_size=128", "num_hidden_layers=2", "num_attention_heads=4",
         "num_key_value_heads=2", "head_dim=16", "vocab_size=8704", "max_position_embeddings=1024"]


def test_qwen3_4b_config_and_size_without_weights():
    c = arch_config("qwen3-4b")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (36, 2560, 32, 8, 128, 9728, 151936, 40960)
    assert c.rope_parameters["rope_theta"] == 1e6 and c.rms_norm_eps == 1e-6 and c.tie_word_embeddings
    assert parameter_count(c) == 4_022_468_096  # Qwen3-4B's 4.02B, the tied embedding counted once
    with pytest.raises(ValueError, match="not a field of Qwen3Config"):
        arch_config("qwen3-4b", {"hiden_size": 3})
    # what the engine and trainers refuse (roles.model_spec) is refused before the random init
    with pytest.raises(ValueError, match=r"--override \{'hidden_act': 'gelu'\}: qwen3 with hidden_act='gelu' is not"):
        arch_config("qwen3-4b", {"hidden_act": "gelu"})


@pytest.mark.timeout(300)
def test_writes_an_untrained_checkpoint_that_loads_and_says_so(tmp_path, capsys):
    out = tmp_path / "qwen3-4b-small"
    assert main(["--arch", "qwen3-4b", str(out), "--num-prompts", "64", "--seed", "3",
                 *[a for o in SMALL for a in ("--override", o)]]) == 0
    printed = capsys.readouterr().out
    assert "UNTRAINED" in printed and str(out) in printed
    assert "UNTRAINED" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as Qwen3-4B
    assert model.config.rope_parameters["rope_theta"] == 1e6  # the architecture's other numbers stay
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) <= model.config.vocab_size and tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id == model.config.eos_token_id
    # the prompts read as the recipe reads DAPO-Math-17k: chat messages, integer labels
    data = PromptDataset(str(out / PROMPTS_FILE), input_key="prompt", label_key="label", tokenizer=tok,
                         apply_chat_template=True, max_prompt_len=1024, seed=0, shuffle=True)
    batch = data.next_batch(8)
    assert all(s["prompt"].startswith("<|im_start|>user\nSolve the following math problem") for s in batch)
    assert all(s["prompt"].endswith("<|im_start|>assistant\n") for s in batch)
    assert all(str(int(s["label"])) == s["label"] for s in batch)
    assert tok.decode(batch[0]["prompt_ids"]) == batch[0]["prompt"]  # byte-level: every text round-trips
    label = batch[0]["label"]
    assert REWARD_RULES["dapo"](f"so\nAnswer: {label}", label) == 1.0
    with torch.no_grad():  # it runs (and its answers are noise)
        logits = model(torch.tensor([batch[0]["prompt_ids"]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits.float()).all()
    # same seed, same weights
    again = tmp_path / "again"
    main(["--arch", "qwen3-4b", str(again), "--num-prompts", "64", "--seed", "3",
          *[a for o in SMALL for a in ("--override", o)]])
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert json.loads((again / "config.json").read_text()) == json.loads((out / "config.json").read_text())


def test_reward_model_archs_write_a_one_label_classifier_the_scorer_accepts(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from roles.reward.model import checkpoint_problem

    # Qwen3-4B's backbone with a one-label score head in place of its tied LM head
    assert parameter_count(arch_config("qwen3-4b-rm")) == 4_022_468_096 + 2560
    out = tmp_path / "tiny-rm"
    assert main(["--arch", "qwen3-tiny-rm", str(out), "--num-prompts", "64"]) == 0
    assert checkpoint_problem(str(out)) is None
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.score.weight.shape == (1, 64)
    assert AutoTokenizer.from_pretrained(out).chat_template  # the conversation it scores
