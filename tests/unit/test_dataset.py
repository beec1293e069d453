"""Prompt loading (every shared data file, every file format), prompt formatting, and the prompt sampler."""
from __future__ import annotations

import json
import os

import pytest

from sparserl.data.dataset import PromptRow, answer_to_str, format_prompt, load_prompts
from sparserl.data.prompt_sampler import PromptSampler
from tests.conftest import data_file

# file -> (prompt_key, answer_key, answer_extract, rows, answer of row 0)
SHARED = {
    "train/simplelr_qwen_level3to5.jsonl": ("prompt", "label", "none", 8523, "118"),
    "train/simplelr_level3to5.jsonl": ("prompt", "label", "none", 8523, "118"),
    "eval/gsm8k.jsonl": ("question", "answer", "gsm8k_hash", 1319, "18"),
    "eval/math500.jsonl": ("problem", "answer", "none", 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
    "eval/aime24.jsonl": ("problem", "answer", "none", 30, None),
    "eval/amc23.jsonl": ("problem", "answer", "none", 40, "27"),
    "eval/minerva_math.jsonl": ("problem", "solution", "boxed", 272, None),
    "eval/olympiadbench.jsonl": ("question", "final_answer", "none", 675, None),
    "eval/gaokao2023en.jsonl": ("question", "answer", "none", 385, "$\\{x|-2\\leq x < 1\\}$"),
    "eval/mawps.jsonl": ("input", "target", "none", 2065, "43"),
}

# Rows whose answer field is blank in the data itself: they load with answer None.
BLANK_ANSWERS = {
    "eval/gaokao2023en.jsonl": [167, 192],
    "train/simplelr_level3to5.jsonl": [5054, 5158],
    "train/simplelr_qwen_level3to5.jsonl": [5054, 5158],
}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_every_shared_file_loads(name):
    prompt_key, answer_key, extract, n, first_answer = SHARED[name]
    rows = load_prompts(str(data_file(name)), prompt_key=prompt_key, answer_key=answer_key, answer_extract=extract)
    assert len(rows) == n
    assert [r.index for r in rows[:3]] == [0, 1, 2]
    missing = [r.index for r in rows if r.answer is None]
    assert missing == BLANK_ANSWERS.get(name, []), missing
    for r in rows:
        assert r.answer is None or (isinstance(r.answer, str) and r.answer.strip()), (name, r.index, r.answer)
        assert isinstance(r.prompt, (str, list)) and len(r.prompt) > 0
        assert prompt_key not in r.extra and answer_key not in r.extra
    if first_answer is not None:
        assert rows[0].answer == first_answer
    if name.endswith("simplelr_level3to5.jsonl"):
        assert rows[0].prompt[0]["role"] == "system" and rows[0].prompt[-1]["role"] == "user"
    if "qwen" in name:
        assert rows[0].prompt.startswith("<|im_start|>system")
    if "gsm8k" in name:
        assert all("####" not in r.answer and r.answer.lstrip("-").isdigit() for r in rows)
    if "minerva" in name:
        assert "\\boxed" not in rows[0].answer and len(rows[0].answer) < 40
    if "math500" in name:
        assert {"solution", "level", "subject"} <= set(rows[0].extra)


def test_answer_to_str():
    assert answer_to_str(27.0) == "27" and answer_to_str(2.5) == "2.5" and answer_to_str(7) == "7"
    assert answer_to_str(["$3$"]) == "$3$" and answer_to_str(["1", "2"]) == "1, 2"
    assert answer_to_str(None) is None and answer_to_str([]) is None and answer_to_str("  ") is None


def test_row_without_prompt_names_file_and_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [{"prompt": "1+1?", "answer": 2}, {"prompt": "2+2?", "answer": 4}, {"question": "3+3?", "answer": 6}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    with pytest.raises(ValueError, match=r"data\.train_path=.*bad\.jsonl row 2: no 'prompt' or 'messages' field \(fields: \['answer', 'question'\]\)"):
        load_prompts(str(path))


def test_messages_key_fallback_and_empty_prompt(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": "", "messages": [{"role": "user", "content": "hi"}], "answer": 1}]
    path.write_text("\n".join(json.dumps(x) for x in rows))
    (row,) = load_prompts(str(path))
    assert row.prompt == [{"role": "user", "content": "hi"}] and row.answer == "1"


def test_missing_file_names_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.train_path=.*nope\.jsonl"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"data\.eval_path="):
        load_prompts(str(tmp_path / "nope.jsonl"), key="data.eval_path")


@pytest.mark.parametrize("fmt", ["csv", "parquet", "arrow", "json", "saved", "saved_dict"])
def test_file_formats_round_trip(tmp_path, fmt):
    import datasets

    data = {"question": ["What is 1 + 2?", "What is 5 - 3?"], "answer": [3, 2], "level": ["a", "b"]}
    ds = datasets.Dataset.from_dict(data)
    if fmt == "csv":
        path = str(tmp_path / "p.csv")
        ds.to_csv(path, index=False)
    elif fmt == "parquet":
        path = str(tmp_path / "p.parquet")
        ds.to_parquet(path)
    elif fmt == "json":
        path = str(tmp_path / "p.json")
        ds.to_json(path)
    elif fmt == "arrow":
        ds.save_to_disk(str(tmp_path / "saved"))
        path = [os.path.join(tmp_path, "saved", f) for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")][0]
    elif fmt == "saved":
        path = str(tmp_path / "saved")
        ds.save_to_disk(path)
    else:
        path = str(tmp_path / "saved_dict")
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(path)
    rows = load_prompts(path, prompt_key="question")
    assert [(r.prompt, r.answer, r.extra["level"], r.index) for r in rows] == [("What is 1 + 2?", "3", "a", 0), ("What is 5 - 3?", "2", "b", 1)]


def test_unknown_extension_and_extractor(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("hi")
    with pytest.raises(ValueError, match="unknown file type"):
        load_prompts(str(p))
    with pytest.raises(ValueError, match="answer_extract"):
        load_prompts(str(p), answer_extract="magic")


def test_format_prompt(tokenizer):
    plain = PromptRow(prompt="What is 2 + 2?", answer="4")
    text = format_prompt(plain, tokenizer, suffix=" Answer with a number.")
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "What is 2 + 2? Answer with a number.<|im_end|>" in text
    assert format_prompt(plain, tokenizer, apply_chat_template="never") == "What is 2 + 2?"
    with_sys = format_prompt(plain, tokenizer, system_prompt="Be brief.")
    assert "<|im_start|>system\nBe brief.<|im_end|>" in with_sys
    # A string that already carries the template is used as it is, even with "always".
    templated = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(PromptRow(prompt=templated, answer=None), tokenizer, apply_chat_template="always") == templated
    msgs = PromptRow(prompt=[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], answer=None)
    assert format_prompt(msgs, tokenizer) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="apply_chat_template"):
        format_prompt(plain, tokenizer, apply_chat_template="sometimes")


def test_format_both_train_files_agree(tokenizer):
    """The pre-templated Qwen file and the messages file give the same text under a ChatML template."""
    qwen = load_prompts(str(data_file("train/simplelr_qwen_level3to5.jsonl")), answer_key="label")[:5]
    chat = load_prompts(str(data_file("train/simplelr_level3to5.jsonl")), answer_key="label")[:5]
    for q, c in zip(qwen, chat):
        assert format_prompt(q, tokenizer) == q.prompt
        assert format_prompt(c, tokenizer) == q.prompt


# ---------------------------------------------------------------- sampler


def test_sampler_shards_partition_global_batch():
    samplers = [PromptSampler(50, 8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for _ in range(10):
        batches = [s.next() for s in samplers]
        glob = batches[0].global_indices
        assert all(b.global_indices == glob for b in batches)
        assert sum((b.local_indices for b in batches), []) == glob
        assert all(len(b.local_indices) == 2 for b in batches)


def test_sampler_epochs_cover_every_row_and_are_seeded():
    s = PromptSampler(10, 4, seed=1)
    got = sum((s.next().global_indices for _ in range(5)), [])  # 20 = two epochs
    assert sorted(got[:10]) == list(range(10)) and sorted(got[10:]) == list(range(10))
    assert got[:10] != got[10:]  # each epoch reshuffles
    again = PromptSampler(10, 4, seed=1)
    assert sum((again.next().global_indices for _ in range(5)), []) == got
    other = PromptSampler(10, 4, seed=2)
    assert sum((other.next().global_indices for _ in range(5)), []) != got
    assert PromptSampler(10, 4, shuffle=False).next().global_indices == [0, 1, 2, 3]


def test_sampler_resume_is_exact():
    a = PromptSampler(13, 6, dp_rank=1, dp_size=2, seed=7)
    for _ in range(3):
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(4)]
    b = PromptSampler(13, 6, dp_rank=1, dp_size=2, seed=7)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [b.next() for _ in range(4)] == expected
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(13, 6, seed=8).load_state_dict(state)


def test_sampler_not_divisible():
    with pytest.raises(ValueError, match=r"prompts_per_step=6 must be divisible by the data-parallel size 4"):
        PromptSampler(100, 6, dp_rank=0, dp_size=4, seed=0)
