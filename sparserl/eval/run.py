"""Evaluate the policy in a rollout engine on `EvalSet`s: shard prompts over data-parallel ranks, roll out
through each set's env, gather every sample on every rank, compute the metrics.

A sample's draws depend only on (eval.seed, the set's name, the prompt's row in its file, the sample index):
the set name and eval.seed make `SamplingParams.seed`, the row index is the request's `seed_index`. Rank 0 draws
one progress bar over every set, with its time estimate (a plain line every 30 s where stderr is not a terminal). Prompt i
goes to data-parallel rank i % dp, and results are ordered by (row, sample) after the gather, so 1 or N
processes give the same samples and the same numbers. With tp or cp > 1 the owner of each replica group evaluates
and hands the result to its peers, which neither generate nor run an env (engines/handle.py `on_owner`); the
samples come from the one rollout call training makes too (`rollout.worker.Rollouts`). The engine is woken and
left awake (a `sleep()` may drop weights that the next training rollout needs; its `wake()` is a no-op then).
Left out on purpose: caching generations across calls, early stopping on a confidence bound.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass, field

import torch.distributed as dist

from sparserl.config import Config
from sparserl.data.dataset import format_prompt
from sparserl.eval.datasets import EvalSet
from sparserl.eval.metrics import SampleRecord, dataset_metrics
from sparserl.engines.handle import EngineHandle
from sparserl.engines.types import SamplingParams
from sparserl.rollout.episode import Sample
from sparserl.rollout.worker import ProgressEngine, Rollouts
from sparserl.utils.errors import UserError
from sparserl.utils.logging import progress
from sparserl.utils.seed import derive


@dataclass
class EvalResult:
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # set -> metric -> value
    records: dict[str, list[SampleRecord]] = field(default_factory=dict)  # set -> samples by (row, sample)
    seconds: dict[str, float] = field(default_factory=dict)


def set_seed(seed: int, name: str) -> int:
    """`SamplingParams.seed` of a set: stable across processes and Python runs (no `hash()`)."""
    return derive(seed, (zlib.crc32(name.encode()), 1), modulus=2**31)


def sampling_params(cfg: Config, name: str) -> SamplingParams:
    e = cfg.eval
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens, n=e.n,
                          seed=set_seed(e.seed, name))


def format_prompts(cfg: Config, sets: list[EvalSet], tokenizer) -> list[list[str]]:
    """Prompt texts as the model sees them, formatted like training prompts (data.apply_chat_template, data.system_prompt)."""
    try:
        return [[format_prompt(r, tokenizer, cfg.data.apply_chat_template, cfg.data.system_prompt, s.spec.suffix) for r in s.rows]
                for s in sets]
    except ValueError as e:
        raise UserError(str(e)) from None


def _record(name: str, row, text: str, s: Sample, sample_index: int, tokenizer, env) -> SampleRecord:
    response = tokenizer.decode(s.response_ids, skip_special_tokens=True)  # single turn: exactly what the env scored
    return SampleRecord(
        dataset=name, index=row.index, sample=sample_index, prompt=text, response=response,
        answer=row.answer, extracted=env.extract_answer(response) if env.extract_answer is not None else None,
        correct=s.score > 0, score=s.score, tokens=sum(s.loss_mask), finish_reason=s.finish_reason, status=s.status,
        kv_peak=max((k.peak_slots for k in s.kv), default=0), kv_retained=sum(k.retained_tokens for k in s.kv),
        kv_total=sum(k.total_tokens for k in s.kv))


def _gather(records: list[SampleRecord], group) -> list[SampleRecord]:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return records
    parts: list[list[SampleRecord] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, records, group=group)
    return [r for part in parts for r in part]


def evaluate(engine: EngineHandle, tokenizer, cfg: Config, sets: list[EvalSet], texts: list[list[str]], dp_rank: int = 0,
             dp_size: int = 1, group=None, rank: int = 0) -> EvalResult:
    """Every set once; returns the same result on every rank. `texts` come from `format_prompts`. Only the owner of
    each replica group (tp or cp > 1) evaluates, through `engine.on_owner`; its peers receive its result."""
    return engine.on_owner(lambda e: _evaluate(e, tokenizer, cfg, sets, texts, dp_rank, dp_size, group, rank))


def _evaluate(engine, tokenizer, cfg: Config, sets: list[EvalSet], texts: list[list[str]], dp_rank: int, dp_size: int,
              group, rank: int) -> EvalResult:
    engine.wake()
    result = EvalResult()
    kv_bytes = getattr(engine.stats(), "kv_bytes_per_slot", 0)
    shares = [list(range(dp_rank, len(s.rows), dp_size)) for s in sets]
    # One bar for the whole evaluation (rank 0's share: every rank has about as many), with its time estimate.
    with progress(sum(len(m) for m in shares) * cfg.eval.n, "eval", rank, cfg.logger.progress, lines_every_s=30.0) as bar:
        for s, set_texts, mine in zip(sets, texts, shares):
            bar.set_description(f"eval {s.name}")
            _evaluate_set(ProgressEngine(engine, bar), tokenizer, cfg, s, set_texts, mine, group, rank, kv_bytes, result)
    return result


def _evaluate_set(engine, tokenizer, cfg: Config, s: EvalSet, set_texts: list[str], mine: list[int], group, rank: int,
                  kv_bytes: int, result: EvalResult) -> None:
    t0 = time.perf_counter()
    params = sampling_params(cfg, s.name)
    roll = dataclasses.replace(Rollouts.from_config(cfg, engine, tokenizer, s.env, params, rank), show_progress=False)
    rows, prompts = [s.rows[i] for i in mine], [set_texts[i] for i in mine]
    samples, _ = roll(rows, prompts, [r.index for r in rows], f"eval {s.name}")
    # Samples come in prompt order, `n` per prompt, in sample order (worker contract).
    local = [_record(s.name, rows[j // params.n], prompts[j // params.n], sample, j % params.n, tokenizer, s.env)
             for j, sample in enumerate(samples)]
    records = sorted(_gather(local, group), key=lambda r: (r.index, r.sample))
    result.records[s.name] = records
    result.metrics[s.name] = dataset_metrics(records, params.n, list(cfg.eval.k), s.env.extract_answer is not None, kv_bytes)
    result.seconds[s.name] = time.perf_counter() - t0


def flat_metrics(result: EvalResult) -> dict[str, float]:
    """`eval/<set>/<metric>` rows for metrics.jsonl, plus `eval/time_s`."""
    out = {f"eval/{name}/{k}": v for name, m in result.metrics.items() for k, v in m.items()}
    out["eval/time_s"] = sum(result.seconds.values())
    return out
