"""`actor.skip_zero_advantage`: sequences whose advantage is 0 run their forward without autograd and skip
backward. The update is the one that trains them: the same loss, gradients, logp_old and correction metrics, in 1
and 2 processes (one of which may have no backward of its own), and the same weights after an optimizer step whose
advantages are all 0 (AdamW still moves the weights there)."""
from pathlib import Path

import pytest
import torch

from tests.distributed.test_fused_old_logprobs import rel, run, whole

WORKER = Path(__file__).with_name("zero_adv_worker.py")


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_adv")
    return {n: run(tiny_checkpoint, tmp / f"{n}.pt", n, worker=WORKER) for n in (1, 2)}


@pytest.mark.parametrize("nproc", [1, 2])
def test_skipping_zero_advantage_sequences_gives_the_same_update(runs, nproc):
    res = runs[nproc]
    # sequences 0 and 1 share a prompt and 1 carries a signal, so only 3 and 5 run without autograd
    expected_frac = {"mixed": 2 / 8, "rank0_zero": 4 / 8, "all_zero": 1.0}
    for case, frac in expected_frac.items():
        for path in ("separate", "fused"):
            off, on = res[(case, path, False)], res[(case, path, True)]
            assert on["sums"][3] == pytest.approx(frac), (case, path)
            for a, b in zip(on["sums"][:3], off["sums"][:3]):
                assert a == pytest.approx(b, rel=1e-6, abs=1e-9), (case, path, on["sums"], off["sums"])
            assert torch.allclose(on["logp_old"], off["logp_old"], rtol=0, atol=1e-6), (case, path)
            for key, v in off["metrics"].items():
                assert on["metrics"][key] == pytest.approx(v, rel=1e-5, abs=1e-7), (case, path, key)
            assert all(g is not None for g in on["grads"].values()), (case, path)
            if case == "all_zero":  # nothing to train: zero gradients on both sides
                assert all(torch.count_nonzero(g) == 0 for g in on["grads"].values())
                assert all(torch.count_nonzero(g) == 0 for g in off["grads"].values())
                continue
            assert whole(off["grads"]).abs().sum() > 0
            assert rel(whole(on["grads"]), whole(off["grads"])) < 1e-6, (case, path)
    # a policy term with and without a signal
    assert res[("mixed", "fused", True)]["sums"][1] != 0 and res[("all_zero", "fused", True)]["sums"][1] == 0


@pytest.mark.parametrize("nproc", [1, 2])
def test_an_all_zero_step_moves_the_weights_as_without_the_skip(runs, nproc):
    off, on = runs[nproc][("steps", False)], runs[nproc][("steps", True)]
    assert [m["actor/no_grad_seq_frac"] for m in on["metrics"]] == pytest.approx([2 / 8, 1.0])
    assert all("actor/no_grad_seq_frac" not in m for m in off["metrics"])
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm"):
        for a, b in zip(on["metrics"], off["metrics"]):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), key
    assert on["metrics"][1]["actor/grad_norm"] == 0.0
    # Each step moves weights by up to lr = 1e-2 (AdamW); the two sides agree to 1e-5 (Adam's g / sqrt(v) turns
    # the gradients' last-bit differences into ~1e-6 where a gradient is near 0).
    for step in (0, 1):
        for n, p in off["params"][step].items():
            assert torch.allclose(on["params"][step][n], p, rtol=0, atol=1e-5), (step, n)
    # the all-zero step moved the weights (AdamW's first moment) on both sides
    for side in (off, on):
        assert max(float((side["params"][1][n] - p).abs().max()) for n, p in side["params"][0].items()) > 1e-3


def test_ranks_are_balanced_by_update_work(runs):
    """balance_ranks with token_weights=(4, 1): a trained token costs four zero-advantage ones (activation
    checkpointing), so the ranks' update work comes out near equal, not their token counts; same gradients."""
    res = runs[2]
    ref = whole(res[("rank0_zero", "fused", False)]["grads"])
    for weights in ((1, 1), (4, 1)):
        assert rel(whole(res[("balanced", weights)]["grads"]), ref) < 1e-6, weights
    by_tokens, by_work = res[("balanced", (1, 1))]["balance"], res[("balanced", (4, 1))]["balance"]
    # rank 0 holds all the no-grad work, rank 1 all the trained work: far apart by work, closer by tokens
    assert by_work["perf/dp_load_imbalance_before"] > 1.4 > by_tokens["perf/dp_load_imbalance_before"]
    assert by_work["perf/dp_load_imbalance"] < 1.2 < by_work["perf/dp_load_imbalance_before"]
