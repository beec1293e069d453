"""Draw one token per sequence and report its log-prob under the processed distribution.

Each sequence owns a `torch.Generator` seeded from (params.seed or the engine seed, the request's seed index
or position, sample index), so a sequence's draws do not depend on which other sequences share its batch.
Sampling is the exponential race (argmax of logp - log(E), E ~ Exp(1)), which draws exactly from softmax(logp).
Left out on purpose: speculative decoding, logit bias.
"""
from __future__ import annotations

import torch

from sparserl.engines.native.sequence import Sequence
from sparserl.model.sampling import processed_logprobs
from sparserl.utils.seed import sample_seed


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}

    def _generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            base = self.seed if seq.params.seed is None else seq.params.seed
            gen = torch.Generator(device=device)
            # Distinct, reproducible streams per (seed, request, sample).
            index = seq.request_index if seq.seed_index is None else seq.seed_index
            gen.manual_seed(sample_seed(base, index, seq.sample_index))
            self._generators[seq.seq_id] = gen
        return gen

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """logits: (B, V), one row per sequence in `seqs`. Returns token ids and their log-probs."""
        device = logits.device
        temp = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=device)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device)
        truncate = any(s.params.top_p < 1.0 or s.params.top_k > 0 for s in seqs)  # known here: no device sync
        logp = processed_logprobs(logits, temp, top_p, top_k, truncate=truncate)  # (B, V)
        greedy = temp == 0
        if all(s.params.temperature == 0 for s in seqs):
            tokens = logp.argmax(dim=-1)
        else:
            noise = torch.stack([torch.rand(logp.shape[-1], generator=self._generator(s, device), device=device) for s in seqs])
            exp_noise = (-torch.log1p(-noise)).clamp_min(1e-20)  # E = -log(1 - u) ~ Exp(1)
            race = logp - torch.log(exp_noise)  # argmax of p / E
            tokens = torch.where(greedy, logp.argmax(dim=-1), race.argmax(dim=-1))
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens.tolist(), chosen.tolist()
