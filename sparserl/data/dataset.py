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
has two such rows); envs that need an answer say so when they meet one. A row without the answer field at
all, or with an answer that is a mapping, is an error: the key is likely wrong.

Bad files fail with one message naming the file and where: an empty file, bytes that are not UTF-8 text,
a JSON line that does not parse, a CSV row with more fields than its header, a file that is not Parquet
(`line N` counts text lines from 1, as editors do; `row N` counts rows from 0, as `datasets` indexes them).
JSON files are parsed here first, so a row of the wrong type is named before `datasets` casts the rows to
one schema.

Left out on purpose: hub downloads (local files only), streaming (prompt sets are small), and tokenization
(the rollout worker owns it).
"""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from sparserl.rewards.math import extract_boxed

Messages = list[dict[str, str]]

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_FORMAT_HINTS = {".json": "a .json file holds one array of objects, or one object per line",
                 ".jsonl": "a .jsonl file holds one JSON object per line",
                 ".csv": "a .csv file holds a header line naming the columns, then one row per line",
                 ".parquet": "write it with Dataset.to_parquet or DataFrame.to_parquet",
                 ".arrow": "write it with Dataset.save_to_disk"}
CHAT_TEMPLATE_MODES = ("auto", "always", "never")
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
        where = "" if os.path.isabs(path) else f" (a relative path is read from the current folder, {os.getcwd()})"
        raise FileNotFoundError(f"{key}={path}: no such file or folder{where}")
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
    ext = _file_type(path, key)
    try:
        return datasets.load_dataset(_FILE_BUILDERS[ext], data_files=path, split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError, TypeError, OSError) as e:
        # DatasetGenerationError wraps the reader's own error (pyarrow, pandas), which says what is wrong.
        cause = " ".join(str(e.__cause__ or e).split())
        raise ValueError(f"{key}={path}: cannot be read as {ext[1:]}: {cause} ({_FORMAT_HINTS[ext]})") from None


def _file_type(path: str, key: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FILE_BUILDERS:
        raise ValueError(f"{key}={path}: unknown file type {ext!r}; use one of {sorted(_FILE_BUILDERS)} or a saved dataset folder")
    return ext


def scan_file(path: str, key: str = "data.train_path") -> list[dict] | None:
    """Check that the file at `path` can hold rows, naming the line that cannot; return a JSON file's records.

    Raises ValueError for an empty file, bytes that are not UTF-8 text, a JSON line that does not parse or is
    not an object, a CSV row with more fields than its header, or a file without Parquet's magic bytes.
    """
    ext, where, size = _file_type(path, key), f"{key}={path}", os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{where}: the file is empty ({_FORMAT_HINTS[ext]})")
    if ext in (".parquet", ".arrow"):
        with open(path, "rb") as f:
            head, _, tail = f.read(4), f.seek(max(0, size - 4)), f.read(4)
        if ext == ".parquet" and (size < 8 or head != b"PAR1" or tail != b"PAR1"):
            raise ValueError(f"{where}: not a Parquet file, it does not start and end with PAR1 ({_FORMAT_HINTS[ext]})")
        return None
    with open(path, "rb") as f:
        data = f.read()
    if not data.strip():
        raise ValueError(f"{where}: the file is empty, only blank lines ({_FORMAT_HINTS[ext]})")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{where} line {line}: not UTF-8 text, byte 0x{data[e.start]:02x} (save the file as UTF-8; "
                         f"{_FORMAT_HINTS[ext]})") from None
    if "\x00" in text:
        raise ValueError(f"{where} line {text.count(chr(10), 0, text.index(chr(0))) + 1}: binary data, a NUL byte "
                         f"({_FORMAT_HINTS[ext]})")
    if ext == ".csv":
        _scan_csv(text, where)
        return None
    return _parse_json(text, where, ext)


def _scan_csv(text: str, where: str) -> None:
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text)))  # a long prompt is one long field; pandas has no such limit
    reader, start = csv.reader(io.StringIO(text, newline=""), strict=True), 1
    try:
        header = next(reader, [])
        if not any(h.strip() for h in header):
            raise ValueError(f"{where} line 1: no column names ({_FORMAT_HINTS['.csv']})")
        start = reader.line_num + 1
        for row in reader:
            if len(row) > len(header):
                raise ValueError(f"{where} line {start}: {len(row)} fields but the header names {len(header)} "
                                 "(quote fields that contain commas)")
            start = reader.line_num + 1
    except csv.Error as e:  # reported where the row began: an unclosed quote runs to the end of the file
        raise ValueError(f"{where} line {start}: not valid CSV, {e} (close every quote; {_FORMAT_HINTS['.csv']})") from None
    finally:
        csv.field_size_limit(limit)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def _parse_json(text: str, where: str, ext: str) -> list[dict] | None:
    if ext == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise ValueError(f"{where} line {e.lineno}: invalid JSON: {e.msg} at column {e.colno} ({_FORMAT_HINTS[ext]})") from None
        else:  # one document: an array of rows, or an object that `datasets` reads itself (one row, or columns)
            if isinstance(doc, dict):
                return None
            if not isinstance(doc, list):
                raise ValueError(f"{where}: holds {_json_type(doc)}, not rows ({_FORMAT_HINTS[ext]})")
            for i, record in enumerate(doc):
                if not isinstance(record, dict):
                    raise ValueError(f"{where} row {i}: a JSON object is expected, got {_json_type(record)} ({_FORMAT_HINTS[ext]})")
            return doc
    records = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {n}: invalid JSON: {e.msg} at column {e.colno} ({_FORMAT_HINTS['.jsonl']})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where} line {n}: a JSON object is expected, got {_json_type(record)} ({_FORMAT_HINTS['.jsonl']})")
        records.append(record)
    return records


def _messages_problem(value: Any) -> str | None:
    """Why `value` is not a list of chat messages, or None when it is one."""
    if not isinstance(value, list):
        return f"a string or a list of {{role, content}} messages is expected, got {type(value).__name__}"
    if not value:
        return "the message list is empty"
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {j} is not a {{role, content}} object: {str(m)[:80]}"
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            return (f"message {j} has role {type(m['role']).__name__} and content {type(m['content']).__name__}; "
                    "both must be strings")
    return None


def _answer_ok(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_answer_ok(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


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
    records = scan_file(path, key) if os.path.isfile(path) else None
    if records is not None:  # rows named before `datasets` casts them to one schema (and fails on a type mix)
        rows_from_records(records, f"{key}={path}", prompt_key, answer_key, messages_key, answer_extract)
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
        problem = None if isinstance(prompt, str) else _messages_problem(prompt)
        if problem is not None:
            raise ValueError(f"{source} row {i}: {prompt_key!r}: {problem}")
        if answer_key not in record:
            fields = sorted(k for k, v in record.items() if v is not None)
            raise ValueError(f"{source} row {i}: no {answer_key!r} field, so no response can be checked (fields: {fields}; "
                             "write null where a row has no answer)")
        if not _answer_ok(record[answer_key]):
            raise ValueError(f"{source} row {i}: {answer_key!r} must be a string, a number or a list of them, "
                             f"got {type(record[answer_key]).__name__}")
        answer = answer_to_str(record[answer_key])
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
    if apply_chat_template not in CHAT_TEMPLATE_MODES:
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

