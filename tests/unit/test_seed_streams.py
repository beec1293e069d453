"""Every derived seed comes from `utils.seed.derive`, and the engines draw with the one sample key it defines."""
import torch

from sparserl.engines.draw import RowSettings, sample
from sparserl.engines.native.sampler import Sampler
from sparserl.engines.native.sequence import Sequence
from sparserl.engines.types import SamplingParams
from sparserl.utils.seed import MIX, SAMPLE_MOD, derive, sample_seed, step_seed, trajectory_index


def test_derivations_by_hand():
    assert derive(3) == 3 * MIX
    assert derive(3, (5, 7), (2, 1)) == 3 * MIX + 35 + 2
    assert derive(-4, (1, 1), modulus=97) == (-4 * MIX + 1) % 97
    assert step_seed(2, 9) == 2 * 1_000_003 + 9 * 7_919
    assert sample_seed(11, 4, 3) == (11 * 1_000_003 + 4 * 10_007 + 3) % (2**63 - 1)
    assert trajectory_index(4, 3) * 10_007 % SAMPLE_MOD == 4 * 10_007 + 3 and trajectory_index(4, 0) == 4
    # Large bases stay in the range torch.Generator.manual_seed accepts.
    assert 0 <= sample_seed(2**62, 2**40, 7) < SAMPLE_MOD


def test_streams_of_neighbouring_keys_differ():
    keys = {sample_seed(base, index, sample) for base in range(3) for index in range(50) for sample in range(8)}
    assert len(keys) == 3 * 50 * 8


def _seq(seq_id, request_index, sample_index, seed=None, seed_index=None):
    return Sequence(seq_id, request_index, sample_index, [1, 2], SamplingParams(seed=seed), reserve=8,
                    seed_index=seed_index)


def test_the_native_sampler_draws_with_sample_seed():
    """The native sampler keys each row by sample_seed(base, index, sample) and the logical position, through the
    draw both engines share: its tokens are those of `engines.draw.sample` with those seeds."""
    sampler = Sampler(seed=123)
    seqs = [_seq(0, 4, 1), _seq(1, 4, 1, seed=9), _seq(2, 4, 1, seed_index=30)]
    for i, seq in enumerate(seqs):
        seq.num_cached = 5 + i  # the token at position 4 + i produced the logits
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    tokens, _ = sampler.sample(logits, seqs)
    settings = RowSettings.from_rows([(sample_seed(b, idx, 1), 1.0, 1.0, 0) for b, idx in ((123, 4), (9, 4), (123, 30))],
                                     "cpu")
    want, _ = sample(logits, settings, torch.tensor([4, 5, 6]))
    assert tokens == want.tolist()
    shifted, _ = sample(logits, settings, torch.tensor([5, 6, 7]))
    assert tokens != shifted.tolist()  # the position is part of the key
