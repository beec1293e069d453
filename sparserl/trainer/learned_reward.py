"""`env.reward_model.path`: a learned reward in the RL trainer, a reward model exported by `sparserl.trainer.rm`
scoring every sample (docs/rm.md).

The scorer is `RewardScorer` (actor/reward.py) with its head read from the export, frozen (no optimizer), on the
actor's devices and mesh: FSDP2 over dp (x cp), the head replicated over tp, loaded on rank 0 and broadcast like the
actor. Each rollout round's samples are scored as soon as the round is back, with the engine asleep (its KV memory
given back; the next round wakes it again), before dynamic sampling, advantages or the rescue read the rewards; the
rescue's dense redraws are scored the same way. A sample is scored as the reward model was trained: the prompt
followed by the response (multi-turn: every turn, env tokens included) without the trailing end-of-sequence token,
read at its last token. `mode=replace`: reward = coef x score; `mode=add`: reward = env reward + coef x score.
Samples that ended in an error, a timeout or an abort keep the env's reward (their text is not a response).
The scorer must share the policy's tokenizer (the same vocabulary: it reads the policy's token ids), checked at
start-up. Metrics: `reward_model/score_mean`, `reward_model/score_std` and `reward_model/env_reward_mean` over the
step's scored samples on all data-parallel ranks (reward/ is then the reward the advantages read).
Left out on purpose: offloading the scorer to host memory between steps (GPU memory: docs/performance.md), and
a reward model with its own tokenizer (re-tokenizing the decoded text).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from sparserl.actor.actor import TrainBatch
from sparserl.actor.reward import RewardScorer, exported_score
from sparserl.config import Config
from sparserl.parallel import all_reduce_sum
from sparserl.rollout.episode import Sample
from sparserl.utils.errors import UserError

SCORED = ("ok", "truncated")  # statuses whose samples the reward model scores


def check_export(path: str) -> None:
    """`env.reward_model.path` is a reward-model export: a folder whose config has num_labels=1 and whose
    safetensors hold the score head (one line otherwise)."""
    key = f"env.reward_model.path={path}"
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UserError(f"{key}: not a model folder (no config.json); give the hf/ folder of a sparserl.trainer.rm run")
    config = json.loads((folder / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    if not arch.endswith("ForSequenceClassification") or config.get("num_labels", len(config.get("id2label", {}))) != 1:
        raise UserError(f"{key}: a {arch or 'model'} with {config.get('num_labels', len(config.get('id2label', {})))} "
                        "labels, not a reward model (ForSequenceClassification, num_labels=1, as sparserl.trainer.rm "
                        "exports)")
    try:
        exported_score(path)
    except ValueError as e:
        raise UserError(f"env.reward_model.path={e}") from None


def check_tokenizer(path: str, tokenizer) -> None:
    """The scorer reads the policy's token ids: its tokenizer must have the same vocabulary."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"env.reward_model.path={path}: no tokenizer to check against the policy's ({e})") from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"env.reward_model.path={path}: its tokenizer's vocabulary ({len(theirs)} tokens) is not the "
                        f"policy's ({len(tokenizer)}); train the reward model from the policy's model")


class LearnedReward:
    """The frozen scorer and what it did this step."""

    def __init__(self, cfg: Config, tokenizer, mesh, device) -> None:
        r = cfg.env.reward_model  # the export itself was checked before the processes started (trainer/preflight.py)
        check_tokenizer(r.path, tokenizer)
        self.mode, self.coef, self.device = r.mode, float(r.coef), device
        self.model = RewardScorer(r.path, mesh, device, head_path=r.path, trainable=False, dtype=cfg.model.dtype,
                                 compute_dtype=cfg.model.compute_dtype,
                                 max_tokens_per_device=cfg.actor.max_tokens_per_device,
                                 logprob_chunk_mb=cfg.actor.logprob_chunk_mb)
        eos = tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.dp_group = self.model.dp_group
        self._sums = torch.zeros(4, dtype=torch.float64)  # count, sum score, sum score^2, sum env reward

    def _sequence(self, s: Sample) -> list[int]:
        resp = s.response_ids[:-1] if s.response_ids and s.response_ids[-1] in self.eos else s.response_ids
        return s.prompt_ids + resp

    def apply(self, samples: list[Sample]) -> None:
        """Score this rank's scored samples and set their rewards (a collective: every rank calls it, with or
        without samples)."""
        picked = [s for s in samples if s.status in SCORED]
        seqs = [self._sequence(s) for s in picked]
        batch = TrainBatch(ids=seqs, prompt_lens=[len(s.prompt_ids) for s in picked],
                           mask=torch.ones(len(picked), 1, device=self.device),
                           advantages=torch.zeros(len(picked), device=self.device))
        scores = self.model.scores(batch)
        if scores is None:
            return
        for s, score in zip(picked, scores.double().cpu().tolist()):
            env_reward = float(s.reward)
            self._sums += torch.tensor([1.0, score, score * score, env_reward], dtype=torch.float64)
            s.reward = self.coef * score + (env_reward if self.mode == "add" else 0.0)

    def metrics(self) -> dict[str, float]:
        """The step's score statistics over every DP rank (a collective); resets the sums."""
        sums = all_reduce_sum(self._sums.to(self.device, copy=True), self.dp_group).cpu()
        self._sums.zero_()
        n, s1, s2, env = sums.tolist()
        if n == 0:
            return {}
        mean = s1 / n
        return {"reward_model/score_mean": mean, "reward_model/score_std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                "reward_model/env_reward_mean": env / n}


def build_learned_reward(cfg: Config, tokenizer, mesh, device) -> LearnedReward | None:
    return LearnedReward(cfg, tokenizer, mesh, device) if cfg.env.reward_model.path else None
