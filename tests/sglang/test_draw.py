"""The seeded draw of the SGLang sampler (pure tensor code; runs without sglang)."""
import torch

from sparserl.rollout.sampling import processed_logprobs
from sparserl.rollout.sglang.draw import row_keys, sample, uniform

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])


def draw_many(n, temperature=1.0, top_p=1.0, top_k=0, position=7):
    return sample(LOGITS.expand(n, -1), torch.full((n,), temperature), torch.full((n,), top_p),
                  torch.full((n,), top_k, dtype=torch.long), torch.arange(n), torch.full((n,), position))


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
    args = (torch.ones(5), torch.ones(5), torch.zeros(5, dtype=torch.long))
    seeds, pos = torch.tensor([3, 4, 5, 6, 7]), torch.tensor([10, 10, 11, 12, 13])
    tokens, _ = sample(logits, *args, seeds, pos)
    alone, _ = sample(logits[2:3], *(a[2:3] for a in args), seeds[2:3], pos[2:3])
    assert alone.item() == tokens[2].item()
    again, _ = sample(logits.flip(0), *args, seeds.flip(0), pos.flip(0))
    assert again.flip(0).tolist() == tokens.tolist()
    assert not torch.equal(uniform(row_keys(seeds, pos), 64), uniform(row_keys(seeds, pos + 1), 64))


def test_greedy_rows_take_the_argmax_and_report_temperature_one():
    logits = torch.randn(4, 50)
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.5])
    tokens, logp = sample(logits, temperature, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.arange(4), torch.zeros(4))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(logp[0], torch.log_softmax(logits[0], -1))


def test_row_keys_are_distinct_and_non_negative():
    seeds = torch.arange(-500, 500).repeat_interleave(20)
    pos = torch.arange(20).repeat(1000)
    keys = row_keys(seeds, pos)
    assert keys.unique().numel() == keys.numel() and (keys >= 0).all()
