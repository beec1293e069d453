"""Does training with partial rollouts keep the synchronous gain? GRPO on the long-tail env (envs/long_tail.py),
synchronous against `rollout.partial.enable=true`, several seeds, one held-out evaluation.

    python benchmarks/partial_gain.py                       # 3 seeds x 2 modes, then the table (docs/results.md)
    python benchmarks/partial_gain.py --report-only         # the table from the records alone

SmolLM2-135M-Instruct does not write a count one number per line (it scores 0 on the env), so a short supervised
warm-start comes first (`python -m sparserl.trainer.sft`, `--sft-steps` batches of `--sft-batch` target responses
of held-apart rows, `--sft-lr`): it starts writing counts one number per line (held-out score ~0.1: room to gain,
and a reward on some samples), with the env's heavy-tailed lengths. Each run is
`torchrun -m sparserl.trainer.grpo` on 2 processes from that warm-start with the same seed, prompts, batch and lr; the partial one stops a step's generation once
`--finish-frac` of its samples have ended and carries the rest (`rollout.partial.*`, docs/training.md). Every final
policy and the warm-start are evaluated on the same held-out long-tail prompts (`python -m sparserl.eval`,
the env's own prompts at a held-out seed), dense, temperature 1, `--eval-n` samples per prompt, one shared sampling
seed; the score is the mean reward (avg@n). The table gives per mode the held-out gain over the start (mean ±
standard error over seeds), partial's share of the synchronous mean gain, and the seconds per step.

Every finished run and evaluation leaves a record in `--out/records/<name>.json` (its commands, its per-step
metrics, its score); a record with the same commands is not run again, so an interrupted experiment continues.
Left out on purpose: compressed rollouts here (benchmarks/replicate_gain.py measures those), and more than one
process count.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = "envs/long_tail.py"
MODES = ("synchronous", "partial")


def write_sft_data(path: Path, num: int, seed: int) -> None:
    """`num` long-tail rows (seed `seed`, apart from the runs' and the evaluation's) with their target responses."""
    sys.path.insert(0, str(ROOT))
    from sparserl.utils.envload import load_env

    env = load_env(str(ROOT / ENV)).module
    rows = env.make_prompts(num, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": env.target_response(r["answer"])}) + "\n"
                            for r in rows))


def sft_command(args, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "sparserl.trainer.sft", f"model.path={args.model}", f"env.path={ENV}",
            f"data.train_path={data}", f"trainer.output_dir={out}", f"trainer.total_steps={args.sft_steps}",
            f"trainer.prompts_per_step={args.sft_batch}", f"actor.lr={args.sft_lr}", "trainer.seed=0",
            "trainer.overwrite=true", "logger.progress=false"]


def grpo_command(args, mode: str, seed: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "sparserl.trainer.grpo", f"model.path={args.start}", f"env.path={ENV}",
           f"trainer.total_steps={args.steps}", f"trainer.seed={seed}", f"trainer.prompts_per_step={args.prompts}",
           f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}", f"actor.lr={args.lr}",
           "trainer.eval_every=0", "trainer.save_every=0", "logger.progress=false", f"trainer.output_dir={out}",
           "trainer.overwrite=true"]
    if mode == "partial":
        cmd += ["rollout.partial.enable=true", f"rollout.partial.finish_frac={args.finish_frac}",
                f"rollout.partial.max_staleness={args.max_staleness}"]
    return cmd


def eval_command(args, model: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "sparserl.eval", f"model.path={model}", f"env.path={ENV}", "eval.datasets=[env]",
            f"eval.limit={args.eval_prompts}", f"eval.n={args.eval_n}", "eval.k=[1]", "eval.temperature=1.0",
            f"eval.max_new_tokens={args.max_new_tokens}", f"eval.seed={args.eval_seed}", "rollout.kv.algorithm=none",
            f"eval.output_dir={out}", "logger.progress=false"]


def recorded(path: Path, cmds: list[list[str]]) -> dict | None:
    """The record at `path` if it holds these commands (same settings), else None."""
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return rec if rec.get("cmds") == [shlex.join(c) for c in cmds] else None


def run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPARSERL_PROGRESS": "0"}
    with log.open("w") as f:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        raise SystemExit(f"failed (exit {res.returncode}): {shlex.join(cmd)}\n  log: {log}\n" +
                         "".join(log.read_text().splitlines(keepends=True)[-15:]))


def score(eval_dir: Path) -> float:
    sets = json.loads((eval_dir / "eval.json").read_text())["datasets"]
    (metrics,) = sets.values()
    return float(next(v for k, v in metrics.items() if k.startswith("avg@")))


def one(args, name: str, cmds: list[list[str]], train_dir: Path | None, eval_dir: Path) -> dict:
    """Run (or take the record of) one training run and its evaluation."""
    path = args.out / "records" / f"{name}.json"
    rec = recorded(path, cmds)
    if rec is not None:
        print(f"{name}: recorded, not rerun (score {rec['score']:.4f})", flush=True)
        return rec
    t0 = time.perf_counter()
    for k, cmd in enumerate(cmds):
        print(f"{name}: {shlex.join(cmd)}", flush=True)
        run(cmd, args.out / "logs" / f"{name}.{k}.log")
    metrics = []
    if train_dir is not None:
        metrics = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    rec = {"name": name, "cmds": [shlex.join(c) for c in cmds], "score": score(eval_dir), "metrics": metrics,
           "wall_s": time.perf_counter() - t0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1))
    print(f"{name}: score {rec['score']:.4f} in {rec['wall_s'] / 60:.1f} min", flush=True)
    return rec


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def table(args, start: dict, runs: dict[tuple[str, int], dict]) -> str:
    lines = [f"warm-start ({args.sft_steps} SFT steps of {args.model}): held-out score {start['score']:.4f}", "",
             "| mode | held-out score (mean over seeds) | gain ± SE | share of the synchronous gain | s / step | "
             "rollout s / step | carried share |", "| --- | --- | --- | --- | --- | --- | --- |"]
    gains = {}
    for mode in MODES:
        recs = [runs[(mode, s)] for s in args.seeds if (mode, s) in runs]
        if not recs:
            continue
        g = [r["score"] - start["score"] for r in recs]
        gains[mode] = mean_se(g)
        steps = [m for r in recs for m in r["metrics"] if m.get("step", 0) > 0]
        step_s = sum(m["perf/step_s"] for m in steps) / len(steps)
        roll_s = sum(m.get("perf/rollout_s", 0.0) for m in steps) / len(steps)
        carried = [m["partial/carried_frac"] for m in steps if "partial/carried_frac" in m]
        share = gains[mode][0] / gains["synchronous"][0] if "synchronous" in gains and gains["synchronous"][0] else float("nan")
        lines.append(f"| {mode} ({len(recs)} seeds) | {sum(r['score'] for r in recs) / len(recs):.4f} | "
                     f"{gains[mode][0]:+.4f} ± {gains[mode][1]:.4f} | {share:.0%} | {step_s:.1f} | {roll_s:.1f} | "
                     f"{(sum(carried) / len(carried)) if carried else 0.0:.1%} |")
    lines.append("")
    lines += [f"- {mode} seed {s}: score {runs[(mode, s)]['score']:.4f}, {runs[(mode, s)]['wall_s'] / 60:.1f} min"
              for mode in MODES for s in args.seeds if (mode, s) in runs]
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "partial_gain")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sft-steps", type=int, default=2)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=3e-5)
    ap.add_argument("--prompts", type=int, default=8, help="trainer.prompts_per_step")
    ap.add_argument("--n", type=int, default=4, help="rollout.n")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--finish-frac", type=float, default=0.5)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-n", type=int, default=4)
    ap.add_argument("--eval-seed", type=int, default=1)
    ap.add_argument("--report-only", action="store_true", help="run nothing: the table from the records")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    runs: dict[tuple[str, int], dict] = {}
    sft_data, warm = args.out / "sft.jsonl", args.out / "warm"
    args.start = str(warm / "hf")
    start_eval = args.out / "evals" / "start"
    start_cmds = [sft_command(args, sft_data, warm), eval_command(args, args.start, start_eval)]
    if args.report_only:
        start = recorded(args.out / "records" / "start.json", start_cmds)
        for mode in MODES:
            for s in args.seeds:
                train = args.out / "runs" / f"{mode}_s{s}"
                cmds = [grpo_command(args, mode, s, train), eval_command(args, str(train), args.out / "evals" / f"{mode}_s{s}")]
                rec = recorded(args.out / "records" / f"{mode}_s{s}.json", cmds)
                if rec is not None:
                    runs[(mode, s)] = rec
        if start is None:
            raise SystemExit(f"no record of the start's evaluation in {args.out / 'records'}")
    else:
        write_sft_data(sft_data, args.sft_steps * args.sft_batch, seed=12345)
        start = one(args, "start", start_cmds, None, start_eval)
        for s in args.seeds:  # seed by seed, both modes: an interrupted experiment has matched pairs
            for mode in MODES:
                train, ev = args.out / "runs" / f"{mode}_s{s}", args.out / "evals" / f"{mode}_s{s}"
                runs[(mode, s)] = one(args, f"{mode}_s{s}", [grpo_command(args, mode, s, train),
                                                            eval_command(args, str(train), ev)], train, ev)
    text = table(args, start, runs)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
