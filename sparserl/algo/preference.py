"""Pairwise preference losses: the reward model's Bradley-Terry loss and DPO's objectives (a registry).

Inputs are per-pair tensors (P,): a reward model's scalar scores, or a policy's and the reference's summed
log-probs of each pair's chosen and rejected response. Each function returns (summed loss, metrics as sums over
the P pairs): the caller divides by the global pair count, so micro-batches and DP ranks add up to the mean.
- Bradley-Terry: -log sigmoid(r_chosen - r_rejected).
- DPO (`dpo.loss=sigmoid`): -log sigmoid(beta * h), h = (logp_c - ref_c) - (logp_r - ref_r).
- IPO (`dpo.loss=ipo`): (h - 1 / (2 beta))^2, on the same summed log-ratios h.
DPO's implicit rewards are beta * (logp - ref) of each response; accuracy counts pairs whose chosen reward is
strictly the higher.
Left out on purpose: label smoothing (conservative DPO), length-normalized log-probs and the hinge / robust
variants; each would be one more entry in `DPO_LOSSES`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model loss of P pairs of scores (P,): summed -log sigmoid(r_c - r_r) and metric sums."""
    margin = chosen - rejected  # (P,)
    loss = -F.logsigmoid(margin).sum()
    d = margin.detach()
    return loss, {"rm/loss": loss.detach(), "rm/accuracy": (d > 0).sum().to(d.dtype), "rm/margin": d.sum(),
                  "rm/chosen_score": chosen.detach().sum(), "rm/rejected_score": rejected.detach().sum()}


def _log_ratio_margin(logp_c, logp_r, ref_c, ref_r) -> torch.Tensor:
    return (logp_c - ref_c) - (logp_r - ref_r)  # (P,)


def sigmoid_dpo(h: torch.Tensor, beta: float) -> torch.Tensor:
    return -F.logsigmoid(beta * h)


def ipo(h: torch.Tensor, beta: float) -> torch.Tensor:
    return (h - 1.0 / (2.0 * beta)) ** 2


DPO_LOSSES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {"sigmoid": sigmoid_dpo, "ipo": ipo}


def dpo_loss(name: str, beta: float, logp_c: torch.Tensor, logp_r: torch.Tensor, ref_c: torch.Tensor,
             ref_r: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO-family loss of P pairs (each (P,): summed response log-probs under the policy and the reference)."""
    h = _log_ratio_margin(logp_c, logp_r, ref_c, ref_r)
    loss = DPO_LOSSES[name](h, beta).sum()
    chosen = beta * (logp_c - ref_c).detach()
    rejected = beta * (logp_r - ref_r).detach()
    margin = chosen - rejected
    return loss, {"dpo/loss": loss.detach(), "dpo/accuracy": (margin > 0).sum().to(margin.dtype),
                  "dpo/margin": margin.sum(), "dpo/chosen_reward": chosen.sum(), "dpo/rejected_reward": rejected.sum(),
                  "dpo/chosen_logp": logp_c.detach().sum(), "dpo/rejected_logp": logp_r.detach().sum()}
