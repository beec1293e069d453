"""Partial rollouts in the native engine: a `generate` call that stops early (`Cutoff`), and a request that resumes a
sample an earlier call stopped (`Resume`).

Both ride on optimistic admission's retraction (scheduler.py): a stopped sequence gives its slots back as a
finished one does and returns what it drew with finish_reason "abort"; a resumed one starts as a retracted one
comes back, with its prompt and the tokens it drew as `output`, nothing cached, and re-prefill stops at the logical
lengths where it was compacted (`Sequence.replay_ends`), so a compressed cache is compacted again where it was. Its
draws stay keyed by (its seed, its sample index, the logical position), so with the weights unchanged it draws the
tokens an uninterrupted call would have; under new weights its re-prefill and recompaction are the new weights'.
A resumed sample keeps the compression budget it was drawn under (`Resume.kv_budget`) until it ends, for its schedule
and its worst-case reservation (`resume_plan`): `set_kv_budget` (`rollout.kv.budget=auto`) may have moved the
engine's since, and its replay points were made on the old budget's schedule, whose stretches the new worst case
need not hold.

Left out on purpose: keeping a stopped sequence's KV between calls (the caller's weights change in between, and a
held cache would pin the pool), and sessions (a multi-turn trajectory is not carried).
"""
from __future__ import annotations

import math
from typing import Callable

from sparserl.engines.native.compressor import Compressor
from sparserl.engines.native.scheduler import Scheduler
from sparserl.engines.native.sequence import Sequence, Status
from sparserl.engines.types import Cutoff, GenerationRequest, Resume
from sparserl.kv import KVPolicyConfig


def check_resume(req: GenerationRequest) -> None:
    """A request's `Resume` is one the engine can continue (checked before any work starts)."""
    r = req.resume
    if len(r.token_ids) != len(r.logp_sparse):
        raise ValueError(f"request {req.request_id!r}: resumed with {len(r.token_ids)} tokens but "
                         f"{len(r.logp_sparse)} log-probs")
    if r.kv_budget is not None and (isinstance(r.kv_budget, bool) or not isinstance(r.kv_budget, int) or r.kv_budget < 1):
        raise ValueError(f"request {req.request_id!r}: Resume.kv_budget must be a positive int or None, got {r.kv_budget!r}")
    if len(r.token_ids) >= req.params.max_new_tokens:
        raise ValueError(f"request {req.request_id!r}: resumed with {len(r.token_ids)} tokens, nothing left to draw "
                         f"under max_new_tokens={req.params.max_new_tokens}")


def resume_plan(compressor: Compressor | None, resume: Resume, prompt_len: int,
                max_new_tokens: int) -> tuple[KVPolicyConfig | None, int]:
    """The compression config a resumed sample runs under (None: dense) and its worst-case slots. It keeps the budget it
    was drawn under; without one (drawn dense, or by an engine that does not report it) it takes the current budget
    on the dense worst case, which holds any stretch its re-prefill replays."""
    dense = prompt_len + max_new_tokens - 1  # the last sampled token is never fed back
    if compressor is None:
        return None, dense
    if resume.kv_budget is None:
        return compressor.cfg, dense
    kv = compressor.cfg.with_budget(resume.kv_budget)
    return kv, min(dense, compressor.max_slots(prompt_len, max_new_tokens, cfg=kv))


def resume_sequence(seq: Sequence, resume: Resume, compressing: bool) -> None:
    """Make `seq` a sequence coming back with the tokens it drew (`check_resume` passed)."""
    seq.sample_index = resume.sample_index
    seq.output, seq.logps = list(resume.token_ids), [float(x) for x in resume.logp_sparse]
    seq.resumed = len(resume.token_ids)
    # A dense engine (or `engine.dense()`) rebuilds a dense cache: the earlier compactions are not replayed.
    seq.compressed_at = [c for c in resume.compressed_at if 0 < c <= seq.resumed] if compressing else []
    seq.replay_ends = [len(seq.prompt) + c - 1 for c in seq.compressed_at]


class CutoffWatch:
    """Which sequences of one `generate` call the cutoff stops after each step."""

    def __init__(self, cutoff: Cutoff, seqs: list[Sequence]) -> None:
        if not 0.0 < cutoff.finish_frac <= 1.0:
            raise ValueError(f"Cutoff.finish_frac must be in (0, 1], got {cutoff.finish_frac}")
        self.cutoff, self.seqs = cutoff, seqs
        self.need = math.ceil(cutoff.finish_frac * len(seqs) - 1e-9)  # ended sequences that stop the call
        self.stopping = False

    def due(self) -> list[Sequence]:
        c = self.cutoff
        if not self.stopping:
            ended = sum(s.finish_reason is not None and s.finish_reason != "abort" for s in self.seqs)
            self.stopping = ended >= self.need and ended < len(self.seqs)
        # While an exempt sequence still runs the call goes on anyway, so the others decode on beside it.
        stop_all = self.stopping and not any(s.finish_reason is None and s.request_index in c.exempt for s in self.seqs)
        out = []
        for s in self.seqs:
            if s.finish_reason is not None or s.request_index in c.exempt:
                continue
            if stop_all or (c.max_tokens and len(s.output) - s.resumed >= c.max_tokens):
                out.append(s)
        return out


    def stop_due(self, scheduler: Scheduler, retire: Callable[[Sequence], None]) -> None:
        """Stop the due sequences: a running one is retired (`retire`, as "abort"), a queued one taken off the queue."""
        for seq in self.due():
            if seq.status is Status.RUNNING:
                retire(seq)
                continue
            assert seq.status is Status.WAITING and not seq.slots, "only sequences without cache entries wait here"
            scheduler.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
