"""Evaluation metrics: pass@k against hand-computed values, the maj@n vote and its tie rule, avg@n, the table."""
import pytest

from sparserl.eval.metrics import SampleRecord, dataset_metrics, majority_vote, pass_at_k


def test_pass_at_k_hand_computed():
    # n=4, c=1: 1 - C(3,k)/C(4,k)
    assert pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(4, 1, 4) == 1.0
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # n=10, c=3, k=2: 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert pass_at_k(10, 3, 2) == pytest.approx(24 / 45)


def test_pass_at_k_edges():
    for n in (1, 3, 8):
        for k in range(1, n + 1):
            assert pass_at_k(n, 0, k) == 0.0  # nothing correct
            assert pass_at_k(n, n, k) == 1.0  # everything correct
        for c in range(1, n + 1):
            assert pass_at_k(n, c, n) == 1.0  # k = n: some correct sample is always among the n drawn
    assert pass_at_k(6, 2, 1) == pytest.approx(2 / 6)  # pass@1 = c / n
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_vote_and_its_tie_rule():
    assert majority_vote(["3", "5", "5", "3", "5"]) == 1  # 5 wins 3:2; its first sample is index 1
    # 2:2 tie between "7" and "9": the answer sampled first wins, whatever order the dict would give.
    assert majority_vote(["9", "7", "7", "9"]) == 0
    assert majority_vote(["7", "9", "9", "7"]) == 0
    assert majority_vote([None, "9", "7", None, "7", "9"]) == 1
    # Samples without an answer do not vote; whitespace and $ do not split votes.
    assert majority_vote([None, "x", None, None]) == 1
    assert majority_vote(["1/2", " 1 / 2", "$1/2$", "3", "3"]) == 0
    assert majority_vote([None, None, "  "]) is None
    assert majority_vote([]) is None


def rec(index, sample, correct, extracted=None, tokens=10, finish="stop", peak=100, retained=50, total=100):
    return SampleRecord(dataset="d", index=index, sample=sample, prompt="p", response="r", answer="a", extracted=extracted,
                        correct=correct, score=float(correct), tokens=tokens, finish_reason=finish, status="ok",
                        kv_peak=peak, kv_retained=retained, kv_total=total)


def test_dataset_metrics_avg_pass_maj_and_lengths():
    records = [
        # prompt 0: 1 of 4 correct; the vote picks "5" (2 votes, wrong)
        rec(0, 0, False, "5"), rec(0, 1, True, "4"), rec(0, 2, False, "5"), rec(0, 3, False, None),
        # prompt 7: 2 of 4; a 2:2 tie between "8" (first at sample 0, correct) and "6"
        rec(7, 0, True, "8", tokens=20, finish="length"), rec(7, 1, False, "6"), rec(7, 2, False, "6"), rec(7, 3, True, "8"),
        # prompt 3: 4 of 4 correct
        *[rec(3, j, True, "2", retained=100) for j in range(4)],
    ]
    m = dataset_metrics(list(reversed(records)), n=4, ks=[1, 2, 4], vote=True, kv_bytes_per_slot=2**20)
    assert m["prompts"] == 3
    assert m["avg@4"] == pytest.approx((1 / 4 + 2 / 4 + 1) / 3)
    assert m["pass@1"] == pytest.approx(m["avg@4"])
    assert m["pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6) + 1) / 3)
    assert m["pass@4"] == 1.0
    assert m["maj@4"] == pytest.approx(2 / 3)  # prompt 0 wrong, 7 right (tie -> first sampled "8"), 3 right
    assert m["response_len"] == pytest.approx((11 * 10 + 20) / 12)
    assert m["truncated_frac"] == pytest.approx(1 / 12)
    assert m["kv_retained_frac"] == pytest.approx((8 * 50 + 4 * 100) / 1200)
    assert m["kv_peak_tokens"] == 100 and m["kv_peak_tokens_max"] == 100 and m["kv_peak_mib"] == 100
    no_vote = dataset_metrics(records, n=4, ks=[1], vote=False)
    assert "maj@4" not in no_vote and "kv_peak_mib" not in no_vote


def test_avg_at_n_is_the_mean_over_prompts():
    records = [rec(0, 0, True), rec(0, 1, True), rec(1, 0, False), rec(1, 1, True), rec(2, 0, False), rec(2, 1, False)]
    assert dataset_metrics(records, n=2, ks=[1], vote=False)["avg@2"] == pytest.approx(0.5)
    with pytest.raises(AssertionError):  # a prompt missing a sample is a bug, never averaged over
        dataset_metrics(records[:-1], n=2, ks=[1], vote=False)
