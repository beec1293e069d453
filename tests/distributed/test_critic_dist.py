"""The critic sharded as the actor is: its values before an update, the update's loss and gradient norm, and every weight after
two optimizer steps (two epochs: the second one clips values) match the single-process critic for (dp, tp, cp) = (2, 1, 1), (1, 2, 1) (the value head replicated
over tp, the LM head split by vocabulary) and (1, 1, 2) (ring attention, values gathered over cp); fp32, a tiny
random Llama with a separate LM head (frozen in the critic)."""
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.launch import command

WORKER = Path(__file__).with_name("critic_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, ckpt: Path, dp: int, tp: int, cp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(command(dp * tp * cp, WORKER, str(out), str(ckpt), str(dp), str(tp), str(cp)), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("critic")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "ckpt")
    return root / "ckpt", run(root / "single.pt", root / "ckpt", 1, 1, 1)


# dp = 2 is also what the 2-process ppo run of tests/e2e/test_objectives.py trains with: `slow` here.
@pytest.mark.parametrize("dp, tp, cp", [pytest.param(2, 1, 1, marks=pytest.mark.slow), (1, 2, 1), (1, 1, 2)])
def test_sharded_critic_matches_one_process(single, tmp_path, dp, tp, cp):
    ckpt, ref = single
    got = run(tmp_path / "out.pt", ckpt, dp, tp, cp)
    want = ref["values"][0][1]  # (8, T): the single process holds every sequence
    for share, values in got["values"]:
        rows = slice(share * 8 // dp, (share + 1) * 8 // dp)
        assert torch.allclose(values, want[rows, : values.shape[1]], rtol=1e-5, atol=1e-6)
    for key in ("critic/value_loss", "critic/grad_norm"):  # clip_frac is a mean of micro-batch rates, as actor/'s
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4), key  # the 2nd step: after Adam
    assert ref["metrics"]["critic/grad_norm"] > 0
    assert got["state"].keys() == ref["state"].keys()
    # AdamW's first steps move a weight by about lr whatever the size of its gradient, so a gradient near rounding level
    # may move differently: the weights agree to a tenth of lr (1e-2); the gradient's norm above is the tight check.
    diff = {name: float((got["state"][name] - t).abs().max()) for name, t in ref["state"].items()}
    assert max(diff.values()) < 1e-3, diff
    assert not torch.equal(ref["state"]["value_head.weight"], got["state"]["lm_head.weight"][:1])
