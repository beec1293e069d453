"""`torchrun -m sparserl.trainer.dpo key=value ...`: direct preference optimization of the policy (docs/dpo.md).

The loss is `dpo.loss` (sigmoid: DPO, -log sigmoid(beta h); ipo: (h - 1/(2 beta))^2) on the summed response
log-probs, h = (logp_c - ref_c) - (logp_r - ref_r) (algo/preference.py), averaged over the step's pairs on every
DP rank. The reference policy is the starting model: with LoRA (`actor.lora.rank > 0`) the policy itself with its
adapters off, otherwise a frozen copy built like the actor. Its log-probs are computed once per pair, the first
time the pair is seen, and cached by pair (host floats, two per pair), so later epochs and every evaluation after
the first run the policy only. A sequence is the formatted prompt, the response and EOS; a pair's prompt is
computed once for its two responses (shared prompts, actor/logprobs.py). Pairs, loop, checkpoints and resume as
in trainer/pairs.py; the keys are the GRPO trainer's plus `dpo.*`. `output_dir/hf` is the policy, exported like
SFT's (a LoRA adapter folder under LoRA), ready for `model.path` of a GRPO run or `python -m sparserl.eval`.
Metrics: dpo/loss, dpo/accuracy (pairs whose chosen implicit reward beta (logp - ref) is strictly the higher),
dpo/margin (mean chosen minus rejected reward), dpo/chosen_reward, dpo/rejected_reward, dpo/chosen_logp,
dpo/rejected_logp (summed log-probs); `eval/dpo/` the same on the held-out pairs.
Left out on purpose: a reference other than the starting model (`model.path`), and caching the reference's
log-probs across runs (a resumed run recomputes them).
"""
from __future__ import annotations


import torch

from sparserl.actor.actor import Actor
from sparserl.actor.export import export_final
from sparserl.actor.reward import PairActor
from sparserl.algo.preference import dpo_loss
from sparserl.cli import run_entry
from sparserl.config import Config
from sparserl.config.schema import DPO_CONFIG_HEADER
from sparserl.trainer import pairs as P
from sparserl.trainer.supervised import actor_options

DPO_ROOT = "outputs/dpo"
METRICS = ("dpo/loss", "dpo/accuracy", "dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/chosen_logp",
           "dpo/rejected_logp")
EVAL_METRICS = ("eval/dpo/loss", "eval/dpo/accuracy", "eval/dpo/margin", "eval/dpo/chosen_reward",
                "eval/dpo/rejected_reward", "eval/dpo/chosen_logp", "eval/dpo/rejected_logp")


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) response log-probs -> (B,) their sums over the response tokens, in float64."""
    return (logp.double() * mask[:, : logp.shape[1]].to(logp.device, torch.float64)).sum(-1)


class DPOLoss:
    """The actor's loss function over a micro-batch of whole pairs: the summed `dpo.loss` over the global pair count,
    against the reference's cached sums `ref` (B,); keeps this rank's metric sums on the device."""

    def __init__(self, name: str, beta: float, ref: torch.Tensor, mask: torch.Tensor) -> None:
        self.name, self.beta, self.ref, self.mask = name, beta, ref, mask
        self.sums: dict[str, torch.Tensor] = {}

    def __call__(self, logp: torch.Tensor, entropy, batch, idx: torch.Tensor, norm):
        seq = sequence_logps(logp, self.mask[idx.to(self.mask.device)])  # (b,) rows (chosen, rejected) per pair
        ref = self.ref[idx]
        loss, metrics = dpo_loss(self.name, self.beta, seq[0::2], seq[1::2], ref[0::2], ref[1::2])
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        return loss / (norm.seqs / 2), {}


class DPOObjective:
    def __init__(self, cfg: Config, model_path: str, mesh, device) -> None:
        opts = actor_options(cfg)
        self.actor = PairActor(model_path, mesh, device, **opts)
        if self.actor.lora is not None:
            self.reference = self.actor.reference()  # adapters off: the starting model, no second copy
        else:
            keep = {k: opts[k] for k in ("dtype", "compute_dtype", "max_tokens_per_device", "logprob_chunk_mb")}
            self.reference = Actor(model_path, mesh, device, trainable=False, **keep)
        self.name, self.beta = cfg.dpo.loss, cfg.dpo.beta
        self.cache: dict[tuple[str, int], float] = {}  # (split, pair) -> chosen sum; (split, -1 - pair) -> rejected

    def ref_sums(self, pairs: list[P.Pair], ids: list[int], split: str) -> torch.Tensor:
        """(2 x len(pairs),) the reference's summed log-probs, rows as `pair_batch`; computed for the pairs not in
        the cache yet (every rank runs the reference's forwards, with or without pairs of its own to compute)."""
        todo = [j for j, i in enumerate(ids) if (split, i) not in self.cache]
        batch = P.pair_batch([pairs[j] for j in todo])
        logp = self.reference.logprobs(batch)
        if logp is not None:
            sums = sequence_logps(logp, batch.mask).tolist()
            for n, j in enumerate(todo):
                self.cache[(split, ids[j])], self.cache[(split, -1 - ids[j])] = sums[2 * n], sums[2 * n + 1]
        values = [self.cache[(split, k)] for i in ids for k in (i, -1 - i)]
        return torch.tensor(values, dtype=torch.float64, device=self.actor.device)

    def train_step(self, pairs: list[P.Pair], ids: list[int]) -> dict[str, float]:
        a = self.actor
        lr = a.scheduler.get_last_lr()[0]
        batch = P.pair_batch(pairs)
        loss = DPOLoss(self.name, self.beta, self.ref_sums(pairs, ids, "train"), batch.mask)
        a.accumulate_gradients(batch, loss, list(range(len(batch))), with_entropy=False)
        grad_norm, _ = a._step()
        metrics = P.reduce_sums(loss.sums, len(pairs), a.dp_group, a.device)
        return {**metrics, "actor/grad_norm": grad_norm, "actor/lr": lr}

    def evaluate(self, pairs: list[P.Pair], ids: list[int]) -> dict[str, float]:
        ref = self.ref_sums(pairs, ids, "eval")
        batch = P.pair_batch(pairs)
        logp = self.actor.logprobs(batch)  # None: no held-out pairs on this rank
        sums = {}
        if logp is not None:
            seq = sequence_logps(logp, batch.mask)
            _, sums = dpo_loss(self.name, self.beta, seq[0::2], seq[1::2], ref[0::2], ref[1::2])
        means = P.reduce_sums({k: sums.get(k, 0.0) for k in METRICS}, len(pairs), self.actor.dp_group, self.actor.device)
        return {held: means[k] for k, held in zip(METRICS, EVAL_METRICS)}

    def export(self, cfg: Config, tokenizer, rank: int) -> None:
        export_final(cfg, self.actor, tokenizer, rank)


def train(cfg: Config) -> None:
    P.train_pairs(cfg, "dpo", DPO_ROOT, DPO_CONFIG_HEADER, DPOObjective, eos=True,
                  console=("dpo/loss", "dpo/accuracy", "dpo/margin"))


def main(argv: list[str] | None = None) -> None:
    run_entry(train, argv)


if __name__ == "__main__":
    main()
