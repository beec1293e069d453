"""Prompt datasets: load rows from local files and turn them into prompt text.

A row becomes a `PromptRow`: the prompt (a string, possibly with a chat template already applied, or a
list of chat messages), the reference answer as a string, and every other field in `extra` (handed to the
env as `extra_info`). Files are read through the `datasets` library: JSON/JSONL, CSV, Parquet, Arrow, or a
folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`.

Answers of any type become strings: integral floats print as integers (`27.0` -> `"27"`, so MAWPS and
AMC targets compare as integers), other scalars with `str()`, a one-element list as its element, and a
longer list (several final answers, as OlympiadBench may have) joined with `", "`. An answer can then be
narrowed by a named extractor (`ANSWER_EXTRACTORS`): `none`, `gsm8k_hash` (the text after `####`) or
`boxed` (the last `\\boxed{}` of a worked solution, e.g. Minerva). An empty answer is None (gaokao2023en
has two such rows); envs that need an answer say so when they meet one.

Left out on purpose: hub downloads (local files only), streaming (prompt sets are small), and tokenization
(the rollout worker owns it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from sparserl.rewards.math import extract_boxed

Messages = list[dict[str, str]]

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
# Chat markers of common templates; `format_prompt` adds the special tokens of the tokenizer's own template.
_KNOWN_CHAT_MARKERS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "[INST]", "<|user|>", "<|assistant|>")


@dataclass
class PromptRow:
    prompt: str | Messages
    answer: str | None
    extra: dict[str, Any] = field(default_factory=dict)
    index: int = 0


def _extract_none(answer: str) -> str:
    return answer


def _extract_gsm8k_hash(answer: str) -> str:
    # GSM8K solutions end in "#### 1,234"; the number is the reference.
    tail = answer.rsplit("####", 1)[-1].strip()
    return tail.replace(",", "")


def _extract_boxed_answer(answer: str) -> str:
    boxed = extract_boxed(answer)
    return boxed if boxed is not None else answer


ANSWER_EXTRACTORS: dict[str, Callable[[str], str]] = {
    "none": _extract_none,
    "gsm8k_hash": _extract_gsm8k_hash,
    "boxed": _extract_boxed_answer,
}


def answer_to_str(value: Any) -> str | None:
    """Any answer value -> its string form (see the module docstring), or None when absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, tuple)):
        parts = [p for p in (answer_to_str(v) for v in value) if p]
        return ", ".join(parts) if parts else None
    text = str(value)
    return text if text.strip() else None


def _read_table(path: str, key: str):
    import datasets

    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}={path}: no such file or folder")
    if os.path.isdir(path):
        try:
            ds = datasets.load_from_disk(path)
        except FileNotFoundError as e:
            raise ValueError(f"{key}={path}: a folder must be written by Dataset.save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None)
            if split is None:
                raise ValueError(f"{key}={path}: saved DatasetDict has splits {sorted(ds)}; keep one or name one 'train'")
            ds = ds[split]
        return ds
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FILE_BUILDERS:
        raise ValueError(f"{key}={path}: unknown file type {ext!r}; use one of {sorted(_FILE_BUILDERS)} or a saved dataset folder")
    return datasets.load_dataset(_FILE_BUILDERS[ext], data_files=path, split="train")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def load_prompts(
    path: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    answer_extract: str = "none",
    key: str = "data.train_path",
) -> list[PromptRow]:
    """Read every row of `path` as a `PromptRow`. `key` names the config entry in error messages."""
    if answer_extract not in ANSWER_EXTRACTORS:
        raise ValueError(f"answer_extract={answer_extract!r} is not known; choose one of {sorted(ANSWER_EXTRACTORS)}")
    table = _read_table(path, key)
    return rows_from_records(table, f"{key}={path}", prompt_key, answer_key, messages_key, answer_extract)


def rows_from_records(
    records,
    source: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    answer_extract: str = "none",
) -> list[PromptRow]:
    """Dict rows (a file's, or an env's `make_prompts`) -> `PromptRow`s; `source` prefixes error messages."""
    extract = ANSWER_EXTRACTORS[answer_extract]
    rows: list[PromptRow] = []
    for i, record in enumerate(records):
        prompt = record.get(prompt_key)
        if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
            prompt = record.get(messages_key)
        if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
            fields = sorted(k for k, v in record.items() if v is not None)
            raise ValueError(f"{source} row {i}: no {prompt_key!r} or {messages_key!r} field (fields: {fields})")
        if not isinstance(prompt, str) and not _is_messages(prompt):
            raise ValueError(f"{source} row {i}: {prompt_key!r} must be a string or a list of {{role, content}} messages, got {type(prompt).__name__}")
        answer = answer_to_str(record.get(answer_key))
        if answer is not None:
            answer = extract(answer)
        extra = {k: v for k, v in record.items() if k not in (prompt_key, messages_key, answer_key)}
        rows.append(PromptRow(prompt=prompt, answer=answer, extra=extra, index=i))
    return rows


def chat_markers(tokenizer) -> tuple[str, ...]:
    """Strings whose presence says a prompt already has a chat template applied."""
    markers = set(_KNOWN_CHAT_MARKERS)
    if getattr(tokenizer, "chat_template", None):
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
        specials = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
        markers |= {t for t in specials if t and len(t) > 2 and t in probe}
    return tuple(sorted(markers))


def format_prompt(
    row: PromptRow,
    tokenizer,
    apply_chat_template: str = "auto",
    system_prompt: str | None = None,
    suffix: str = "",
) -> str:
    """The prompt text the model sees.

    Messages go through the tokenizer's chat template with the generation prompt. A string that already
    holds chat markers is used as it is (`system_prompt` and `suffix` are ignored for it: the template was
    applied upstream). A plain string is wrapped as one user message (`auto`, `always`) or used raw
    (`never`; `auto` also falls back to raw when the tokenizer has no chat template). `suffix` is appended
    to the last user message (or to the raw string).
    """
    if apply_chat_template not in ("auto", "always", "never"):
        raise ValueError(f"apply_chat_template={apply_chat_template!r}; choose auto, always or never")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    prompt = row.prompt
    if isinstance(prompt, str):
        if apply_chat_template != "never" and any(m in prompt for m in chat_markers(tokenizer)):
            return prompt
        if apply_chat_template == "never" or (apply_chat_template == "auto" and not has_template):
            return prompt + suffix
        messages: Messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
    if not has_template:
        raise ValueError(f"row {row.index}: the prompt is chat messages (or apply_chat_template=always) but the tokenizer has no chat template")
    if suffix:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is None:
            raise ValueError(f"row {row.index}: no user message to append the suffix to")
        messages[last_user]["content"] += suffix
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

