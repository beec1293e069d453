"""The trainer's side of partial rollouts (`rollout.partial.*`, sparserl/rollout/partial.py): building the rollout
call, saving the samples in flight with a checkpoint, and the step's `partial/*` metrics.

Saved with the run: every replica owner's open groups (their tokens, per-token sampler log-probs, the steps that drew
them, the ended members' rewards) are gathered into `trainer_state.pt` under "partial", one list per data-parallel
rank with the number of ranks (`by_dp_rank`); on resume with as many ranks each owner takes its own list back, so the
run goes on as the uninterrupted one, drawn on with the same keyed streams; with another number the groups are dealt
anew (the i-th goes to rank i mod dp) and the run continues, not identically (`deal`, docs/decisions.md). The KV of a
carried sample is never saved: it is re-prefilled at every step anyway.

Metrics (over all data-parallel ranks): the share of the trained samples that were carried, the samples in flight
after the step, and for each age a (steps between the weights that drew a token and the step that trains on it) the
share of the trained model tokens of that age and their mismatch, mean logp_sparse - logp_old, the batch's
`mismatch/kl` split by age.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.engines.protocol import supports_partial
from sparserl.rollout.episode import Sample
from sparserl.rollout.partial import PartialRollouts, PartialSettings
from sparserl.trainer.saved_state import SavedState
from sparserl.utils.errors import UserError
from sparserl.utils.logging import log0

KEY = "partial"


def build_partial(cfg, engine, tokenizer, env, params, rank: int, max_total_tokens: int | None,
                  owner: bool = True) -> PartialRollouts | None:
    """The rollout call of a run with `rollout.partial.enable=true` (None when off); `owner`: this rank runs the engine."""
    p = cfg.rollout.partial
    if not p.enable:
        return None
    if owner and not supports_partial(engine):
        raise UserError(f"rollout.partial.enable=true: the {type(engine).__name__} engine cannot stop a call and resume "
                        "a sample; use rollout.engine=native")
    try:
        return PartialRollouts(engine, tokenizer, env, params, PartialSettings(p.finish_frac, p.max_tokens, p.max_staleness),
                               rank, cfg.logger.progress, max_total_tokens, cfg.env.step_timeout_s, cfg.env.max_concurrency,
                               max_turns=cfg.env.max_turns)
    except ValueError as e:
        raise UserError(f"{e} (env.path={cfg.env.path})") from None


def register(saved: SavedState, partial: PartialRollouts | None, dp_rank: int, dp_size: int, owner: bool) -> None:
    """The samples in flight as a piece of the trainer state (every rank saves; only replica owners hold any)."""
    if partial is None:
        return

    def save() -> dict:
        mine = (dp_rank, owner, partial.state_dict())
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return by_dp_rank([mine], dp_size)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return by_dp_rank(everyone, dp_size)

    def load(state) -> None:
        groups, note = deal(state, dp_rank, dp_size)
        if note:
            log0(note)
        partial.load_state_dict(groups if owner else [])

    saved.register(KEY, save, load, default=[])


def refuse_dropping(state: dict, path, partial: PartialRollouts | None) -> None:
    """A checkpoint with samples in flight resumed with `rollout.partial.enable=false` would drop them silently: a
    UserError instead (the run that saved them finishes them: resume it with partial rollouts on)."""
    saved = state.get(KEY)
    if partial is not None or not saved:
        return
    flat = [g for part in saved["ranks"] for g in part] if isinstance(saved, dict) else list(saved)
    going = sum(not m["ended"] for g in flat for m in g["members"])
    if going:
        raise UserError(f"trainer.resume={path}: the checkpoint holds {going} samples in flight (partial rollouts), "
                        "which rollout.partial.enable=false would drop; resume with rollout.partial.enable=true to "
                        "finish them, or start a new run")


def by_dp_rank(gathered: list[tuple[int, bool, list[dict]]], dp_size: int) -> dict:
    """The saved piece from every rank's (data-parallel rank, replica owner, open groups): the owners' groups, one
    list per data-parallel rank, and the number of ranks."""
    ranks: list[list[dict]] = [[] for _ in range(dp_size)]
    for dp_rank, owner, groups in gathered:
        if owner:
            ranks[dp_rank] = list(groups)
    return {"dp_size": dp_size, "ranks": ranks}


def deal(state: dict | list, dp_rank: int, dp_size: int) -> tuple[list[dict], str]:
    """This data-parallel rank's open groups from the saved piece, and a line to log ("" when none): its own list
    when the run saved with `dp_size` ranks; otherwise (or a flat list, as saved before the per-rank lists) every
    group dealt anew, the i-th to rank i mod dp_size."""
    if isinstance(state, dict) and int(state["dp_size"]) == dp_size:
        return list(state["ranks"][dp_rank]), ""
    flat = [g for part in state["ranks"] for g in part] if isinstance(state, dict) else list(state)
    if not flat or (dp_size == 1 and not isinstance(state, dict)):  # one rank before and after: nothing moved
        return flat, ""
    saved = f"{int(state['dp_size'])} data-parallel ranks" if isinstance(state, dict) else "one flat list"
    return flat[dp_rank::dp_size], (
        f"partial rollouts: the {len(flat)} groups in flight were saved with {saved} and are dealt anew to "
        f"{dp_size}: the run continues with them, but not as the uninterrupted run would have")


def partial_metrics(step: int, samples: list[Sample], batch: TrainBatch, partial: PartialRollouts, dp_group,
                    device) -> dict[str, float]:
    """The step's `partial/*` metrics (a collective over the DP group); call after the update (logp_old set)."""
    ages = partial.settings.max_staleness + 1
    drawn = _drawn_by_row(samples, batch, dp_group)
    mask = batch.response_mask if batch.response_mask is not None else batch.mask
    tokens = torch.zeros(ages, dtype=torch.float64)
    diff = torch.zeros(ages, dtype=torch.float64)
    if batch.logp_old is not None and len(batch):
        gap = (batch.logp_sparse - batch.logp_old).detach().to(torch.float64).cpu() * mask.cpu()  # (B, T)
        age = torch.zeros(mask.shape, dtype=torch.long)
        for j, steps in enumerate(drawn):
            if steps:
                age[j, : len(steps)] = (step - torch.tensor(steps)).clamp(0, ages - 1)
        tokens.index_add_(0, age.flatten(), mask.cpu().to(torch.float64).flatten())
        diff.index_add_(0, age.flatten(), gap.flatten())
    carried = sum(bool(s.drawn_at) and min(s.drawn_at) < step for s in samples)
    counts = torch.tensor([carried, len(samples), partial.in_flight, partial.calls], dtype=torch.float64)
    sums = torch.cat([counts, tokens, diff]).to(device)
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    sums = sums.cpu()
    carried, trained, in_flight, calls = sums[:4].tolist()
    tokens, diff = sums[4: 4 + ages], sums[4 + ages:]
    total = max(float(tokens.sum()), 1.0)
    out = {"partial/carried_frac": carried / max(trained, 1.0), "partial/in_flight": in_flight,
           "partial/trained_samples": trained, "partial/calls": calls}
    for a in range(ages):  # names by str.format, which the metric-name scan reads as the families' templates
        out["partial/tokens_age{}".format(a)] = float(tokens[a]) / total
        if tokens[a] > 0:
            out["partial/mismatch_kl_age{}".format(a)] = float(diff[a] / tokens[a])
    return out


