"""Scoring a walk along word links, one "[N.] a -> b" line per step (envs/long_chain.py, envs/cycle_walk.py).

The answer is the walk as words, "fox cup owl ...": step i goes from word i to word i + 1. A response earns the
steps it takes, in order, before its first mistake; a non-empty line that does not parse is a mistake, the line
number is not checked, and lines past the walk are ignored.
"""
from __future__ import annotations

import re

_LINE = re.compile(r"^\s*(?:\d+\s*[.):]\s*)?([A-Za-z]+)\s*->\s*([A-Za-z]+)\s*$")


def parse_steps(response: str) -> list[tuple[str, str] | None]:
    """One entry per non-empty line: (a, b) for "[N.] a -> b", None for a line that does not parse."""
    out = []
    for line in response.splitlines():
        if line.strip():
            m = _LINE.match(line)
            out.append((m.group(1), m.group(2)) if m else None)
    return out


def correct_prefix(response: str, answer: str) -> int:
    """How many steps of the walk `answer` the response takes, in order, before its first mistake."""
    walk = answer.split()
    k = 0
    for got, want in zip(parse_steps(response), zip(walk, walk[1:])):
        if got != want:
            break
        k += 1
    return k


def score(response: str, answer: str) -> float:
    """The share of the walk's steps taken before the first mistake, in [0, 1]."""
    return correct_prefix(response, answer) / max(1, len(answer.split()) - 1)


def extract_answer(response: str) -> str | None:
    """The path the response walks, "fox cup owl ...", up to its first unparsable line (None if it walks none)."""
    words: list[str] = []
    for step in parse_steps(response):
        if step is None:
            break
        if not words:
            words.append(step[0])
        words.append(step[1])
    return " ".join(words) or None
