"""Shared prompts through the actor (micro-batching, `balance_ranks`, the fused loss with the sparsity
correction): the same loss, gradients and correction metrics as without sharing, in 1 and 2 processes."""
from pathlib import Path

import pytest

from tests.distributed.test_fused_old_logprobs import rel, run, whole

WORKER = Path(__file__).with_name("shared_worker.py")


@pytest.mark.parametrize("nproc,layout", [(1, "even"), (2, "even"), (2, "skewed")])
def test_shared_prompts_match_unshared(tiny_checkpoint, tmp_path, nproc, layout):
    got = run(tiny_checkpoint, tmp_path / "out.pt", nproc, layout, worker=WORKER)
    off, on = got[False], got[True]
    for a, b in zip(on["loss"], off["loss"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert rel(whole(on["grads"]), whole(off["grads"])) < 1e-6
    for n, g in off["grads"].items():
        assert rel(on["grads"][n], g) < 3e-6, n
    for key in ("correction/kept_token_frac", "correction/norm_factor", "correction/masked_low_frac"):
        assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=1e-5, abs=1e-7), key
    assert off["metrics"]["correction/masked_low_frac"] > 0  # the correction does something here
    if nproc == 2:
        # with sharing a prompt's samples move together (a group larger than half a rank's share may be cut in
        # two), so fewer prompts are computed on both ranks than when sequences move one by one
        assert 4 <= sum(on["prompts_per_rank"]) < sum(off["prompts_per_rank"]), (on["prompts_per_rank"], off["prompts_per_rank"])
        before, after = on["metrics"]["perf/dp_load_imbalance_before"], on["metrics"]["perf/dp_load_imbalance"]
        assert after <= before and after < 1.3, on["metrics"]
        if layout == "skewed":
            assert after < before, (before, after)  # 3 prompts against 1: groups were moved
