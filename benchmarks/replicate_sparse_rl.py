"""Small-scale replication of Sparse-RL: dense vs naive-sparse vs Sparse-RL GRPO on a recall task.

    python benchmarks/replicate_sparse_rl.py --out outputs/replicate            # the full run (CPU, < 60 min)
    python benchmarks/replicate_sparse_rl.py --out /tmp/replicate_smoke --quick  # a 2-step smoke run

The task (envs/recall.py) states a few codes early in the prompt, then filler, then asks for one code. With
`rollout.kv.compress_prompt=true`, a KV budget well under the prompt length and a short `divide_length`,
R-KV compresses every sequence at its first decode step, so the facts can be evicted before the answer is
written; dense rollouts always see them. The script runs, printing every command before it runs it:

1. the data files: GRPO prompts (`make_prompts`) and warm-start examples (`make_sft_examples`, a separate
   random stream) with the chosen task size, under OUT/data/;
2. a supervised warm-start of SmolLM2-135M-Instruct on the answer format (`sparserl.trainer.sft`), skipped
   when OUT/sft/hf exists (`--redo-sft` reruns it);
3. three GRPO runs from that checkpoint with `+preset=dense`, `+preset=naive_sparse`, `+preset=sparse_rl`
   and the same seeds, steps, prompts and KV settings (OUT/<preset>/, logs in OUT/<preset>.log); a finished
   run made by the same command (OUT/<preset>.cmd) is not rerun;
4. OUT/reward.png (reward/mean against step, one line per run) and a markdown table, also written to
   OUT/summary.md: final reward (mean of the last `--last-k` steps), gain over step 1, KV retained fraction
   and pool peak (`kv/retained_frac`, `kv/peak_gb`), mismatch KL (`mismatch/kl`), rejected sequences
   (`correction/rejected_seq_frac`) and seconds per step, all means over steps except the reward columns.
   Rewards are those of each run's own training rollouts: compressed ones for the two sparse runs.
5. a held-out evaluation with `python -m sparserl.eval` (`--eval-prompts` prompts from a seed the training
   data never uses, written to OUT/data/held_out.jsonl, `--eval-n` samples each at temperature 1; results
   under OUT/eval/) of the warm-start and of every final policy, once dense and once with the runs' R-KV
   compression: the dense column is the paper's measure (its evaluations use a dense server), the compressed
   one shows robustness to sparse inference. The reward column is the evaluation's avg@n.

`kv/peak_gb` is the high-water mark of the step's KV pool: every sequence holds its whole prompt until its
first decode step compresses it, so with short responses the peak is close to dense; `kv/retained_frac`
(slots held at the end over the dense length) is where the saving shows.

The default sizes (4 facts, 6 filler sentences: ~158-token prompts; budget 64 with divide_length 16, so every
sequence is compressed to ~40% of its prompt at its first decode step; a 12-step warm-start, which takes the
model from 0.05 to ~0.95 dense reward and ~0.2 under this compression; 4 prompts x 8 samples per step,
10 steps) are chosen so that the warm-start and the three runs fit in an hour on a 2-core CPU.
Left out on purpose: repeated seeds; rerun with `--seed` for those.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks.common import machine, print_table  # noqa: E402

PRESETS = ("dense", "naive_sparse", "sparse_rl")
ENV_PATH = "envs/recall.py"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for data, runs, plot and table "
                    "(default outputs/replicate_sparse_rl, or outputs/replicate_sparse_rl_quick with --quick)")
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    ap.add_argument("--budget", type=int, default=64, help="rollout.kv.budget (entries kept, window included)")
    ap.add_argument("--divide-length", type=int, default=16, help="rollout.kv.divide_length")
    add_kv_scoring_args(ap)
    ap.add_argument("--quick", action="store_true", help="2-step smoke configuration (2 SFT steps, 2 GRPO steps, tiny batches)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.path of the warm-start")
    ap.add_argument("--seed", type=int, default=0, help="trainer.seed of every run; the data files use it too")
    ap.add_argument("--facts", type=int, default=4, help="codes stated per prompt")
    ap.add_argument("--filler", type=int, default=6, help="filler sentences between the codes and the question")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="rollout.n, samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5, help="GRPO actor.lr")
    ap.add_argument("--sft-steps", type=int, default=12)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--redo-sft", action="store_true", help="rerun the warm-start even if OUT/sft/hf exists")
    ap.add_argument("--nproc", type=int, default=1, help="processes per run: 1 runs python -m, more run torchrun")
    ap.add_argument("--last-k", type=int, default=3, help="final reward = mean of the last k steps")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's DCP checkpoints (~1.6 GB each)")
    ap.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts for the final evaluation (0: none)")
    ap.add_argument("--eval-n", type=int, default=2, help="samples per held-out prompt")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for the GRPO runs")
    ap.set_defaults(env=ENV_PATH, compress_prompt=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.sft_steps, args.sft_batch = 2, 2, 2
        args.prompts_per_step, args.n, args.max_new_tokens, args.last_k = 2, 4, 16, 1
        args.eval_prompts, args.eval_n = min(args.eval_prompts, 4), 1
    if args.out is None:
        args.out = "outputs/replicate_sparse_rl" + ("_quick" if args.quick else "")
    if args.budget <= 8:
        ap.error("--budget must be larger than the R-KV window (8)")
    return args


# ----------------------------------------------------------------------------- commands
# Shared with benchmarks/replicate_long.py: they read the task (`args.env`) and the KV settings (`args.budget`,
# `args.divide_length`, `args.compress_prompt`) from the parsed arguments.


def python_module(module: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module]


def sft_command(args, out: Path, data: Path) -> list[str]:
    return python_module("sparserl.trainer.sft") + [
        f"model.path={args.model}", f"env.path={args.env}", f"data.train_path={data}", f"trainer.output_dir={out}",
        f"trainer.total_steps={args.sft_steps}", f"trainer.prompts_per_step={args.sft_batch}", f"actor.lr={args.sft_lr}",
        f"actor.warmup_steps={min(3, args.sft_steps - 1)}", f"trainer.seed={args.seed}",
        "trainer.overwrite=true",  # called when the warm start is missing or to be redone: a partial one goes
    ]


def add_kv_scoring_args(ap: argparse.ArgumentParser) -> None:
    # The recorded runs scored as the papers say with one set per KV head; the presets now default to the reference
    # code's scoring with one set per layer, so the replications pin what they ran.
    ap.add_argument("--kv-variant", default="paper", help="rollout.kv.variant (paper | reference)")
    ap.add_argument("--kv-share", default="head", help="rollout.kv.share (head | layer | all)")


def kv_overrides(args) -> list[str]:
    return [f"rollout.kv.budget={args.budget}", f"rollout.kv.divide_length={args.divide_length}",
            f"rollout.kv.compress_prompt={str(args.compress_prompt).lower()}",
            f"rollout.kv.variant={args.kv_variant}", f"rollout.kv.share={args.kv_share}"]


def grpo_command(args, preset: str, model: Path, data: Path, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    # The KV keys are set for every preset (the dense one ignores them), so the runs differ only in the preset.
    return python_module("sparserl.trainer.grpo", args.nproc) + [
        f"+preset={preset}", f"model.path={model}", f"env.path={args.env}", f"data.train_path={data}",
        f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}", f"trainer.prompts_per_step={args.prompts_per_step}",
        f"trainer.seed={args.seed}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"actor.lr={args.lr}", *kv_overrides(args), *extra, *args.override,
    ]


_side_by_side = threading.local()  # set in the threads of `run_all` with jobs > 1


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd` from the repo root, echoing its output and keeping it in `log`; exit on failure. Inside `run_all`
    with more than one job the output goes to `log` only, with one line when the command starts and one when it ends."""
    alone = not getattr(_side_by_side, "on", False)
    print(f"\n$ {shlex.join(cmd)}" if alone else f"started: {shlex.join(cmd)}\n  (output: {log})", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "SPARSERL_PROGRESS": "0"}
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if alone and not line.startswith("Loading weights"):
                print("  " + line, end="", flush=True)
        code = proc.wait()
    if code != 0:
        sys.exit(f"{'the command above' if alone else shlex.join(cmd)} failed with exit code {code}; "
                 f"its output is in {log}")
    if not alone:
        print(f"finished in {time.perf_counter() - t0:.0f} s: {log}", flush=True)
    return time.perf_counter() - t0


