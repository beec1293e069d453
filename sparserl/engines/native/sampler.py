"""Draw one token per sequence and report its log-prob under the processed distribution.

The draw is `sparserl/engines/draw.py`'s, as in the SGLang engine: one uniform per row, keyed by (the sequence's
seed `sample_seed(params.seed or the engine seed, the request's seed index or position, sample index)`, the
logical position of the token that produced the logits), and its inverse CDF. A sequence's draws do not depend
on which other sequences share its batch, and the whole batch is drawn in a few tensor operations.
Left out on purpose: speculative decoding, logit bias.
"""
from __future__ import annotations

import torch

from sparserl.engines.draw import RowSettings, sample
from sparserl.engines.native.sequence import Sequence
from sparserl.utils.seed import sample_seed


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._seeds: dict[int, int] = {}

    def _seed(self, seq: Sequence) -> int:
        seed = self._seeds.get(seq.seq_id)
        if seed is None:
            base = self.seed if seq.params.seed is None else seq.params.seed
            index = seq.request_index if seq.seed_index is None else seq.seed_index
            seed = self._seeds[seq.seq_id] = sample_seed(base, index, seq.sample_index)
        return seed

    def forget(self, seq: Sequence) -> None:
        self._seeds.pop(seq.seq_id, None)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """logits: (B, V), one row per sequence in `seqs`, each computed from the token at logical position
        `seq.num_cached - 1`. Returns token ids and their log-probs."""
        settings = RowSettings.from_rows(
            [(self._seed(s), s.params.temperature, s.params.top_p, s.params.top_k) for s in seqs], logits.device)
        positions = torch.tensor([s.num_cached - 1 for s in seqs], dtype=torch.int64, device=logits.device)
        tokens, logp = sample(logits, settings, positions)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens.tolist(), chosen.tolist()
