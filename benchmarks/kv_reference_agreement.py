"""Which tokens sparserl's SnapKV and R-KV keep, next to what the public reference code keeps on the same cache.

    python benchmarks/kv_reference_agreement.py --reference-dir /path/to/references

`--reference-dir` holds checkouts (or extracted copies) of the reference repositories, outside this project:

    R-KV/       github.com/Zefan-Cai/R-KV        rkv/utils.py, rkv/compression/{r1_kv,snapkv}.py
    SnapKV/     github.com/FasterDecoding/SnapKV  snapkv/monkeypatch/snapkv_utils.py
    Sparse-RL/  github.com/lsjia/Sparse-RL       sglang-kvc/python/sglang/compress/r1kv_utils.py

Each reference module is loaded from its own file and its own selection code runs on the caches below (CPU,
float32): `SnapKVCluster.update_kv` (the SnapKV paper's code, max-pooling as in its LongBench configs), R-KV's
`SnapKV.update_kv` and `R1KV.update_kv` (one set per KV head), and sglang-kvc's `KVCluster.get_compress_indices`
with the settings Sparse-RL's `tp_worker.py` hard-codes (one set per request: scores summed over the heads).
The `update_kv` functions return compressed keys and values, not indices; the values handed to them carry each
entry's slot index in channel 0, so the kept slots are read back from the values they return. One import is
stubbed: R-KV's `rkv/compression/__init__.py` imports modules its repository does not contain (`rkv.py`,
`simkv.py`), and `rkv/__init__.py` pulls in its transformers monkeypatch; the script instead makes a bare
package whose `cal_similarity` / `compute_attention_scores` are the ones from `rkv/utils.py`, which is what that
`__init__`'s first line imports, and loads `r1_kv.py` / `snapkv.py` into it.

sparserl's side is `score_tokens` + `select_keep` (what both engines call) with window 8, kernel 7, lambda 0.1,
threshold 0.5: per head against the per-head references, and share=layer (one set per layer; raw score sums under
variant=reference, `KVPolicyConfig.normalize_sums`) against sglang-kvc. Caches: seeded random keys with a shared
offset direction (real keys have one, which pushes many cosines over the threshold), clusters of near-duplicate
keys, and window queries aimed at a few keys; every entry is in logical order in its slots, as both engines and
sglang-kvc hold them (some cases have per-head gaps in the positions, as after an earlier per-head compression).
R-KV's HF code itself holds its kept entries in top-k order after a compression, a layout neither engine has.

Columns: agreement = |kept_ours & kept_ref| / budget (the window is in both sets, so it is at least
window / budget), mean and min over every (case, head) set; exact = the fraction of sets that are identical.
The SnapKV paper's code repeats the KV heads for GQA and picks one set per query head, so it is compared on the
MHA cases only.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402
from sparserl.kv import KVPolicyConfig, score_tokens, select_keep  # noqa: E402

WINDOW, KERNEL, LAMBDA = 8, 7, 0.1
SHAPES = [  # (query heads, KV heads, head dim)
    (4, 4, 64),  # MHA
    (8, 2, 64),  # GQA 4
    (12, 2, 128),  # GQA 6 (Qwen2.5-1.5B's attention)
]
SIZES = [  # (cached entries, budget)
    (96, 32), (160, 64), (256, 128), (200, 128),
]


def load(name: str, path: Path) -> types.ModuleType:
    if not path.is_file():
        raise SystemExit(f"--reference-dir: {path} not found (see the layout in this script's docstring)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class References:
    snapkv_paper: type  # FasterDecoding SnapKVCluster
    rkv_snapkv: type  # R-KV SnapKV
    rkv_r1kv: type  # R-KV R1KV
    kvc_cluster: type  # Sparse-RL sglang-kvc KVCluster

    @classmethod
    def from_dir(cls, root: Path) -> "References":
        snap = load("ref_snapkv_utils", root / "SnapKV/snapkv/monkeypatch/snapkv_utils.py")
        utils = load("ref_rkv.utils", root / "R-KV/rkv/utils.py")
        sys.modules["ref_rkv"] = types.ModuleType("ref_rkv")
        package = types.ModuleType("ref_rkv.compression")  # the stub for rkv/compression/__init__.py
        package.__path__ = [str(root / "R-KV/rkv/compression")]
        package.cal_similarity, package.compute_attention_scores = utils.cal_similarity, utils.compute_attention_scores
        sys.modules["ref_rkv.compression"] = package
        r1kv = load("ref_rkv.compression.r1_kv", root / "R-KV/rkv/compression/r1_kv.py")
        rkv_snap = load("ref_rkv.compression.snapkv", root / "R-KV/rkv/compression/snapkv.py")
        kvc = load("ref_r1kv_utils", root / "Sparse-RL/sglang-kvc/python/sglang/compress/r1kv_utils.py")
        return cls(snap.SnapKVCluster, rkv_snap.SnapKV, r1kv.R1KV, kvc.KVCluster)


@dataclass
class Case:
    keys: torch.Tensor  # (H_kv, L, D)
    queries: torch.Tensor  # (H_q, W, D): the last W tokens' queries
    positions: torch.Tensor  # (H_kv, L), ascending per head
    budget: int

    @property
    def mha(self) -> bool:
        return self.queries.shape[0] == self.keys.shape[0]


def make_case(seed: int, n_q: int, n_kv: int, dim: int, length: int, budget: int, gaps: bool) -> Case:
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(n_kv, 1, dim, generator=g)
    offset = offset / offset.norm(dim=-1, keepdim=True) * (seed % 3) * 0.6 * dim ** 0.5  # 0, 0.6 or 1.2 x noise norm
    keys = torch.randn(n_kv, length, dim, generator=g) + offset
    n_clusters = 6
    centers = torch.randn(n_kv, n_clusters, dim, generator=g) * 1.5
    member = torch.rand(n_kv, length, generator=g) < 0.4  # 40% of the tokens are near-copies of a center
    which = torch.randint(0, n_clusters, (n_kv, length), generator=g)
    clustered = centers.gather(1, which.unsqueeze(-1).expand(-1, -1, dim)) + offset
    clustered = clustered + 0.3 * torch.randn(n_kv, length, dim, generator=g)
    keys = torch.where(member.unsqueeze(-1), clustered, keys)
    # Window queries: noise plus a pull toward a few random earlier keys of their KV group (heavy hitters).
    group = n_q // n_kv
    targets = torch.randint(0, length - WINDOW, (n_q, 4), generator=g)
    kv_of = torch.arange(n_q) // group
    aimed = keys[kv_of.unsqueeze(-1), targets].sum(dim=1, keepdim=True) / dim ** 0.5  # (H_q, 1, D)
    queries = torch.randn(n_q, WINDOW, dim, generator=g) + 2.0 * aimed * torch.rand(n_q, WINDOW, 1, generator=g)
    if gaps:  # entries survived an earlier per-head compression: ascending positions with per-head gaps
        picks = [torch.randperm(2 * length - WINDOW, generator=g)[: length - WINDOW].sort().values for _ in range(n_kv)]
        window = torch.arange(2 * length - WINDOW, 2 * length)
        positions = torch.stack([torch.cat([p, window]) for p in picks])
    else:
        positions = torch.arange(length).expand(n_kv, length).clone()
    return Case(keys, queries, positions, budget)


def cases(seeds: int) -> list[Case]:
    out = []
    for si, (n_q, n_kv, dim) in enumerate(SHAPES):
        for li, (length, budget) in enumerate(SIZES):
            for s in range(seeds):
                seed = 1000 * si + 100 * li + s
                out.append(make_case(seed, n_q, n_kv, dim, length, budget, gaps=s % 2 == 1))
    return out


# ---------------------------------------------------------------- sparserl's selection
def ours(case: Case, algorithm: str, variant: str, shared: bool) -> list[set[int]]:
    cfg = KVPolicyConfig(algorithm=algorithm, budget=case.budget, window=WINDOW, kernel=KERNEL, mix_lambda=LAMBDA,
                         sim_threshold=0.5, variant=variant, share="layer" if shared else "head")
    scores = score_tokens(cfg, case.keys, case.queries, case.positions)
    idx = select_keep(scores, case.budget, WINDOW, shared, normalize=cfg.normalize_sums)
    return [set(row) for row in (idx[:1] if shared else idx).tolist()]


# ---------------------------------------------------------------- the reference code's selection
def indexed_values(case: Case) -> torch.Tensor:
    """(1, H_kv, L, D) values whose channel 0 is the entry's slot: the kept slots can be read off the output."""
    n_kv, length, dim = case.keys.shape
    values = torch.zeros(1, n_kv, length, dim)
    values[..., 0] = torch.arange(length, dtype=torch.float32)
    return values


