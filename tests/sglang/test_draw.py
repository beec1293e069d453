"""The seeded draw of the SGLang sampler (pure tensor code; runs without sglang)."""
import torch

from sparserl.model.sampling import processed_logprobs
from sparserl.engines.sglang.draw import RowSettings, _fmix32, _mul32, row_keys, sample, uniform
from sparserl.utils.host_syncs import HostSyncs

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])


def settings(n, temperature=1.0, top_p=1.0, top_k=0, seeds=None):
    seeds = list(range(n)) if seeds is None else seeds
    temperature = temperature if isinstance(temperature, list) else [temperature] * n
    return RowSettings.from_rows([(s, t, top_p, top_k) for s, t in zip(seeds, temperature)], "cpu")


def draw_many(n, temperature=1.0, top_p=1.0, top_k=0, position=7):
    return sample(LOGITS.expand(n, -1), settings(n, temperature, top_p, top_k), torch.full((n,), position))


def test_draws_follow_the_processed_distribution():
    n = 60_000
    for temperature, top_p, top_k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 3)]:
        tokens, logp = draw_many(n, temperature, top_p, top_k)
        expected = processed_logprobs(LOGITS, temperature, top_p, top_k)[0].exp()
        freq = torch.bincount(tokens, minlength=LOGITS.shape[1]).double() / n
        assert torch.allclose(logp[0], processed_logprobs(LOGITS, temperature, top_p, top_k)[0])
        assert (freq[expected == 0] == 0).all()  # nothing outside the kept set
        assert (freq - expected).abs().max() < 4 * (0.25 / n) ** 0.5 + 1e-3


def test_a_rows_draw_depends_only_on_its_seed_and_position():
    logits = torch.randn(5, 1000)
    seeds, pos = [3, 4, 5, 6, 7], torch.tensor([10, 10, 11, 12, 13])
    tokens, _ = sample(logits, settings(5, seeds=seeds), pos)
    alone, _ = sample(logits[2:3], settings(1, seeds=seeds[2:3]), pos[2:3])
    assert alone.item() == tokens[2].item()
    again, _ = sample(logits.flip(0), settings(5, seeds=seeds[::-1]), pos.flip(0))
    assert again.flip(0).tolist() == tokens.tolist()
    keys = row_keys(torch.tensor(seeds), pos)
    assert not torch.equal(uniform(keys, 64), uniform(row_keys(torch.tensor(seeds), pos + 1), 64))


def test_greedy_rows_take_the_argmax_and_report_temperature_one():
    logits = torch.randn(4, 50)
    tokens, logp = sample(logits, settings(4, [0.0, 1.0, 0.0, 0.5]), torch.zeros(4, dtype=torch.long))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logp[0], torch.log_softmax(logits[0], -1))


def test_row_keys_are_distinct_and_non_negative():
    seeds = torch.arange(-500, 500).repeat_interleave(20)
    pos = torch.arange(20).repeat(1000)
    keys = row_keys(seeds, pos)
    assert keys.unique().numel() == keys.numel() and (keys >= 0).all()


def test_noise_block_is_the_32_bit_hash_it_claims():
    """The (B, V) block runs in int32 with wrapping products; it must equal the same hash in exact int64 math."""
    keys = row_keys(torch.tensor([1, -7, 2**40 + 3]), torch.tensor([0, 5, 123456]))
    vocab = 1000
    m = 0xFFFFFFFF
    got = uniform(keys, vocab)
    for r, key in enumerate(keys.tolist()):
        k = torch.tensor([key])
        offset = int(_fmix32((k & m) ^ _fmix32(((k >> 32) & m) ^ 0x5BD1E995)))
        for v in (0, 1, 17, 511, 999):
            h = (int(_mul32(torch.tensor([v]), 0x9E3779B1)) + offset) & m
            h ^= h >> 16
            h = (h * 0x7FEB352D) & m
            h ^= h >> 15
            h = (h * 0x1B873593) & m
            h ^= h >> 16
            assert got[r, v].item() == ((h >> 9) + 0.5) / 2**23


def test_noise_is_uniform_and_uncorrelated_across_rows_and_positions():
    keys = row_keys(torch.full((64,), 11), torch.arange(64))  # one sequence, 64 consecutive positions
    u = uniform(keys, 4096)
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum() < 50  # chi-square, 15 dof: p ~ 1e-5 at 50
    corr = torch.corrcoef(u).fill_diagonal_(0).abs().max()
    assert corr < 0.08  # 4096 samples per row: |r| of independent rows ~ 0.016


def test_draw_and_transform_make_no_host_syncs():
    logits = torch.randn(8, 300)
    rows = [(i, 1.0 if i % 3 else 0.0, 0.9 if i % 2 else 1.0, 5 if i == 4 else 0) for i in range(8)]
    s = RowSettings.from_rows(rows, "cpu")  # built from the host's numbers, before the counted block
    positions = torch.arange(8) + 40
    with HostSyncs() as syncs:
        sample(logits, s, positions)
        processed_logprobs(logits, 0.7, 0.95, 20)  # the actor's call: scalar settings
        processed_logprobs(logits, 1.0)
        processed_logprobs(logits, s.temperature, s.top_p, s.top_k)  # tensors without a hint: filters every row
    assert syncs.events == []
    with HostSyncs() as syncs:  # the counter itself sees a sync
        bool((s.top_k > 0).any())
    assert syncs.events == ["item"]
