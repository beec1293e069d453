"""Tool use through a tokenizer's chat template: the prompt with the tool schemas, and tool results as tokens.

Token-in, token-out: the model's turns are never re-rendered. After a turn, the tool results become the
text the template would put between that turn and the next assistant turn, found by rendering a fixed
dummy conversation with and without the tool messages and taking the difference, plus whatever the
template writes after an assistant message's end-of-turn token (ChatML's newline after `<|im_end|>`). The
model's own tokens keep loss mask 1; all of this gets mask 0.

- Prompt: `apply_chat_template(messages, tools=schemas, add_generation_prompt=True)` when the template renders
  `tools`; otherwise (SmolLM2's template, for one) the tool parser's instructions and the schemas go into
  the system message (prepended to an existing one), and a line says that a plain reply ends the episode
  when the env has a terminal tool.
- Tool results: messages `{"role": "tool", "tool_call_id", "name", "content"}`. A template that refuses the
  tool role gets them as one user message of `<tool_response>` blocks instead.

Left out on purpose: images in prompts or results (text only), and re-tokenizing the whole history each
turn (it would change the model's own tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from sparserl.rollout.tool_parsers import ToolParser

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_MARK = "\u2063MARK\u2063"  # text no template produces on its own


@dataclass
class ToolResult:
    call_id: str
    name: str
    content: str
    is_error: bool = False


def _untitled(schema):
    """A JSON schema without pydantic's `title` annotations (they only lengthen the prompt)."""
    if isinstance(schema, list):
        return [_untitled(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _untitled(sub) for name, sub in value.items()}  # property names stay, even "title"
        else:
            out[key] = _untitled(value)
    return out


def tool_schema(name: str, description: str, input_schema: dict | None) -> dict:
    """One tool in the OpenAI function format that chat templates expect."""
    params = _untitled(dict(input_schema)) if input_schema else {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


class ToolChat:
    """Renders one env conversation and its tool traffic with `tokenizer`'s chat template."""

    def __init__(self, tokenizer, parser: ToolParser) -> None:
        self.tokenizer, self.parser = tokenizer, parser
        self.native_tools = self._renders_tools()
        self.end_of_turn = self._end_of_turn()
        self._tool_role = True
        self._stop_texts = {tid: tokenizer.decode([tid], skip_special_tokens=False) for tid in _eos_ids(tokenizer)}

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kw)

    def _renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "hi"}]
        try:
            return self._render(probe, True, [_PROBE_TOOL]) != self._render(probe, True)
        except Exception:  # noqa: BLE001 - a template that chokes on tools does not render them
            return False

    def _end_of_turn(self) -> str:
        text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}], False)
        return text[text.rindex(_MARK) + len(_MARK):] if _MARK in text else ""

    def prompt(self, messages: list[dict], tools: list[dict], terminal: str | None = None) -> str:
        """The first prompt: the env's messages, the tools, and the generation prompt."""
        if not tools and terminal is None:
            return self._render(messages, True)
        if self.native_tools:
            return self._render(messages, True, tools or None)
        lines = [self.parser.instructions(tools)] if tools else []
        if terminal is not None:
            lines.append(f"When you are done, reply with a plain message without tool calls: it is your final answer "
                         f"and ends the episode ({terminal}).")
        note = "\n".join(lines)
        messages = [dict(m) for m in messages]
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = note + "\n\n" + messages[0]["content"]
        else:
            messages.insert(0, {"role": "system", "content": note})
        return self._render(messages, True)

    def observation(self, results: list[ToolResult], turn_ids: list[int]) -> str:
        """What follows the model's turn `turn_ids`: its end of turn, the tool results, the next generation prompt."""
        last = turn_ids[-1] if turn_ids else None
        stop_text = self._stop_texts.get(last)
        if stop_text is not None and self.end_of_turn.startswith(stop_text):
            close = self.end_of_turn[len(stop_text):]
        else:  # the turn ended without the template's end-of-turn token (a stop string): close it
            close = self.end_of_turn
        return close + self._results_text(results)

    def _results_text(self, results: list[ToolResult]) -> str:
        calls = [{"id": r.call_id, "type": "function", "function": {"name": r.name, "arguments": {}}} for r in results]
        head = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        if self._tool_role:
            tool_msgs = [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content} for r in results]
            try:
                return _suffix(self._render(head, False), self._render(head + tool_msgs, True))
            except Exception:  # noqa: BLE001 - the template has no tool role: fall back to a user message, below
                self._tool_role = False
        blocks = "\n".join(f"<tool_response>\n{json.dumps({'name': r.name, 'content': r.content}, ensure_ascii=False)}\n</tool_response>"
                           for r in results)
        plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
        return _suffix(self._render(plain, False), self._render(plain + [{"role": "user", "content": blocks}], True))


def _suffix(before: str, after: str) -> str:
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier messages differently once tool results follow them; "
                         "tool results cannot be appended token by token with this template")
    return after[len(before):]


def _eos_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "</s>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return ids