def kept_from_values(values: torch.Tensor) -> list[set[int]]:
    return [set(row) for row in values[0, :, :, 0].round().long().tolist()]


def ref_snapkv_paper(refs: References, case: Case) -> list[set[int]]:
    n_kv, length, dim = case.keys.shape
    full = torch.zeros(1, n_kv, length, dim)  # it takes the whole prefill's queries and reads the last window
    full[0, :, -WINDOW:] = case.queries
    cluster = refs.snapkv_paper(window_size=WINDOW, max_capacity_prompt=case.budget, kernel_size=KERNEL,
                                pooling="maxpool")
    _, values = cluster.update_kv(case.keys[None], full, indexed_values(case), None, 1)
    return kept_from_values(values)


def ref_rkv_repo(refs: References, case: Case, algorithm: str) -> list[set[int]]:
    kw = dict(budget=case.budget, window_size=WINDOW, kernel_size=KERNEL)
    if algorithm == "rkv":
        method = refs.rkv_r1kv(mix_lambda=LAMBDA, retain_ratio=0.1, retain_direction="last", **kw)
    else:
        method = refs.rkv_snapkv(**kw)
    _, values = method.update_kv(case.keys[None], case.queries[None], indexed_values(case))
    return kept_from_values(values)


def ref_sglang_kvc(refs: References, case: Case, algorithm: str) -> list[set[int]]:
    cluster = refs.kvc_cluster(compress_method="RKV" if algorithm == "rkv" else "snapkv",
                               max_capacity_prompts=case.budget, window_size=WINDOW, kernel_size=KERNEL,
                               attn_pooling="max", pooling="maxpool", mix_alpha=LAMBDA, retain_ratio=0.2)
    idx = cluster.get_compress_indices(case.keys[None], case.queries[None], indexed_values(case), None)
    return [set(idx.tolist())]


