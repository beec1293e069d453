"""The seeded draw both engines sample with (pure tensor code)."""
import torch

from sparserl.model.sampling import processed_logprobs
from sparserl.engines.draw import RowSettings, inverse_cdf, row_keys, row_uniform, sample
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
    assert not (row_uniform(keys) == row_uniform(row_keys(torch.tensor(seeds), pos + 1))).any()


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


def test_inverse_cdf_takes_the_interval_u_falls_in():
    logp = torch.tensor([[0.1, 0.2, 0.0, 0.3, 0.4]]).log().expand(6, -1)  # token 2 has no mass
    u = torch.tensor([0.05, 0.1 - 1e-6, 0.1 + 1e-6, 0.35, 0.6 + 1e-6, 1 - 1e-12], dtype=torch.float64)
    assert inverse_cdf(logp, u).tolist() == [0, 0, 1, 3, 4, 4]
    # u x total rounding up to the total takes the last token with mass, never a masked one after it.
    masked = torch.tensor([[0.5, 0.5, 0.0]]).log()
    assert inverse_cdf(masked, torch.tensor([1.0], dtype=torch.float64)).item() == 1


def test_row_uniform_is_uniform_and_uncorrelated_across_positions():
    u = row_uniform(row_keys(torch.full((50_000,), 11), torch.arange(50_000)))  # one sequence, consecutive positions
    assert 0 < u.min() and u.max() < 1 and u.dtype == torch.float64
    counts = torch.histc(u.float(), bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum() < 50  # chi-square, 15 dof: p ~ 1e-5 at 50
    lag1 = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].abs()
    assert lag1 < 0.02  # 50,000 pairs: |r| of independent values ~ 0.0045
    other = row_uniform(row_keys(torch.full((50_000,), 12), torch.arange(50_000)))  # the next sample's stream
    assert torch.corrcoef(torch.stack([u, other]))[0, 1].abs() < 0.02


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


def test_inverse_cdf_on_reused_buffers_matches_fresh_float64_sums():
    # The CPU draw keeps its probabilities and cumulative sums in per-thread buffers between calls: batches of
    # other sizes, a larger vocabulary and masked entries must give the tokens of the plain float64 formula.
    torch.manual_seed(0)
    for b, v in [(64, 4096), (3, 4096), (17, 9000), (64, 4096), (1, 50)]:
        logp = torch.log_softmax(torch.randn(b, v) * 4, dim=-1)
        logp[:, ::7] = float("-inf")
        u = torch.rand(b, dtype=torch.float64)
        cdf = logp.exp().to(torch.float64).cumsum(dim=-1)
        total = cdf[:, -1:]
        target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        want = torch.searchsorted(cdf, target, right=True)[:, 0]
        assert torch.equal(inverse_cdf(logp, u), want), (b, v)


def test_a_thread_draws_under_inference_mode_then_under_no_grad():
    """The draw's reused scratch buffers serve callers in any grad mode: an engine draws under inference mode, a
    sampler plugin or an evaluation helper under no_grad, one after the other in the same thread."""
    import threading

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    settings = RowSettings.from_rows([(7 + i, 1.0, 1.0, 0) for i in range(4)], "cpu")
    positions = torch.arange(4)
    results = {}

    def draw_both_ways():
        try:
            draws()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            results["error"] = exc

    def draws():
        with torch.inference_mode():
            results["inference"] = sample(logits, settings, positions)[0].tolist()
        with torch.no_grad():
            results["no_grad"] = sample(logits, settings, positions)[0].tolist()
        results["grad"] = sample(logits, settings, positions)[0].tolist()
        with torch.inference_mode():
            results["again"] = sample(logits, settings, positions)[0].tolist()

    worker = threading.Thread(target=draw_both_ways)  # a thread of its own: no buffers made by earlier tests
    worker.start()
    worker.join()
    if "error" in results:
        raise results["error"]
    assert results["inference"] == results["no_grad"] == results["grad"] == results["again"]
