"""`torchrun -m sparserl.trainer.rm key=value ...`: a reward model trained on preference pairs (docs/rm.md).

The model is `model.path` with a scalar head on the last token of each sequence (actor/reward.py `RewardModel`);
the loss is Bradley-Terry, -log sigmoid(r_chosen - r_rejected), averaged over the step's pairs on every DP rank
(algo/preference.py). A sequence is the formatted prompt followed by the response, nothing appended: the score is
read at the response's last token, the token Hugging Face's sequence-classification class scores in the export.
Pairs come from `data.train_path` (default: the shipped data/preference pairs), the held-out pairwise accuracy
from `rm.eval_path`; the loop, checkpoints and resume are trainer/pairs.py's; the keys are the GRPO trainer's
(`model.*`, `actor.*` for AdamW, packing and LoRA, `parallel.cp`, `trainer.*`) plus `rm.*`. The result,
`output_dir/hf`, loads with `AutoModelForSequenceClassification` (adapters merged).
Metrics: rm/loss, rm/accuracy (pairs whose chosen score is strictly higher), rm/margin (mean r_c - r_r),
rm/chosen_score, rm/rejected_score; `eval/rm/` the same on the held-out pairs.
Tensor parallelism replicates the score head over tp (actor/reward.py). Left out on purpose: margin or
regularization terms (centering the scores).
"""
from __future__ import annotations


import torch

from sparserl.actor.reward import RewardModel, export_reward_model
from sparserl.algo.preference import bradley_terry
from sparserl.cli import run_entry
from sparserl.config import Config
from sparserl.config.schema import RM_CONFIG_HEADER
from sparserl.trainer import pairs as P
from sparserl.trainer.supervised import actor_options

RM_ROOT = "outputs/rm"
METRICS = ("rm/loss", "rm/accuracy", "rm/margin", "rm/chosen_score", "rm/rejected_score")
EVAL_METRICS = ("eval/rm/loss", "eval/rm/accuracy", "eval/rm/margin", "eval/rm/chosen_score", "eval/rm/rejected_score")


class BTLoss:
    """The actor's loss function over a micro-batch of whole pairs: summed Bradley-Terry loss over the global pair
    count; keeps this rank's metric sums on the device (read once per step)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def __call__(self, scores: torch.Tensor, entropy, batch, idx: torch.Tensor, norm):
        s = scores[:, 0]  # (b,) rows (chosen, rejected) of each pair, in order
        loss, metrics = bradley_terry(s[0::2], s[1::2])
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.to(torch.float64)
        return loss / (norm.seqs / 2), {}


class RewardObjective:
    def __init__(self, cfg: Config, model_path: str, mesh, device) -> None:
        self.actor = RewardModel(model_path, mesh, device, **actor_options(cfg))

    def train_step(self, pairs: list[P.Pair], ids: list[int]) -> dict[str, float]:
        a = self.actor
        lr = a.scheduler.get_last_lr()[0]
        loss = BTLoss()
        batch = P.pair_batch(pairs)
        a.accumulate_gradients(batch, loss, list(range(len(batch))), with_entropy=False)
        grad_norm, _ = a._step()
        metrics = P.reduce_sums(loss.sums, len(pairs), a.dp_group, a.device)
        return {**metrics, "actor/grad_norm": grad_norm, "actor/lr": lr}

    def evaluate(self, pairs: list[P.Pair], ids: list[int]) -> dict[str, float]:
        scores = self.actor.scores(P.pair_batch(pairs))  # None: no held-out pairs on this rank
        _, sums = bradley_terry(scores[0::2].double(), scores[1::2].double()) if scores is not None else (None, {})
        means = P.reduce_sums({k: sums.get(k, 0.0) for k in METRICS}, len(pairs), self.actor.dp_group, self.actor.device)
        return {held: means[k] for k, held in zip(METRICS, EVAL_METRICS)}

    def export(self, cfg: Config, tokenizer, rank: int) -> None:
        export_reward_model(cfg, self.actor, tokenizer, rank)


def train(cfg: Config) -> None:
    P.train_pairs(cfg, "rm", RM_ROOT, RM_CONFIG_HEADER, RewardObjective, eos=False,
                  console=("rm/loss", "rm/accuracy", "rm/margin"))


def main(argv: list[str] | None = None) -> None:
    run_entry(train, argv)


if __name__ == "__main__":
    main()
