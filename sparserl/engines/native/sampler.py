"""Draw one token per sequence and report its log-prob under the processed distribution.

The draw is `sparserl/engines/draw.py`'s, as in the SGLang engine: one uniform per row, keyed by (the sequence's
seed `sample_seed(params.seed or the engine seed, the request's seed index or position, sample index)`, the
logical position of the token that produced the logits), and its inverse CDF. A sequence's draws do not depend
on which other sequences share its batch, and the whole batch is drawn in a few tensor operations.
Decode-only steps over static buffers (graph_step.py) draw with `sample` directly, from per-row device buffers,
and take only `seed_of` from here.
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

    def seed_of(self, seq: Sequence) -> int:
        """The sequence's draw seed (the static decode path writes it into its per-row buffer once)."""
        seed = self._seeds.get(seq.seq_id)
        if seed is None:
            base = self.seed if seq.params.seed is None else seq.params.seed
            index = seq.request_index if seq.seed_index is None else seq.seed_index
            seed = self._seeds[seq.seq_id] = sample_seed(base, index, seq.sample_index)
        return seed

    def forget(self, seq: Sequence) -> None:
        self._seeds.pop(seq.seq_id, None)

    def sample_batch(self, logits: torch.Tensor, batch) -> tuple[list[Sequence], list[int], list[float]]:
        """An eager step's draw: `logits` has one row per computed sequence of the `ScheduledBatch` (decode, then
        prefill); a fork draws from its leader's row. First counts what the forward computed in `num_cached` (a fork:
        its prompt). Returns the sequences that draw, in the order of the tokens and log-probs."""
        computed = batch.decode + batch.prefill
        for seq in computed:
            seq.num_cached += seq.num_pending
        for seq in batch.forks:
            seq.num_cached = len(seq.prompt)
        row_of = {id(s): i for i, s in enumerate(computed)}
        for seq in batch.forks:
            row_of[id(seq)] = row_of[id(seq.fork_of)]
        # A resumed sequence whose re-prefill stopped short of its last token (to compact) draws nothing yet.
        sampled = [s for s in computed + batch.forks if s.num_cached == s.num_tokens]
        if not sampled:
            return [], [], []
        order = [row_of[id(s)] for s in sampled]
        rows = logits if order == list(range(len(logits))) else logits[torch.tensor(order, device=logits.device)]
        return (sampled, *self.sample(rows, sampled))

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """logits: (B, V), one row per sequence in `seqs`, each computed from the token at logical position
        `seq.num_cached - 1`. Returns token ids and their log-probs."""
        settings = RowSettings.from_rows(
            [(self.seed_of(s), s.params.temperature, s.params.top_p, s.params.top_k) for s in seqs], logits.device)
        positions = torch.tensor([s.num_cached - 1 for s in seqs], dtype=torch.int64, device=logits.device)
        tokens, logp = sample(logits, settings, positions)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens.tolist(), chosen.tolist()
