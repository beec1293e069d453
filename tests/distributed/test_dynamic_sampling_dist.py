"""Dynamic sampling over 2 processes (gloo) against 1: every rank trains on the same number of groups, groups
move to the rank short of its share, and the groups trained on, their samples and the prompts drawn are those of
the 1-process run (round seeds and the group order do not depend on the number of processes)."""
import os
import subprocess
from pathlib import Path

import torch

from sparserl.data.prompt_sampler import split
from tests.e2e.test_dynamic_sampling import PARITY_ENV
from tests.e2e.test_trainer import write_data
from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "dynamic_sampling_worker.py"
STEPS = 4


def run(ckpt, data, env, out: Path, nproc: int) -> list[dict]:
    out.mkdir()
    penv = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    args = [str(WORKER), str(ckpt), str(data), str(env), str(out), str(STEPS)]
    cmd = command(nproc, *args)
    res = subprocess.run(cmd, env=penv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return [torch.load(out / f"rank_{r}.pt") for r in range(nproc)]


def test_every_rank_trains_on_as_many_groups_as_one_process_would(tiny_checkpoint, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
            for a in range(1, 7) for b in range(1, 5)]
    data = write_data(tmp_path / "train.jsonl", rows)
    env = tmp_path / "env.py"
    env.write_text(PARITY_ENV)
    one = run(tiny_checkpoint, data, env, tmp_path / "one", 1)[0]
    two = run(tiny_checkpoint, data, env, tmp_path / "two", 2)
    assert two[0]["sampler"] == two[1]["sampler"] == one["sampler"]
    moved = 0
    for step in range(STEPS):
        ref, ranks = one["steps"][step], [r["steps"][step] for r in two]
        assert ranks[0]["metrics"] == ranks[1]["metrics"]
        assert ranks[0]["sizes"] == ranks[1]["sizes"] == ref["sizes"]
        # Short of the target, one process trains on every informative group, two on an even number of them.
        found = len(ref["keys"])
        groups = ranks[0]["metrics"]["dynamic/groups"]
        assert groups == (4 if ref["metrics"]["dynamic/target_reached"] else found // 2 * 2)
        assert {k: v for k, v in ranks[0]["metrics"].items() if k != "dynamic/groups"} == \
            {k: v for k, v in ref["metrics"].items() if k != "dynamic/groups"}
        assert all(len(r["keys"]) == groups // 2 and len(r["rewards"]) == 2 * len(r["keys"]) for r in ranks)
        # The same groups with the same samples as the one process's first ones.
        by_key = {k: (rw, row) for r in ranks for k, rw, row in zip(r["keys"], _pairs(r["rewards"]), _pairs(r["rows"]))}
        first = dict(list(zip(ref["keys"], zip(_pairs(ref["rewards"]), _pairs(ref["rows"]))))[: int(groups)])
        assert by_key == first
        if ref["metrics"]["dynamic/target_reached"]:
            assert all(a != b for a, b in _pairs(ref["rewards"]))
        # A group rolled out on the other rank, by the round's split of its prompts.
        for rank, r in enumerate(ranks):
            for round_, place in r["keys"]:
                start, end = split(r["sizes"][round_ - 1], rank, 2)
                moved += not start <= place < end
    assert moved, "no group moved between ranks: the run covers too little"
    assert any(r["metrics"]["dynamic/rounds"] > 1 for r in one["steps"])


def _pairs(values):
    return [tuple(values[i:i + 2]) for i in range(0, len(values), 2)]