def fresh_mask(step: int, samples: list[Sample], batch: TrainBatch) -> torch.Tensor:
    """(B, T) 1 on the tokens drawn in `step` (`Sample.drawn_at`), rows as `samples` (before any balancing), in the
    mask's dtype: `TrainBatch.fresh_mask`, the tokens the sampler's statistics read (algo/sampler_stats.py)."""
    fresh = torch.zeros(batch.mask.shape, dtype=batch.mask.dtype)
    for j, s in enumerate(samples):
        if s.drawn_at:
            fresh[j, : len(s.drawn_at)] = (torch.tensor(s.drawn_at) == step).to(fresh.dtype)
    return fresh.to(batch.mask.device)


def _drawn_by_row(samples: list[Sample], batch: TrainBatch, dp_group) -> list[list[int]]:
    """Each batch row's `drawn_at`: its own sample's, or, where the update's balancing moved rows between ranks
    (`batch.origin`), the sample's on the rank that rolled it out."""
    if batch.origin is None:
        return [s.drawn_at for s in samples]
    world = dist.get_world_size(dp_group)
    everyone: list[list[list[int]]] = [None] * world
    dist.all_gather_object(everyone, [s.drawn_at for s in samples], group=dp_group)
    return [everyone[r][i] for r, i in batch.origin]
