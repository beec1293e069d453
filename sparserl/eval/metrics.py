"""Evaluation metrics over the n samples of each prompt: avg@n, unbiased pass@k, maj@n, lengths, KV.

Per prompt with n samples of which c are correct:

- avg@n = c / n, the mean accuracy of one sample;
- pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimate of "at least one of k samples is correct"
  (Chen et al. 2021), exact in integers up to the final division;
- maj@n = whether the most frequent extracted answer is correct. Samples without an answer do not vote;
  answers are compared as strings after removing whitespace and surrounding `$`; a tie between equally
  frequent answers goes to the one sampled first (lowest sample index), so the rule depends only on the
  samples, never on dict order or on how prompts were split across ranks. No answer at all counts as wrong.

A dataset's value of each is the mean over its prompts. Left out on purpose: symbolic equivalence when
voting (`\\frac12` and `0.5` are different votes), bootstrap confidence intervals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SampleRecord:
    """One evaluated sample; also one line of samples.jsonl."""

    dataset: str
    index: int  # prompt row in its dataset file
    sample: int  # 0..n-1
    prompt: str
    response: str
    answer: str | None  # the reference
    extracted: str | None  # the answer the env reads from the response (None: none found, or no extractor)
    correct: bool
    score: float
    tokens: int  # response tokens the model wrote
    finish_reason: str
    status: str
    kv_peak: int  # most KV entries (per layer) the sequence held at once
    kv_retained: int  # entries held at the end
    kv_total: int  # what a dense cache would have held


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def normalize_answer(answer: str) -> str:
    return "".join(answer.split()).strip("$")


def majority_vote(answers: list[str | None]) -> int | None:
    """Index of the sample whose answer wins the vote (see the module docstring); None when no sample has one."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None or not normalize_answer(a):
            continue
        key = normalize_answer(a)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    return min(first[a] for a in counts if counts[a] == max(counts.values()))


def dataset_metrics(records: list[SampleRecord], n: int, ks: list[int], vote: bool,
                    kv_bytes_per_slot: int = 0) -> dict[str, float]:
    """Metrics of one dataset from all of its samples (any order); `vote`: report maj@n."""
    by_prompt: dict[int, list[SampleRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.index, []).append(r)
    groups = [sorted(g, key=lambda r: r.sample) for _, g in sorted(by_prompt.items())]
    for g in groups:
        assert len(g) == n, f"prompt {g[0].index} has {len(g)} samples, expected {n}"
    P = len(groups)
    out: dict[str, float] = {"prompts": float(P)}
    correct = [sum(r.correct for r in g) for g in groups]
    out[f"avg@{n}"] = sum(c / n for c in correct) / P
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / P
    if vote:
        winners = [majority_vote([r.extracted for r in g]) for g in groups]
        out[f"maj@{n}"] = sum(g[w].correct for g, w in zip(groups, winners) if w is not None) / P
    out["response_len"] = sum(r.tokens for r in records) / len(records)
    out["truncated_frac"] = sum(r.finish_reason == "length" for r in records) / len(records)
    total = sum(r.kv_total for r in records)
    out["kv_retained_frac"] = sum(r.kv_retained for r in records) / total if total else 1.0
    out["kv_peak_tokens"] = sum(r.kv_peak for r in records) / len(records)
    out["kv_peak_tokens_max"] = float(max(r.kv_peak for r in records))
    if kv_bytes_per_slot:
        out["kv_peak_mib"] = out["kv_peak_tokens"] * kv_bytes_per_slot / 2**20
    return out
