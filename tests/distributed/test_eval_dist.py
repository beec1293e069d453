"""`python -m sparserl.eval` with 1 process and `torchrun` with 2 (gloo) give the same samples and the same summary:
a sample's seed depends on (eval.seed, set, prompt row, sample index), never on the rank or batch position."""
import json
import os
import subprocess
from pathlib import Path

from tests.conftest import EVAL_DATA
from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]

# Scores a response by its word count, so that a random tiny model gets some samples right and some wrong, and
# gives maj@n something to vote on.
TOY_ENV = '''
max_turns = 1

def extract_answer(response):
    return str(len(response.split()) % 3)

async def step(state, action, extra_info):
    ok = extract_answer(action) == "0"
    return {"next_state": None, "reward": float(ok), "score": float(ok), "done": True, "extra_info": extra_info}
'''


def run_eval(nproc, args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0"}
    res = subprocess.run(command(nproc, "-m", "sparserl.eval", *args), env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_one_and_two_processes_give_the_same_samples_and_summary(tiny_checkpoint, tmp_path):
    env = tmp_path / "toy_env.py"
    env.write_text(TOY_ENV)
    toy = f"{{name:toy,path:{EVAL_DATA / 'mawps.jsonl'},prompt_key:input,answer_key:target,env:{env}}}"
    # 7 prompts per set: the ranks get 4 and 3; R-KV with the prompt compressed, so the sparse path is covered too.
    args = [f"model.path={tiny_checkpoint}", f"eval.datasets=[gsm8k,{toy}]", "eval.limit=7", "eval.n=3", "eval.k=[1,2,3]",
            "eval.temperature=1.0", "eval.max_new_tokens=8", "rollout.dtype=float32", "rollout.kv.algorithm=rkv",
            "rollout.kv.budget=24", "rollout.kv.divide_length=4", "rollout.kv.compress_prompt=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_eval(1, args + [f"eval.output_dir={one}"])
    res = run_eval(2, args + [f"eval.output_dir={two}"])
    assert "2 process(es)" in res.stdout
    assert (one / "samples.jsonl").read_text() == (two / "samples.jsonl").read_text()
    a, b = (json.loads((d / "eval.json").read_text()) for d in (one, two))
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["datasets"] == b["datasets"]
    samples = [json.loads(line) for line in (one / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 7 * 3
    toy_m = a["datasets"]["toy"]
    assert 0 < toy_m["avg@3"] < toy_m["pass@3"] <= 1 and "maj@3" in toy_m
    assert sum(s["correct"] for s in samples if s["dataset"] == "toy") == round(toy_m["avg@3"] * 21)
    assert a["datasets"]["gsm8k"]["kv_retained_frac"] < 0.5  # compressed