# ---------------------------------------------------------------- comparison
COMPARISONS = [  # (policy, reference label, our sets shared?, reference fn, MHA only)
    ("snapkv", "SnapKV paper code (SnapKVCluster, maxpool), MHA cases", False, ref_snapkv_paper, True),
    ("snapkv", "R-KV repo SnapKV", False, lambda r, c: ref_rkv_repo(r, c, "snapkv"), False),
    ("snapkv", "Sparse-RL sglang-kvc KVCluster snapkv", True, lambda r, c: ref_sglang_kvc(r, c, "snapkv"), False),
    ("rkv", "R-KV repo R1KV", False, lambda r, c: ref_rkv_repo(r, c, "rkv"), False),
    ("rkv", "Sparse-RL sglang-kvc KVCluster RKV", True, lambda r, c: ref_sglang_kvc(r, c, "rkv"), False),
]


def agreement(mine: list[set[int]], theirs: list[set[int]], budget: int) -> list[float]:
    assert len(mine) == len(theirs) and all(len(s) == budget for s in mine + theirs), "sets of the wrong size"
    return [len(a & b) / budget for a, b in zip(mine, theirs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", type=Path, required=True, help="folder with R-KV/, SnapKV/ and Sparse-RL/")
    ap.add_argument("--seeds", type=int, default=6, help="caches per (shape, size); odd seeds have position gaps")
    args = ap.parse_args()
    refs = References.from_dir(args.reference_dir)
    all_cases = cases(args.seeds)
    rows = []
    with torch.inference_mode():
        for policy, label, shared, ref_fn, mha_only in COMPARISONS:
            picked = [c for c in all_cases if c.mha or not mha_only]
            theirs = [ref_fn(refs, c) for c in picked]
            for variant in ("paper", "reference"):
                scores = []
                for case, ref_sets in zip(picked, theirs):
                    scores += agreement(ours(case, policy, variant, shared), ref_sets, case.budget)
                exact = sum(s == 1.0 for s in scores) / len(scores)
                rows.append([policy, label, "share=layer" if shared else "per head", variant, len(scores),
                             f"{sum(scores) / len(scores):.4f}", f"{min(scores):.4f}", f"{exact:.3f}"])
    print(f"{len(all_cases)} caches ({len(SHAPES)} shapes x {len(SIZES)} (length, budget) x {args.seeds} seeds), "
          f"window {WINDOW}, kernel {KERNEL}, lambda {LAMBDA}; {machine()}\n")
    print_table(["policy", "reference code", "our sets", "variant", "sets", "agreement mean", "min", "exact"], rows)


if __name__ == "__main__":
    main()
