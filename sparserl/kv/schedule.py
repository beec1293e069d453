"""When a request compresses, how much it keeps, and the most KV slots it can ever hold. Plain Python.

One `CompressionSchedule` per request; the engine calls `on_token` after every decode step and, when it
returns True, compresses that request (in every layer) down to `target_len()` entries.

- floor = budget, raised to the prompt length unless `compress_prompt`: a compression never keeps fewer.
  It is a count: which entries survive is the policy's choice.
- step_length: compress once over the floor and `divide_length` steps after the previous compression.
- newline: compress once over the floor on a newline token.
- Both: also compress when the cache reaches floor + divide_length, a hard cap so the slot bound holds even
  without newlines, or when a long compressible prompt starts over the cap.

Hence after the first compression a request holds at most floor + divide_length entries, and overall at most
`max_slots(...)`, which admission can reserve up front.

Left out on purpose: batch-global step counters (triggers are per request), "</think>"-aware pausing,
and compressing at prefill (the first trigger comes with the first decode step past the floor).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparserl.kv.policy import KVPolicyConfig


def is_newline_token(token_text: str) -> bool:
    """True for tokens that end a line ("\\n", ".\\n", ")\\n\\n", ...), the newline trigger's signal."""
    return token_text.endswith("\n")


class NewlineTokens:
    """The newline trigger's test per token id (`divide_method == "newline"`), each id decoded once."""

    def __init__(self, divide_method: str) -> None:
        self.active = divide_method == "newline"
        self._hit: dict[int, bool] = {}

    def __call__(self, token: int, tokenizer) -> bool:
        if not self.active:
            return False
        hit = self._hit.get(token)
        if hit is None:
            hit = self._hit[token] = is_newline_token(tokenizer.decode([token]))
        return hit


def keep_floor(cfg: KVPolicyConfig, prompt_len: int) -> int:
    return cfg.budget if cfg.compress_prompt else max(cfg.budget, prompt_len)


@dataclass
class CompressionSchedule:
    cfg: KVPolicyConfig
    prompt_len: int
    steps_since: int = 0  # decode steps since the last compression (or since prefill)

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            raise ValueError(f"CompressionSchedule.prompt_len must be >= 0, got {self.prompt_len}")

    @property
    def floor(self) -> int:
        return keep_floor(self.cfg, self.prompt_len)

    def on_token(self, cached_len: int, token_is_newline: bool) -> bool:
        """Called after a decode step appended one token; `cached_len` = entries now held (per layer, per head).

        Returns True when this request must compress now (and then counts steps from zero again).
        """
        self.steps_since += 1
        if self.cfg.algorithm == "none" or cached_len <= self.floor:
            return False
        if cached_len >= self.floor + self.cfg.divide_length:
            due = True
        elif self.cfg.divide_method == "step_length":
            due = self.steps_since >= self.cfg.divide_length
        else:  # newline
            due = token_is_newline
        if due:
            self.steps_since = 0
        return due

    def target_len(self) -> int:
        """Entries to keep when compressing: the budget, but never below the prompt unless compress_prompt."""
        return self.floor

    @staticmethod
    def max_slots(cfg: KVPolicyConfig, prompt_len: int, max_new_tokens: int, floor_len: int | None = None) -> int:
        """Worst-case entries one request ever holds (per layer, per head).

        floor + divide_length once generating; a compressible prompt longer than that is held whole at
        prefill and once more with the first decoded token, which triggers at once. `prompt_len` is what the
        cache holds after prefill; `floor_len` (default `prompt_len`) is the length the floor protects. They
        differ for a continued engine session: its cache holds the earlier turns (already compressible) plus
        the new tokens, and only the new tokens count as this turn's prompt.
        """
        dense = prompt_len + max_new_tokens
        if cfg.algorithm == "none":
            return dense
        floor = keep_floor(cfg, prompt_len if floor_len is None else floor_len)
        return min(dense, max(prompt_len + 1, floor + cfg.divide_length))
