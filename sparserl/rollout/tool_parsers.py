"""Tool calls read from a model's text, by format: a small registry of parsers (`TOOL_PARSERS`).

A parser splits one assistant turn into its plain content and an ordered list of items, each a `ToolCall`
(name and JSON-object arguments) or a `MalformedCall` (what was wrong, in words the model can read). It
also writes the instructions that describe its format, for chat templates that cannot render tools
themselves (`sparserl/rollout/tool_chat.py`).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn (Hermes, Qwen2.5/3,
  and every template that follows them). An unclosed `<tool_call>` at the end of the turn is parsed too.
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects.
- `llama3_json`: the whole turn is one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.x JSON tool
  calling; `arguments` is accepted as well).

`arguments` may also arrive as a JSON string holding the object (some models double-encode it). Text
around the calls stays the turn's content; parsers do not judge whether a tool exists (the env session
does).

Left out on purpose: streaming (partial) parsing, pythonic call syntax, and repairing malformed JSON (a
model that writes broken calls is told so and pays in reward, not silently fixed).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Union


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class MalformedCall:
    error: str  # shown to the model in the tool result
    text: str = ""  # the offending text, for logs


@dataclass
class ParsedTurn:
    content: str  # the turn's text outside any tool call, stripped
    items: list[Union[ToolCall, MalformedCall]] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        return [x for x in self.items if isinstance(x, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        return [x for x in self.items if isinstance(x, MalformedCall)]


def _call_from_object(obj: Any, args_key: str = "arguments", text: str = "") -> ToolCall | MalformedCall:
    if not isinstance(obj, dict):
        return MalformedCall(f"a tool call must be a JSON object, got {type(obj).__name__}", text)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall('a tool call needs a "name" string', text)
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # double-encoded arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return MalformedCall(f'the "{args_key}" of {name} are not valid JSON: {e.msg}', text)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return MalformedCall(f'the "{args_key}" of {name} must be a JSON object, got {type(args).__name__}', text)
    return ToolCall(name=name, arguments=args)


def _loads(body: str) -> tuple[Any, str | None]:
    try:
        return json.loads(body), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON in tool call: {e.msg} at character {e.pos}"


def _numbered(items: list[ToolCall | MalformedCall]) -> list[ToolCall | MalformedCall]:
    n = 0
    for x in items:
        if isinstance(x, ToolCall) and not x.id:
            x.id = f"call_{n}"
            n += 1
    return items


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    items: list[ToolCall | MalformedCall] = []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        obj, err = _loads(body)
        items.append(MalformedCall(err, body) if err else _call_from_object(obj, text=body))
    content = _HERMES.sub("", text).strip()
    return ParsedTurn(content, _numbered(items))


def parse_mistral(text: str) -> ParsedTurn:
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return ParsedTurn(text.strip())
    body = tail.strip()
    try:  # the list may be followed by more text: decode the first JSON value only
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return ParsedTurn(head.strip(), [MalformedCall(f"invalid JSON after [TOOL_CALLS]: {e.msg} at character {e.pos}", body)])
    objs = obj if isinstance(obj, list) else [obj]
    items = [_call_from_object(o, text=json.dumps(o)) for o in objs]
    content = (head + body[end:]).strip()
    return ParsedTurn(content, _numbered(items))


def parse_llama3_json(text: str) -> ParsedTurn:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    obj, err = _loads(body)
    if err:
        return ParsedTurn("", [MalformedCall(err, body)])
    if not isinstance(obj, dict) or "name" not in obj:  # a JSON answer, not a call
        return ParsedTurn(text.strip())
    return ParsedTurn("", _numbered([_call_from_object(obj, args_key="parameters", text=body)]))


def _schema_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def hermes_instructions(tools: list[dict]) -> str:
    return ("You can call tools. Their signatures, one JSON object per line:\n<tools>\n" + _schema_lines(tools) + "\n</tools>\n"
            "To call a tool, write its name and arguments as one JSON object inside <tool_call></tool_call> tags, "
            "one block per call:\n<tool_call>\n{\"name\": \"tool_name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>\n"
            "Each result comes back in a message from the tool.")


def mistral_instructions(tools: list[dict]) -> str:
    return ("You can call tools. Their signatures, one JSON object per line:\n" + _schema_lines(tools) + "\n"
            "To call tools, write [TOOL_CALLS] followed by a JSON list of calls: "
            "[TOOL_CALLS][{\"name\": \"tool_name\", \"arguments\": {\"argument\": \"value\"}}]\n"
            "Each result comes back in a message from the tool.")


def llama3_json_instructions(tools: list[dict]) -> str:
    return ("You can call tools. Their signatures, one JSON object per line:\n" + _schema_lines(tools) + "\n"
            "To call a tool, answer with only one JSON object: {\"name\": \"tool_name\", \"parameters\": {\"argument\": \"value\"}}\n"
            "The result comes back in a message from the tool.")


@dataclass(frozen=True)
class ToolParser:
    parse: Callable[[str], ParsedTurn]
    instructions: Callable[[list[dict]], str]


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser(parse_hermes, hermes_instructions),
    "mistral": ToolParser(parse_mistral, mistral_instructions),
    "llama3_json": ToolParser(parse_llama3_json, llama3_json_instructions),
}


def get_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
