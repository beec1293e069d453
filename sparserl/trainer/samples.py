"""Logged samples (`trainer.log_samples`): a few of each step's sequences, token by token, for reading and for
`python -m sparserl.report`.

Every step, rank 0 writes `output_dir/samples/step_<N>.jsonl`: one JSON object per logged sequence with its
prompt, response, reward, score, status, turns, advantage (its mean over the loss tokens for a per-token
estimator), the correction's outcome (`rejected`, `vetoed`,
`geo_rejected`), the response positions where the KV cache was compressed (`compressed_at`: token k onward was
sampled from the compressed cache), and per response token (`tokens`, one list per field, all the same length):
`text`, `id`, `logp_sparse`, `logp_old`, `log_xi` (clamped, as the correction sees it), `weight` (the importance
weight of the loss, after the batch normalization; 1 where the token is out of the loss), `loss_mask` (1 = a model
token, 0 = an env token), `masked` (dropped by `token_low` / `token_high`) and `veto` (xi below `veto`: the
tokens that reject the sequence). With wandb on, the same rows (without the per-token lists) go to a wandb Table.

Which sequences: `trainer.log_samples` of rank 0's rollouts, evenly spaced over them (so several prompt groups
show up), the same positions every step. logp_old is the one the update used: on the fused path it comes
out of the update's forward, so records are built after the update; when `actor.balance_ranks` moved a logged
sequence to another DP rank, that rank sends its logp_old row back to rank 0 (one `gather_object` per step of a
few rows). The flags and weights are recomputed from (logp_old, logp_sparse, loss mask) with the correction's
own decision function (`algo.correction.explain`): every decision is local to a sequence, so they are the ones
the loss took; tests/process/test_samples_run.py checks them against the tensors the loss received.

Bounded size: at most 64 sequences per step (the config rule; default 4), each with at most
`MAX_RESPONSE_TOKENS` response tokens (later ones are dropped, `tokens_dropped` says how many; the decisions
still see the whole sequence) and the last `MAX_PROMPT_CHARS` characters of its prompt. Floats keep 6
significant digits. A record is at most about 0.3 MB, so a default step (4 records) writes at most ~1.2 MB and
typically a few KB (48-token responses). Nothing here feeds back into training: records are read from the
batch after the update, and sampling draws no random numbers.

Left out on purpose: logging from every rank (rank 0's share is a fair sample: prompts are shuffled), picking
sequences by content (highest mismatch, rejected first: the viewer filters), per-token entropy or the learner's
log-probs, and a size limit on the whole folder (delete old step files, or set trainer.log_samples=0).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sparserl.actor.actor import TrainBatch
from sparserl.algo.correction import explain
from sparserl.algo.correction_config import CorrectionConfig
from sparserl.rollout.episode import Sample

MAX_RESPONSE_TOKENS = 4096
MAX_PROMPT_CHARS = 4000
TABLE_TEXT_CHARS = 2000  # prompt / response characters in a wandb Table cell


def pick_rows(num_rows: int, k: int) -> list[int]:
    """`k` row indices evenly spread over `num_rows` (all of them when k >= num_rows)."""
    if k <= 0 or num_rows <= 0:
        return []
    if k >= num_rows:
        return list(range(num_rows))
    return sorted({(i * num_rows) // k for i in range(k)})


@dataclass
class LoggedRow:
    """What the update knew about one logged sequence: its dense log-probs and advantage."""

    logp_old: list[float]  # over the whole response
    advantage: float


def rank0_count(num_rows: int, batch: TrainBatch, dp_group) -> int:
    """DP rank 0's number of rollout samples, on every DP rank where rows moved between ranks (`batch.origin` set):
    the other ranks must pick the same rows of rank 0's as rank 0 does, and with partial rollouts the ranks' sample
    counts differ. A collective in that case; elsewhere `num_rows`."""
    if batch.origin is None or not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return num_rows
    n = torch.tensor([num_rows], device=batch.mask.device)
    dist.broadcast(n, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    return int(n.item())


def fetch_rows(batch: TrainBatch, picked: list[int], dp_group) -> dict[int, LoggedRow] | None:
    """Rank 0's logged rows (its rollout indices `picked`) from the batch the update trained on.

    A collective over the DP group when `balance_ranks` moved rows (`batch.origin` set): every DP rank must call
    it. Returns the rows on DP rank 0, None elsewhere.
    """
    distributed = dist.is_initialized() and dist.get_world_size(dp_group) > 1
    dp_rank = dist.get_rank(dp_group) if distributed else 0
    want = set(picked)
    local = []  # (index in rank 0's rollout, row in this batch)
    for j in range(len(batch)):
        src, i = batch.origin[j] if batch.origin is not None else (dp_rank, j)
        if src == 0 and i in want:
            local.append((i, j))
    mine: dict[int, LoggedRow] = {}
    if local:
        rows = [j for _, j in local]
        logp_old = batch.logp_old[rows].detach().float().cpu()  # (k, T): one device copy for all rows
        adv = batch.advantages[rows].detach().float()
        if adv.dim() == 2:  # per token: the mean over the row's loss tokens
            mask = (batch.mask[rows, :adv.shape[1]] > 0).float()
            adv = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        adv = adv.cpu().tolist()
        for n, (i, j) in enumerate(local):
            r = len(batch.ids[j]) - batch.prompt_lens[j]
            mine[i] = LoggedRow(logp_old[n, :r].tolist(), adv[n])
    if distributed and batch.origin is not None:
        parts: list | None = [None] * dist.get_world_size(dp_group) if dp_rank == 0 else None
        dist.gather_object(mine, parts, dst=dist.get_global_rank(dp_group, 0), group=dp_group)
        if dp_rank == 0:
            mine = {i: row for part in parts for i, row in part.items()}
    return mine if dp_rank == 0 else None


def _num(x: float) -> float | None:
    """6 significant digits; None for NaN / inf (JSON has neither)."""
    return float(f"{x:.6g}") if math.isfinite(x) else None


def _correction_mode(cfg: CorrectionConfig) -> str:
    return cfg.mode if cfg.enable else "off"


def build_record(step: int, index: int, sample: Sample, row: LoggedRow, cfg: CorrectionConfig, norm_factor: float,
                 tokenizer) -> dict:
    """One logged sequence as a JSON-ready dict (see the module docstring for the fields)."""
    n_resp = len(sample.response_ids)
    if len(row.logp_old) != n_resp:
        raise RuntimeError(f"logged sample {index}: {len(row.logp_old)} dense log-probs for {n_resp} response tokens")
    # float32, as in the training batch (train_batch.py pads into float32), so every threshold sees the same bits.
    logp_old = torch.tensor([row.logp_old], dtype=torch.float32)  # (1, T)
    logp_sparse = torch.tensor([sample.logp_sparse], dtype=torch.float32)  # (1, T)
    mask = torch.tensor([sample.loss_mask], dtype=torch.float32)  # (1, T)
    log_xi, d = explain(cfg, logp_old, logp_sparse, mask)  # over the whole response: a late token can veto
    on = mask > 0
    applied = cfg.enable and cfg.mode == "apply"
    if cfg.enable:
        weights = torch.where(d.keep, d.raw_weights / norm_factor, torch.ones_like(log_xi)) if applied else torch.ones_like(log_xi)
        masked = (d.low | d.high)[0]
        veto_tok = (on & (log_xi < math.log(cfg.veto)))[0] if cfg.veto else torch.zeros_like(on[0])
        vetoed, geo = bool(d.veto[0]), bool(d.geo[0])
    else:
        weights, masked, veto_tok, vetoed, geo = torch.ones_like(log_xi), torch.zeros_like(on[0]), torch.zeros_like(on[0]), False, False

    n = min(n_resp, MAX_RESPONSE_TOKENS)
    ids = sample.response_ids[:n]
    prompt = tokenizer.decode(sample.prompt_ids, skip_special_tokens=False)
    kv_total = sum(k.total_tokens for k in sample.kv)
    return {
        "step": step,
        "index": index,
        "group": sample.group,
        "prompt": prompt[-MAX_PROMPT_CHARS:],
        "prompt_chars_dropped": max(0, len(prompt) - MAX_PROMPT_CHARS),
        "response": tokenizer.decode(sample.response_ids, skip_special_tokens=False),
        "reward": _num(sample.reward),
        "score": _num(sample.score),
        "status": sample.status,
        "finish_reason": sample.finish_reason,
        "turns": sample.num_turns,
        "advantage": _num(row.advantage),
        "correction": _correction_mode(cfg),
        "rejected": vetoed or geo,
        "vetoed": vetoed,
        "geo_rejected": geo,
        "compressed_at": list(sample.compressed_at),
        "kv_retained_frac": _num(sum(k.retained_tokens for k in sample.kv) / kv_total) if kv_total else None,
        "num_tokens": n_resp,
        "tokens_dropped": n_resp - n,
        "tokens": {
            "text": tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False),
            "id": list(ids),
            "logp_sparse": [_num(x) for x in sample.logp_sparse[:n]],
            "logp_old": [_num(x) for x in row.logp_old[:n]],
            "log_xi": [_num(x) for x in log_xi[0, :n].tolist()],
            "weight": [_num(x) for x in weights[0, :n].tolist()],
            "loss_mask": [int(x) for x in sample.loss_mask[:n]],
            "masked": [int(x) for x in masked[:n].tolist()],
            "veto": [int(x) for x in veto_tok[:n].tolist()],
        },
    }


class SampleLog:
    """`trainer.log_samples` sequences per step to `samples/step_<N>.jsonl` (and a wandb Table); see the module
    docstring. Every rank constructs it and calls `log` (a collective when rows moved between ranks); only
    global rank 0 writes."""

    def __init__(self, output_dir: str | Path, count: int, rank: int, correction: CorrectionConfig, tokenizer,
                 wandb_run=None) -> None:
        self.count, self.rank, self.cfg, self.tokenizer, self.wandb_run = count, rank, correction, tokenizer, wandb_run
        self.dir = Path(output_dir) / "samples"

    @property
    def enabled(self) -> bool:
        return self.count > 0

    def truncate_after(self, step: int) -> None:
        """Drop step files past `step` (a resume re-runs those steps; a fresh run passes -1 and drops them all)."""
        if self.rank != 0 or not self.dir.is_dir():
            return
        for path in self.dir.glob("step_*.jsonl"):
            n = path.stem.removeprefix("step_")
            if n.isdigit() and int(n) > step:
                path.unlink()

    def log(self, step: int, samples: list[Sample], batch: TrainBatch, norm_factor: float, dp_group) -> list[dict]:
        """Call after the update with this rank's rollout `samples` and the batch the update trained on;
        `norm_factor` is `correction/norm_factor` of the step (1 without batch normalization). Returns the
        records written (empty off rank 0)."""
        if not self.enabled:
            return []
        picked = pick_rows(rank0_count(len(samples), batch, dp_group), self.count)
        rows = fetch_rows(batch, picked, dp_group)
        if self.rank != 0 or rows is None:
            return []
        records = [build_record(step, i, samples[i], rows[i], self.cfg, norm_factor, self.tokenizer) for i in picked]
        self._write(step, records)
        if self.wandb_run is not None:
            self._wandb_table(step, records)
        return records

    def _write(self, step: int, records: list[dict]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
        os.replace(tmp, path)  # a reader (the report) never sees half a file

    def _wandb_table(self, step: int, records: list[dict]) -> None:
        import wandb

        columns = ["step", "index", "group", "reward", "status", "advantage", "rejected", "compressions",
                   "max_abs_log_xi", "prompt", "response"]
        data = []
        for r in records:
            lx = [abs(x) for x, m in zip(r["tokens"]["log_xi"], r["tokens"]["loss_mask"]) if m and x is not None]
            data.append([r["step"], r["index"], r["group"], r["reward"], r["status"], r["advantage"], r["rejected"],
                         len(r["compressed_at"]), max(lx, default=0.0), r["prompt"][-TABLE_TEXT_CHARS:],
                         r["response"][:TABLE_TEXT_CHARS]])
        self.wandb_run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)
