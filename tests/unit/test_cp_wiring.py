"""Context parallelism's wiring, single process: the (dp, cp, tp) layout checks, the models cp refuses, where the
kept rows of a packed row live under the zigzag plan, and the world-size preflight. The multi-process equality with
cp = 1 is tests/distributed/test_cp_actor.py."""
import pytest
import torch

from sparserl.actor.context_parallel import check_model, kept_rows, zigzag_plan
from sparserl.actor.logprobs import PackedSeqs, _layout
from sparserl.config import Config
from sparserl.parallel import ParallelDims
from sparserl.trainer.preflight import check_world
from sparserl.utils.errors import UserError


def test_from_world_lays_out_dp_cp_tp():
    assert ParallelDims.from_world(8, 2, 2) == ParallelDims(dp=2, tp=2, cp=2)
    assert ParallelDims.from_world(6, 1, 3) == ParallelDims(dp=2, tp=1, cp=3)
    assert ParallelDims.from_world(4, 2) == ParallelDims(dp=2, tp=2, cp=1)
    with pytest.raises(UserError, match=r"parallel.cp=3 x parallel.tp=2 must divide the world size 8"):
        ParallelDims.from_world(8, 2, 3)
    with pytest.raises(UserError, match=r"parallel.cp=0"):
        ParallelDims.from_world(4, 1, 0)


def test_world_preflight():
    cfg = Config()
    cfg.parallel.cp = 2
    check_world(cfg, 4)
    with pytest.raises(UserError, match=r"parallel.cp=2 x parallel.tp=1 must divide the world size 3"):
        check_world(cfg, 3)
    cfg.parallel.tp = 2
    with pytest.raises(UserError, match=r"parallel.cp=2 x parallel.tp=2 must divide the world size 6"):
        check_world(cfg, 6)


def test_refused_models():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    check_model(LlamaConfig(**common), 2)
    check_model(Qwen2Config(**common, use_sliding_window=False), 2)  # a window declared but off
    with pytest.raises(UserError, match=r"parallel.cp=2: the model \(qwen2\) uses sliding-window attention"):
        check_model(Qwen2Config(**common, use_sliding_window=True, sliding_window=16, max_window_layers=0), 2)
    with pytest.raises(UserError, match=r"sliding-window"):
        check_model(MistralConfig(**common, sliding_window=16), 2)
    odd = LlamaConfig(**common)
    odd.v_head_dim = 8
    with pytest.raises(UserError, match=r"value head size \(8\) differs from its key head size \(16\)"):
        check_model(odd, 2)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_kept_rows_cover_keep_once_in_order(cp):
    # two samples sharing a prompt (its last row is kept twice), a one-token response, uneven lengths
    seqs = PackedSeqs([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [9, 8], [5, 6, 7, 8, 9, 10, 11]], [3, 3, 1, 2])
    flat, pos, keep, targets, spans = _layout(seqs, share_prompts=True)
    assert len(keep) == len(set(keep)) + 1  # the shared prompt's last row predicts both first tokens
    plan = zigzag_plan(spans, cp)
    parts = [kept_rows(plan, keep, r) for r in range(cp)]
    assert [len(p.mine) for p in parts] == parts[0].counts
    width = max(parts[0].counts)
    gathered = torch.full((cp * width,), -1, dtype=torch.long)
    for r, p in enumerate(parts):
        rows = plan.rows[r].index[p.local]  # the packed rows this rank's entries sit on
        assert torch.equal(rows, torch.tensor(keep)[p.mine])
        gathered[r * width: r * width + len(p.mine)] = p.mine
        assert torch.equal(p.source, parts[0].source)
    assert torch.equal(gathered[parts[0].source], torch.arange(len(keep)))  # every entry once, in keep order