def add_jobs_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs and evaluations side by side (each with CPUs / jobs threads unless OMP_NUM_THREADS is set); "
                         "their outputs then go to their logs only")


def run_all(tasks: list[Callable[[], object]], jobs: int) -> list:
    """Call `tasks` (each runs its commands with `run`) `jobs` at a time; their results in order. The first failure
    cancels the tasks still waiting and is raised once the running ones are done."""
    if jobs <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    if "OMP_NUM_THREADS" not in os.environ:  # the runs' torch threads share the machine's cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))

    def side_by_side(task):
        _side_by_side.on = True
        return task()

    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(side_by_side, task) for task in tasks]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def run_grpo(cmd: list[str], run_dir: Path, steps: int, stamp: Path, log: Path, keep_checkpoints: bool) -> float | None:
    """Run a GRPO command unless `run_dir` already holds its `steps` steps and final policy from this very command
    (recorded in `stamp`); returns the seconds it took, None when reused. Drops the DCP checkpoints unless kept."""
    if (len(read_metrics(run_dir)) >= steps and (run_dir / "hf").exists() and stamp.exists()
            and stamp.read_text() == shlex.join(cmd)):
        print(f"\n{run_dir}: already has its {steps} steps from this command; not rerun")
        return None
    stamp.unlink(missing_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # another command's run, or an unfinished one: start over
    took = run(cmd, log)
    stamp.write_text(shlex.join(cmd))
    if not keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return took


# ----------------------------------------------------------------------------- data and results


def env_module(args):
    from sparserl.utils.envload import load_env

    return load_env(str(ROOT / args.env)).module


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_data(args, folder: Path) -> tuple[Path, Path]:
    env = env_module(args)
    size = dict(num_facts=args.facts, filler_sentences=args.filler)
    num_prompts = max(256, args.steps * args.prompts_per_step)
    prompts = write_jsonl(folder / "prompts.jsonl", env.make_prompts(num_prompts, args.seed, **size))
    sft = write_jsonl(folder / "sft.jsonl", env.make_sft_examples(max(512, args.sft_steps * args.sft_batch), args.seed, **size))
    return prompts, sft


def eval_command(args, model_dir: Path, data: Path, out: Path, compressed: bool) -> list[str]:
    """`python -m sparserl.eval` on the held-out rows: temperature 1 (as in training), `--eval-n` samples each,
    dense or with the runs' R-KV compression (same budget, divide_length, compress_prompt). The set is named
    after the env file (`recall`), which is where eval.json puts its metrics."""
    held_out = f"{{name:{eval_set_name(args)},path:'{data}',prompt_key:prompt,answer_key:answer,env:{args.env}}}"
    cmd = python_module("sparserl.eval") + [
        f"model.path={model_dir}", f"eval.datasets=[{held_out}]", f"eval.n={args.eval_n}", "eval.k=[1]",
        "eval.temperature=1.0", f"eval.max_new_tokens={args.max_new_tokens}", f"eval.seed={args.seed + 1}",
        f"eval.output_dir={out}", "logger.progress=false",
    ]
    if compressed:
        cmd += ["rollout.kv.algorithm=rkv", *kv_overrides(args)]
    return cmd


def eval_set_name(args) -> str:
    return Path(args.env).stem


def evaluation_table(args, models: dict[str, Path], out: Path) -> tuple[list[str], list[list]]:
    """Dense and compressed held-out reward (avg@n of `sparserl.eval`) of the warm-start and of every run's final policy."""
    rows = env_module(args).make_prompts(args.eval_prompts, args.seed + 10_000, num_facts=args.facts,
                                         filler_sentences=args.filler)
    data = write_jsonl(out / "data" / "held_out.jsonl", rows)
    table, start = [], None
    for name, path in models.items():
        if not (path / "config.json").exists():
            continue
        means = []
        for mode in ("dense", "rkv"):
            folder = out / "eval" / f"{name}_{mode}"
            run(eval_command(args, path, data, folder, mode == "rkv"), out / "eval" / f"{name}_{mode}.log")
            means.append(json.loads((folder / "eval.json").read_text())["datasets"][eval_set_name(args)][f"avg@{args.eval_n}"])
        dense, sparse = means
        start = dense if start is None else start
        table.append([name, f"{dense:.3f}", f"{dense - start:+.3f}", f"{sparse:.3f}"])
        print(table[-1], flush=True)
    return ["policy", "dense eval reward", "gain over warm-start", f"R-KV b={args.budget} eval reward"], table


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def summary_rows(runs: dict[str, Path], last_k: int) -> list[list]:
    table = []
    for name, run_dir in runs.items():
        rows = read_metrics(run_dir)
        if not rows:
            continue
        final = mean_of(rows[-last_k:], "reward/mean")
        first = rows[0].get("reward/mean")
        table.append([
            name, len(rows), fmt(first), fmt(final), fmt(None if final is None or first is None else final - first, sign=True),
            fmt(mean_of(rows, "kv/retained_frac")), fmt(mean_of(rows, "kv/peak_gb"), digits=4),
            fmt(mean_of(rows, "mismatch/kl"), sci=True), fmt(mean_of(rows, "correction/rejected_seq_frac")),
            fmt(mean_of(rows, "response/len_mean"), digits=1), fmt(mean_of(rows, "perf/step_s"), digits=1),
        ])
    return table


def fmt(x: float | None, digits: int = 3, sign: bool = False, sci: bool = False) -> str:
    if x is None:
        return "-"
    if sci:
        return f"{x:.2e}"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    data_dir, sft_dir = out / "data", out / "sft"
    runs = {p: out / p for p in PRESETS}
    print(f"machine: {machine()}", flush=True)
    prompts, sft_data = (data_dir / "prompts.jsonl", data_dir / "sft.jsonl")
    commands = [sft_command(args, sft_dir, sft_data)] + [grpo_command(args, p, sft_dir / "hf", prompts, runs[p]) for p in PRESETS]
    if args.dry_run:
        for cmd in commands:
            print(shlex.join(cmd))
        return

    prompts, sft_data = write_data(args, data_dir)
    print(f"data: {prompts} and {sft_data} ({args.facts} facts, {args.filler} filler sentences, seed {args.seed})")
    seconds = {}
    if args.redo_sft or not (sft_dir / "hf" / "config.json").exists():
        seconds["sft"] = run(commands[0], out / "sft.log")
    else:
        print(f"\nwarm-start: reusing {sft_dir / 'hf'} (--redo-sft reruns it)")
    for preset, cmd in zip(PRESETS, commands[1:]):
        took = run_grpo(cmd, runs[preset], args.steps, out / f"{preset}.cmd", out / f"{preset}.log", args.keep_checkpoints)
        if took is not None:
            seconds[preset] = took

    from plot_metrics import plot_runs

    smooth = 3 if args.steps >= 6 else 1
    png = plot_runs([runs[p] for p in PRESETS], "reward/mean", out / "reward.png", labels=list(PRESETS), smooth=smooth,
                    title=f"recall task, R-KV budget {args.budget} (compress_prompt), reward/mean")
    print(f"\nplot: {png}")
    headers = ["run", "steps", "reward step 1", f"final reward (last {args.last_k})", "gain", "kv retained frac",
               "kv peak GB", "mismatch KL", "rejected seq frac", "resp len", "s/step"]
    print()
    text = print_table(headers, summary_rows(runs, args.last_k),
                       title=f"dense vs naive sparse vs Sparse-RL, budget {args.budget}, {args.steps} steps, seed {args.seed}")
    if args.eval_prompts:
        t0 = time.perf_counter()
        print(f"\nheld-out evaluation: {args.eval_prompts} prompts x {args.eval_n} samples, temperature 1", flush=True)
        headers, rows = evaluation_table(args, {"warm-start": sft_dir / "hf", **{p: runs[p] / "hf" for p in PRESETS}}, out)
        print()
        text += "\n\n" + print_table(headers, rows, title=f"held-out evaluation ({args.eval_prompts} prompts x {args.eval_n})")
        seconds["eval"] = time.perf_counter() - t0
    timing = ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
    print(f"\nwall time: {timing or 'nothing rerun'}")
    cmds = "\n".join(shlex.join(c) for c in commands)
    (out / "summary.md").write_text(f"{text}\n\nmachine: {machine()}\nwall time: {timing}\n\n```\n{cmds}\n```\n")
    print(f"summary: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
