"""PromptDataset (jsonl prompts, errors with line numbers, seeded resumable epochs) and generated tasks."""

import json
from collections import Counter
from pathlib import Path

import pytest

from ppo.prompts.dataset import PromptDataset
from ppo.prompts.tasks import ARITHMETIC_CHARSET, TASKS, write_arithmetic_task
from roles.reward.rules import REWARD_RULES


class CharTokenizer:
    """One id per character; a chat template in the style of Qwen's, without special tokens."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False  # prompts are tokenized as they will be sent
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        assert tokenize is False and add_generation_prompt is True
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + "<assistant>"


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def numbered(tmp_path, n=10) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"q{i}", "label": str(i)} for i in range(n)])


def test_reads_prompts_labels_and_metadata(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "1+1=", "label": "2", "meta": {"rm_type": "tiny_exact"}},
            "",  # blank lines are ignored
            {"prompt": "2+2=", "label": 4, "meta": json.dumps({"source": "x"})},
            {"prompt": "3+3=", "label": "6"},
        ],
    )
    data = PromptDataset(path, metadata_key="meta", tokenizer=CharTokenizer(), shuffle=False)
    assert len(data) == 3
    batch = data.next_batch(3)
    assert batch[0] == {
        "prompt": "1+1=", "prompt_ids": [49, 43, 49, 61], "label": "2", "metadata": {"rm_type": "tiny_exact"}
    }
    assert batch[1]["label"] == "4" and batch[1]["metadata"] == {"source": "x"}
    assert batch[2]["metadata"] == {}


def test_without_tokenizer_prompt_ids_are_none(tmp_path):
    batch = PromptDataset(numbered(tmp_path), shuffle=False).next_batch(1)
    assert batch == [{"prompt": "q0", "prompt_ids": None, "label": "0", "metadata": {}}]


def test_chat_message_prompts_use_the_chat_template(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "label": "5"}, {"prompt": "7+1=", "label": "8"}])
    data = PromptDataset(path, tokenizer=CharTokenizer(), apply_chat_template=True, shuffle=False)
    first, second = data.next_batch(2)
    assert first["prompt"] == "<system>be brief</system><user>2+3=</user><assistant>"
    assert first["prompt_ids"] == [ord(c) for c in first["prompt"]]
    assert second["prompt"] == "<user>7+1=</user><assistant>"  # a string prompt is one user message
    # the messages stay beside the text: a reward model reads them with its own template (ppo.generate.rewards)
    assert first["messages"] == messages and second["messages"] == [{"role": "user", "content": "7+1="}]
    assert "messages" not in PromptDataset(numbered(tmp_path), tokenizer=CharTokenizer(), shuffle=False).next_batch(1)[0]


def test_chat_messages_without_chat_template_name_the_line(tmp_path):
    lines = [{"prompt": "ok", "label": "1"}, {"prompt": [{"role": "user", "content": "x"}], "label": "1"}]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: .*apply_chat_template=True"):
        PromptDataset(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x", "label": ', "malformed JSON"),
        ('["prompt", "label"]', "expected a JSON object"),
        ('{"question": "x", "label": "1"}', "missing prompt key 'prompt'"),
        ('{"prompt": "x"}', "missing label key 'label'"),
        ('{"prompt": "   ", "label": "1"}', "empty prompt"),
        ('{"prompt": [], "label": "1"}', "empty prompt"),
        ('{"prompt": [{"role": "user"}], "label": "1"}', "string 'role' and 'content'"),
        ('{"prompt": 5, "label": "1"}', "string or a chat message list"),
        ('{"prompt": "x", "label": null}', "label must be a string or a number"),
        ('{"prompt": "x", "label": "1", "meta": "not json"}', "not JSON"),
        ('{"prompt": "x", "label": "1", "meta": [1]}', "must be an object"),
        ('{"prompt": "' + "y" * 20 + '", "label": "1"}', "20 tokens, more than max_prompt_len=8"),
    ],
)
def test_bad_line_raises_with_file_and_line_number(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "label": "1"}, "", line])
    with pytest.raises(ValueError, match="bad.jsonl:3: ") as err:
        PromptDataset(path, metadata_key="meta", tokenizer=CharTokenizer(), max_prompt_len=8, apply_chat_template=False)
    assert message in str(err.value)


def test_skip_bad_samples_counts_and_keeps_the_rest(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "a", "label": "1"},
            "{broken",
            {"prompt": "", "label": "2"},
            {"prompt": "b", "label": "3"},
            {"prompt": "c"},
        ],
    )
    data = PromptDataset(path, skip_bad_samples=True, shuffle=False)
    assert len(data) == 2 and data.num_skipped == 3
    assert [line for line, _ in data.skipped] == [2, 3, 5]
    assert "malformed JSON" in data.skipped[0][1]
    assert [s["prompt"] for s in data.next_batch(2)] == ["a", "b"]


def test_invalid_utf8_line_is_named(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "\xff", "label": "1"}\n')
    with pytest.raises(ValueError, match=r"bytes\.jsonl:2: not UTF-8"):
        PromptDataset(path)


def test_all_lines_bad_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "allbad.jsonl", ["{", "{"])
    with pytest.raises(ValueError, match=r"no usable samples \(2 lines skipped\)"):
        PromptDataset(path, skip_bad_samples=True)


def test_missing_file_and_bad_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="apply_chat_template=True needs a tokenizer"):
        PromptDataset(numbered(tmp_path), apply_chat_template=True)
    with pytest.raises(ValueError, match="max_prompt_len=4 needs a tokenizer"):
        PromptDataset(numbered(tmp_path), max_prompt_len=4)
    with pytest.raises(ValueError, match="max_prompt_len=0"):
        PromptDataset(numbered(tmp_path), tokenizer=CharTokenizer(), max_prompt_len=0)
    with pytest.raises(ValueError, match="seed=-1"):
        PromptDataset(numbered(tmp_path), seed=-1)
    with pytest.raises(ValueError, match="n=0"):
        PromptDataset(numbered(tmp_path)).next_batch(0)


def test_label_key_none_gives_unlabelled_samples(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [{"text": "hello"}])
    assert PromptDataset(path, input_key="text", label_key=None).next_batch(1)[0]["label"] is None


def test_epochs_visit_every_sample_once_in_a_seeded_order(tmp_path):
    data = PromptDataset(numbered(tmp_path), seed=3)
    first = [s["label"] for s in data.next_batch(10)]
    second = [s["label"] for s in data.next_batch(10)]
    assert sorted(first) == sorted(second) == sorted(str(i) for i in range(10))
    assert first != second  # reshuffled per epoch
    assert first != [str(i) for i in range(10)]
    assert data.epoch == 2
    again = PromptDataset(numbered(tmp_path), seed=3)
    assert [s["label"] for s in again.next_batch(20)] == first + second
    other_seed = PromptDataset(numbered(tmp_path), seed=4)
    assert [s["label"] for s in other_seed.next_batch(10)] != first


def test_unshuffled_order_is_file_order_and_batches_cross_epochs(tmp_path):
    data = PromptDataset(numbered(tmp_path, n=3), shuffle=False)
    assert [s["label"] for s in data.next_batch(7)] == ["0", "1", "2", "0", "1", "2", "0"]
    assert data.epoch == 2


def test_resume_continues_with_exactly_the_same_prompts(tmp_path):
    path = numbered(tmp_path, n=7)
    reference = PromptDataset(path, seed=11)
    expected = [s["prompt"] for s in reference.next_batch(40)]

    first_run = PromptDataset(path, seed=11)
    seen = [s["prompt"] for s in first_run.next_batch(3)] + [s["prompt"] for s in first_run.next_batch(9)]
    state = json.loads(json.dumps(first_run.state_dict()))  # checkpoints store it as JSON
    resumed = PromptDataset(path, seed=11)
    resumed.load_state_dict(state)
    seen += [s["prompt"] for s in resumed.next_batch(28)]
    assert seen == expected


def test_resume_refuses_other_data_or_seed(tmp_path):
    state = PromptDataset(numbered(tmp_path, n=7), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptDataset(numbered(tmp_path, n=7), seed=2).load_state_dict(state)
    changed = write_jsonl(tmp_path / "changed.jsonl", [{"prompt": f"other{i}", "label": "0"} for i in range(7)])
    with pytest.raises(ValueError, match="fingerprint"):
        PromptDataset(changed, seed=1).load_state_dict(state)


def test_batches_are_copies(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "label": "1", "meta": {"tags": ["x"]}}])
    data = PromptDataset(path, metadata_key="meta", tokenizer=CharTokenizer())
    sample = data.next_batch(1)[0]
    sample["prompt_ids"].append(0)
    sample["metadata"]["tags"].append("y")
    assert data.next_batch(1)[0] == {"prompt": "a", "prompt_ids": [97], "label": "1", "metadata": {"tags": ["x"]}}


def test_arithmetic_task_is_deterministic_and_correct(tmp_path):
    ops = ("+", "-", "*")
    path = write_arithmetic_task(tmp_path / "sub" / "a.jsonl", num_prompts=50, seed=7, max_operand=9, ops=ops)
    again = write_arithmetic_task(tmp_path / "b.jsonl", num_prompts=50, seed=7, max_operand=9, ops=ops)
    assert Path(path).read_text() == Path(again).read_text()
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert len(records) == 50
    for record in records:
        prompt = record["prompt"]
        assert prompt.endswith("=") and set(prompt + record["label"]) <= set(ARITHMETIC_CHARSET)
        left, op, right = prompt[0], prompt[1], prompt[2:-1]
        assert record["label"] == str(eval(f"{left}{op}{right}"))  # the grammar is "A<op>B=" with one-digit operands
    assert {r["prompt"][1] for r in records} == {"+", "-", "*"}
    different = write_arithmetic_task(tmp_path / "c.jsonl", num_prompts=50, seed=8)
    assert Path(different).read_text() != Path(path).read_text()


def test_arithmetic_task_loads_and_grades(tmp_path):
    task = TASKS["arithmetic"]
    path = task.write(tmp_path / "t.jsonl", num_prompts=20, seed=0)
    data = PromptDataset(path, tokenizer=CharTokenizer())
    rule = REWARD_RULES[task.rm_type]
    for sample in data.next_batch(20):
        assert rule(sample["label"], sample["label"]) == 1.0
        assert rule(sample["label"] + "1", sample["label"]) == 0.0


def test_column_sum_task_draws_answers_evenly_and_grades_digit_by_digit(tmp_path):
    task = TASKS["column_sums"]
    path = task.write(tmp_path / "c.jsonl", num_prompts=3000, seed=1)
    assert Path(path).read_text() == Path(task.write(tmp_path / "d.jsonl", num_prompts=3000, seed=1)).read_text()
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    for record in records:
        a, b = (int(x) for x in record["prompt"].removesuffix("=").split("+"))
        assert 10 <= a <= 44 and 10 <= b <= 44 and a % 10 + b % 10 <= 8  # no carry
        assert record["label"] == str(a + b) and len(record["label"]) == task.answer_digits
        assert set(record["prompt"] + record["label"]) <= set(task.charset)
    counts = Counter(r["label"] for r in records)
    assert len(counts) == 7 * 9  # tens 2..8, units 0..8
    assert max(counts.values()) < 2 * min(counts.values())  # each answer about 3000 / 63 times
    rule = REWARD_RULES[task.rm_type]
    assert [rule(x, "64") for x in ("64", "65", "15", "6")] == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_prompts": 0}, "num_prompts=0"),
        ({"max_operand": -1}, "max_operand=-1"),
        ({"ops": ("/",)}, "ops=('/',)"),
        ({"ops": ()}, "ops=()"),
    ],
)
def test_arithmetic_task_rejects_bad_arguments(tmp_path, kwargs, message):
    args = {"num_prompts": 5, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        write_arithmetic_task(tmp_path / "x.jsonl", **args)
