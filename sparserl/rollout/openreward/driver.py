"""OpenReward episodes in the rollout loop: one session per trajectory, tools through the chat template.

`OpenRewardEnvs` is the env object the worker is given (`rollout(..., env=OpenRewardEnvs(...))`); its
`driver()` gives the worker an `EnvDriver` (sparserl/rollout/worker.py) for one rollout:

- open: a session per trajectory (`split`, `index` from the row), its messages and tools; the prompt is the
  messages with the tool schemas through the chat template (`ToolChat`). Sessions open concurrently, each
  call under `env.step_timeout_s` and `env.max_concurrency`.
- step: the turn's text is parsed for tool calls (`env.openreward.tool_parser`). Calls run in order on the
  session; each result becomes a tool message, and the messages become the observation tokens (loss mask
  0). A malformed call, an unknown tool or a `ToolCallError` (bad arguments, ...) becomes an error result
  the model reads, counted in `tool/*`. `ToolFailed` (the tool raised; the SDK marks the session dead) ends
  the trajectory with status "error". A turn without calls is the final answer: it goes to the env's
  terminal tool when it has one, else the episode just ends. A result with `finished=True` ends the episode
  (later calls of that turn are not run). A turn cut by `max_new_tokens` ends it with status "truncated"
  and its calls are not run; so does reaching the env's `max_turns` without finishing.
- reward: every env answer is a step (`rewards.py`: nonterminal_reward, reduction, clamps); score = reward.
- close: `__aexit__` of each session when its trajectory ends, and of every session left at the end of the
  rollout whatever happened, each within a bounded time; then the client's connections.

The API key is read from the environment variable named by `env.openreward.api_key_env` when the driver is
made; it is never logged or stored in the config.

Left out on purpose: parallel calls within one turn (they run in order: tools may share state), images,
conversation-shaped prompts with earlier tool calls (text blocks only), and group scoring (`score_group`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from sparserl.data.dataset import PromptRow
from sparserl.rollout.openreward.rewards import episode_reward
from sparserl.rollout.openreward.spec import EnvSpec
from sparserl.rollout.tool_chat import ToolChat, ToolResult, tool_schema
from sparserl.rollout.tool_parsers import MalformedCall, get_parser
from sparserl.engines.types import Generation
from sparserl.rollout.episode import Opening, Sample, encode_text, failure_status

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("OPENREWARD_LOG_LEVEL", "WARNING")
log = logging.getLogger(__name__)

_SID = re.compile(r"\(?\b(?:environment|sandbox) session (?:terminated )?\(?sid=[^)]*\)\)?:?\s*")


class EnvSessionError(RuntimeError):
    """An OpenReward error that ended a trajectory, its message without the session id (so equal failures
    of many sessions log as one line)."""


ROW_KEY = "openreward"  # PromptRow.extra[ROW_KEY] = {"env": Org/Name, "split": ..., "index": ...}
TOOL_STATS = ("calls", "malformed", "errors", "failed")


@dataclass
class OpenRewardEnvs:
    """The OpenReward environments of a run, as the worker drives them."""

    specs: list[EnvSpec]
    base_url: str = ""  # empty: the SDK's default (the hosted service)
    api_key_env: str = "OPENREWARD_API_KEY"
    tool_parser: str = "hermes"
    variants: dict[str, str | None] = field(default_factory=dict)  # Org/Name -> the env's route on its server

    def __post_init__(self) -> None:
        get_parser(self.tool_parser)  # fail early on a bad name
        self.by_name = {s.name: s for s in self.specs}

    @property
    def max_turns(self) -> int:
        return max(s.max_turns for s in self.specs)

    def api_key(self) -> str:
        return os.environ.get(self.api_key_env, "")

    def variant(self, spec: EnvSpec) -> str | None:
        return spec.variant if spec.variant is not None else self.variants.get(spec.name)

    def client(self):
        from openreward import AsyncOpenReward

        return AsyncOpenReward(api_key=self.api_key() or "local")

    def url(self, spec: EnvSpec) -> str | None:
        return spec.base_url or self.base_url or None

    def handle(self, client, spec: EnvSpec):
        return client.environments.get(spec.name, variant=self.variant(spec), base_url=self.url(spec))

    def driver(self, tokenizer, calls) -> "SessionDriver":
        return SessionDriver(self, tokenizer, calls)


def _message_text(blocks) -> str:
    parts = []
    for b in blocks:
        if getattr(b, "type", "") != "text":
            raise ValueError(f"the env sent a {getattr(b, 'type', type(b).__name__)} block; only text is supported")
        parts.append(b.text)
    return "\n\n".join(parts)


def _output_text(out) -> str:
    return "\n\n".join(b.text if getattr(b, "type", "") == "text" else f"[{getattr(b, 'type', 'block')} omitted]"
                       for b in out.blocks)


@dataclass
class _Episode:
    spec: EnvSpec
    session: Any
    tools: set[str]
    terminal: Any  # TerminalToolSpec | None
    rewards: list[float | None] = field(default_factory=list)

    def book(self, sample: Sample) -> None:
        sample.reward = sample.score = episode_reward(self.rewards, self.spec)


class SessionDriver:
    """The worker's `EnvDriver` for OpenReward sessions (see the module docstring)."""

    def __init__(self, envs: OpenRewardEnvs, tokenizer, calls) -> None:
        from openreward.api.errors import OpenRewardError, ToolCallError, ToolFailed

        self.OpenRewardError, self.ToolCallError, self.ToolFailed = OpenRewardError, ToolCallError, ToolFailed
        self.envs, self.tokenizer, self.calls = envs, tokenizer, calls
        self.chat = ToolChat(tokenizer, get_parser(envs.tool_parser))
        self.parse = get_parser(envs.tool_parser).parse
        self.client = None
        self.sessions: dict[int, Any] = {}
        self.episodes: dict[int, _Episode] = {}
        self.close_timeout_s = min(calls.timeout_s or 10.0, 10.0)

    async def open(self, rows: list[PromptRow], prompt_texts: list[str], n: int) -> list[Opening]:
        self.client = self.envs.client()
        handles = {s.name: self.envs.handle(self.client, s) for s in self.envs.specs}
        jobs = []
        for g, row in enumerate(rows):
            ref = row.extra.get(ROW_KEY)
            if not isinstance(ref, dict) or ref.get("env") not in handles:
                raise ValueError(f"row {row.index} is not an OpenReward task of this run (extra[{ROW_KEY!r}]={ref!r:.80})")
            spec = self.envs.by_name[ref["env"]]
            jobs += [self._open_one(g * n + j, spec, handles[spec.name], ref["split"], int(ref["index"])) for j in range(n)]
        return list(await asyncio.gather(*jobs))

    async def _open_one(self, k: int, spec: EnvSpec, handle, split: str, index: int) -> Opening:
        session = handle.session(split=split, index=index)
        self.sessions[k] = session
        try:
            await self.calls("open_session", session.__aenter__())
            messages = await self.calls("get_messages", session.get_messages())
            terminal = await self.calls("terminal_tool", session.terminal_tool())
            tools = await self.calls("list_tools", session.list_tools())
            chat = [{"role": m.role, "content": _message_text(m.blocks)} for m in messages]
            schemas = [tool_schema(t.name, t.description, t.input_schema) for t in tools]
            hint = None if terminal is None else (f"{terminal.name}: {terminal.description}" if terminal.description else terminal.name)
            text = self.chat.prompt(chat, schemas, hint)
        except Exception as e:  # noqa: BLE001 - a task that cannot start costs its samples, not the run
            return Opening([], failure_status(e), f"{spec.name} {split}[{index}]: {type(e).__name__}: {e}", spec.max_turns)
        self.episodes[k] = _Episode(spec, session, {t.name for t in tools}, terminal)
        return Opening(encode_text(self.tokenizer, text), max_turns=spec.max_turns)

    async def step(self, k: int, sample: Sample, gen: Generation, action: str, last_turn: bool) -> list[int] | None:
        try:
            return await self._step(self.episodes[k], sample, gen, action, last_turn)
        except self.OpenRewardError as e:
            raise EnvSessionError(f"{type(e).__name__}: {_SID.sub('', str(e))}") from None

    async def _step(self, ep: _Episode, sample: Sample, gen: Generation, action: str, last_turn: bool) -> list[int] | None:
        stats = sample.tool_stats
        for key in TOOL_STATS:
            stats.setdefault(key, 0)
        if gen.finish_reason == "length":  # an unfinished message: its calls are not run
            sample.status = "truncated"
            ep.book(sample)
            return None
        parsed = self.parse(action)
        if not parsed.items:
            if ep.terminal is not None:
                out = await self.calls("call_terminal_tool", ep.session.call_terminal_tool(parsed.content))
                ep.rewards.append(out.reward)
            ep.book(sample)
            return None
        results, finished = [], False
        for i, item in enumerate(parsed.items):
            if isinstance(item, MalformedCall):
                stats["malformed"] += 1
                results.append(ToolResult(f"call_{i}", "invalid_call", f"Error: {item.error}", True))
                continue
            if item.name not in ep.tools:
                stats["errors"] += 1
                known = ", ".join(sorted(ep.tools)) or "none"
                results.append(ToolResult(item.id, item.name, f"Error: unknown tool {item.name!r}; the tools are: {known}", True))
                continue
            stats["calls"] += 1
            try:
                out = await self.calls("call_tool", ep.session.call_tool(item.name, item.arguments))
            except self.ToolCallError as e:
                stats["errors"] += 1
                results.append(ToolResult(item.id, item.name, f"Error: {getattr(e, 'detail', None) or e}", True))
                if getattr(e, "reason", "") == "episode_finished":
                    finished = True
                    break
                continue
            except self.ToolFailed:
                stats["failed"] += 1
                raise
            ep.rewards.append(out.reward)
            results.append(ToolResult(item.id, item.name, _output_text(out)))
            if out.finished:
                finished = True
                break
        ep.book(sample)
        if finished:
            return None
        if last_turn:  # max_turns spent before the env finished the episode
            sample.status = "truncated"
            return None
        return self.tokenizer.encode(self.chat.observation(results, gen.token_ids), add_special_tokens=False)

    async def close(self, ks: list[int] | None) -> None:
        keys = list(self.sessions) if ks is None else [k for k in ks if k in self.sessions]
        sessions = [self.sessions.pop(k) for k in keys]
        for k in keys:
            self.episodes.pop(k, None)
        if sessions:
            await asyncio.gather(*(self._close_one(s) for s in sessions))
        if ks is None and self.client is not None:
            try:
                await asyncio.wait_for(self.client.environments.aclose(), self.close_timeout_s)
            except Exception as e:  # noqa: BLE001 - closing must not fail a rollout that finished
                log.debug("closing the OpenReward client: %s", e)
            self.client = None

    async def _close_one(self, session) -> None:
        try:
            await asyncio.wait_for(session.__aexit__(None, None, None), self.close_timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead server cannot be told; the session's pings stop anyway
            log.debug("closing an OpenReward session: %s", e)

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        n = max(len(samples), 1)
        out = {f"tool/{key}_mean": sum(s.tool_stats.get(key, 0) for s in samples) / n for key in TOOL_STATS}
        for spec in self.envs.specs:
            mine = [s for s in samples if s.extra_info.get(ROW_KEY, {}).get("env") == spec.name]
            out[f"openreward/{spec.short}/count"] = float(len(mine))
            out[f"openreward/{spec.short}/reward_sum"] = float(sum(s.reward for s in mine))
        return out
