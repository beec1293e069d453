"""Every @triton.jit kernel of the package compiles for sm_90 and sm_80 through to a cubin, here, without a GPU
(`sparserl/kernels/compile_check.py`: triton's binder over CPU tensors laid out as the engine's call, the ptxas
bundled in the triton wheel), at the shapes the engine launches and without a spill; the static step's batch
buckets and table widths share one compiled kernel per shape (one split or several). The compile runs in a
subprocess: this process runs triton's interpreter, under which nothing compiles. A second test checks that the
compile check lays its CPU tensors out as the static step's attention receives them."""
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.native.static_attention import StaticDecodeAttention
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import ROOT, tiny_model

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def jit_kernels() -> set[str]:
    """The names of every @triton.jit function in the package, found in the source."""
    names = set()
    for path in (ROOT / "sparserl").rglob("*.py"):
        names |= set(re.findall(r"@triton\.jit\b[^\n]*\n\s*def (\w+)", path.read_text()))
    return names


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton wheel bundles no ptxas")
def test_every_kernel_compiles_for_sm90_and_sm80_without_spills(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, "-m", "sparserl.kernels.compile_check", "--matrix", "engine", "--json",
                          str(out)], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = json.loads(out.read_text())
    kernels = jit_kernels()
    assert {"_split_kernel", "_merge_kernel"} <= kernels
    for target in ("sm_90", "sm_80"):
        assert kernels <= {r["kernel"].split(" ")[0] for r in rows if r["target"] == target}, target
    for r in rows:
        assert r["stack_bytes"] == 0 and r["spill_stores"] == 0, r
        assert 0 < r["registers"] <= 255, r
    # Batch sizes 1-256 and widths 512-32768 move split_len and the split count (1 to 256), runtime arguments:
    # each shape compiles the split kernel with one split and with several, and one merge.
    per_shape = defaultdict(list)
    for r in rows:
        per_shape[r["target"], r["dtype"], r["shape"]].append(r["kernel"])
    for key, names in per_shape.items():
        assert sorted(names) == ["_merge_kernel", "_split_kernel (1 split)", "_split_kernel (splits)"], key


def test_the_check_lays_its_tensors_out_as_the_static_step_does(monkeypatch):
    """The arguments the static step's attention receives (q, the pools, the gathered table, the lengths) have the
    dtypes, ranks and contiguity of the compile check's CPU tensors."""
    from sparserl.kernels import compile_check

    seen = []
    attend = StaticDecodeAttention.attend

    def spy(self, layer, q, k_cache, v_cache, scaling):
        seen.append((q, k_cache, self.table, self.lengths))
        return attend(self, layer, q, k_cache, v_cache, scaling)

    monkeypatch.setattr(StaticDecodeAttention, "attend", spy)
    engine = NativeEngine(tiny_model(dtype=torch.bfloat16), num_slots=256, eos_token_ids=[], cuda_graphs="on",
                          max_num_seqs=4)
    engine.generate([GenerationRequest([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=4, n=3, seed=1), 0)])
    assert seen
    H, hkv, D = 4, 2, 16
    plan = compile_check.launches_of(compile_check.Shape(H, hkv, D, torch.bfloat16), [4], [512])
    args = plan[0].args  # q, k_pool, v_pool, table, lengths, ...
    layout = lambda t: (t.dtype, t.dim(), t.stride(-1))  # noqa: E731
    for q, pool, table, lengths in seen:
        assert layout(q.contiguous()) == layout(args[0]) and q.shape[1:] == (H, D)
        assert layout(pool) == layout(args[1]) and pool.is_contiguous() and pool.shape[1:] == (hkv, D)
        assert layout(table) == layout(args[3]) and table.is_contiguous()
        assert layout(lengths) == layout(args[4]) and lengths.dim() == 1
