"""Sparse-RL replication on long responses: dense vs naive sparse vs Sparse-RL on a 30-link chain task, several seeds.

    python benchmarks/replicate_long.py --out outputs/replicate_long                 # the full experiment (3 seeds, 94.7 min on a 2-core EPYC)
    python benchmarks/replicate_long.py --out /tmp/replicate_long_quick --quick      # smoke run, one seed, ~2 min
    python benchmarks/replicate_long.py --jobs 2 ...   # two runs (then two evaluations) at a time, each on half the cores

The task (envs/long_chain.py) lists 30 word links "a -> b" in a random order and asks for the chain from a
start word, one numbered line per link: a ~200-token response in which every line reads a different fact of
the prompt, and the reward is the fraction of the chain followed before the first mistake. Under R-KV
compression an evicted link breaks the chain at that line, so the sampler/learner mismatch is spread over the
whole response and compounds, which is what benchmarks/replicate_sparse_rl.py (10-token answers) lacked.
The script runs, printing every command before it runs it:

1. the data (OUT/data/): GRPO prompts, warm-start examples and held-out prompts, each from its own random
   stream of `--data-seed`;
2. one supervised warm-start of SmolLM2-135M-Instruct (`sparserl.trainer.sft`, OUT/sft/), shared by every run;
3. for every seed in `--seeds` and every configuration, a GRPO run from the warm-start with `+preset=dense`,
   `+preset=naive_sparse` or `+preset=sparse_rl` (OUT/<preset>/seed<k>/). Within a seed the runs share
   trainer.seed (so the same prompts in the same order), steps, batch sizes, lr and KV settings; they differ
   only in the preset. The dense and naive runs carry `algo.correction.enable=true mode=measure`, which
   changes nothing in their updates and logs what Sparse-RL's filters would have rejected. A finished run made
   by the same command is not rerun;
4. a held-out dense evaluation (`python -m sparserl.eval`, temperature 1, the same seed for every policy) of
   the warm-start and of every final policy, plus the warm-start once under the runs' R-KV compression (how
   much compression alone costs on this task). Score = mean reward of the samples (eval.json's avg@n counts
   a sample as correct when its reward is > 0, which for a partial-credit reward is not the score);
5. OUT/summary.md: per configuration, mean +- std over seeds of the training reward gain (mean of the last
   `--last-k` steps minus mean of the first `--last-k`; rewards of each run's own rollouts, compressed for the
   two sparse runs) and of the held-out gain (final policy minus warm-start, dense); the diagnostics (means
   over steps, then mean +- std over seeds): `actor/entropy`, `actor/grad_norm`, `mismatch/kl`,
   `mismatch/low_xi_pos_adv_frac` (positive-advantage tokens with xi < 0.1), `correction/rejected_seq_frac`,
   `response/len_mean`, `kv/retained_frac`, `perf/step_s`; and every run on its own line. OUT/reward.png (reward
   against step, mean +- std band over seeds), OUT/diagnostics.png (the same for each diagnostic) and
   OUT/curves.json (the per-step means and stds behind them).

Default sizes, and why. 30 links: ~200-token responses (the point of the task) after a 199-token prompt. R-KV
with budget 192, divide_length 32 and compress_prompt off: a sequence never keeps fewer entries than its prompt,
and from the 32nd response token on it is compressed back to 199 entries every 32 steps, so prompt and response
entries compete for a cache that ends at ~51% of the sequence (the paper's setting: a budget below the whole
sequence, the prompt not cut before decoding starts). A 4-step warm-start (batch 8, lr 1e-4) takes
SmolLM2-135M-Instruct from 0.00 to 0.39 held-out dense score (16 prompts, temperature 1), and the same policy
scores 0.19 under this compression: room to improve densely, and compressed rollouts that still earn reward.
8 GRPO steps x 2 prompts x 4 samples at lr 1e-5 (one dense pilot run moved the held-out score 0.39 -> 0.43), 16
held-out prompts. Measured on an idle moment of the 2-core CPU box: ~66 s per GRPO step (rollout 35-45 s, update
~26 s), ~9 min per run, ~80 s per evaluation; the whole experiment (warm-start, 9 runs, 11 evaluations) took
94.7 min, over a 90-minute target, and 8 steps give a small dense gain (results: docs/replications.md).
`--steps 16` gives the runs twice the updates for ~3 h.

Left out on purpose: a warm-start per seed (seeds vary the RL, not the starting policy), and compressed
evaluations of the final policies (`--eval-compressed` adds them).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks.common import machine, print_table  # noqa: E402
from benchmarks.replicate_sparse_rl import (PRESETS, add_jobs_arg, add_kv_scoring_args, env_module,  # noqa: E402
                                            eval_command, eval_set_name, fmt, grpo_command, read_metrics, run, run_all,
                                            run_grpo, sft_command, write_jsonl)

ENV_PATH = "envs/long_chain.py"
# algo.correction in "measure" mode: the Sparse-RL filters' numbers are logged, the update is untouched.
MEASURE = ("algo.correction.enable=true", "algo.correction.mode=measure")
DIAGNOSTICS = ("actor/entropy", "actor/grad_norm", "mismatch/kl", "mismatch/low_xi_pos_adv_frac",
               "correction/rejected_seq_frac", "response/len_mean", "kv/retained_frac")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for data, runs, plots and summary "
                    "(default outputs/replicate_long, or outputs/replicate_long_quick with --quick)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="trainer.seed of each repetition (default 0 1 2; --quick: 0)")
    ap.add_argument("--configs", nargs="+", choices=PRESETS, default=list(PRESETS), help="presets to run")
    ap.add_argument("--quick", action="store_true", help="smoke configuration: 3-link chains, 2 steps, tiny batches, one seed")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.path of the warm-start")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the data files and of the warm-start")
    ap.add_argument("--links", type=int, default=30, help="links per chain (response lines)")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps per run")
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--n", type=int, default=4, help="rollout.n, samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=240)
    ap.add_argument("--lr", type=float, default=1e-5, help="GRPO actor.lr")
    ap.add_argument("--budget", type=int, default=192, help="rollout.kv.budget (entries kept, window included; without "
                    "--compress-prompt never below the prompt's length)")
    ap.add_argument("--divide-length", type=int, default=32, help="rollout.kv.divide_length")
    add_kv_scoring_args(ap)
    ap.add_argument("--compress-prompt", action=argparse.BooleanOptionalAction, default=False,
                    help="rollout.kv.compress_prompt: may compression evict prompt entries below the prompt's length")
    ap.add_argument("--sft-steps", type=int, default=4)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--redo-sft", action="store_true", help="rerun the warm-start even if OUT/sft/hf exists")
    ap.add_argument("--nproc", type=int, default=1, help="processes per run: 1 runs python -m, more run torchrun")
    ap.add_argument("--last-k", type=int, default=3, help="training gain = mean of the last k steps - mean of the first k")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's DCP checkpoints (~1.6 GB each)")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts (0: no evaluation)")
    ap.add_argument("--eval-n", type=int, default=1, help="samples per held-out prompt")
    ap.add_argument("--eval-compressed", action="store_true", help="also evaluate every final policy under the R-KV settings")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for the GRPO runs")
    add_jobs_arg(ap)
    ap.set_defaults(env=ENV_PATH)
    args = ap.parse_args(argv)
    if args.quick:
        args.links, args.steps, args.prompts_per_step, args.n, args.max_new_tokens = 3, 2, 2, 2, 24
        args.sft_steps, args.sft_batch, args.last_k = 1, 2, 1
        args.budget, args.divide_length = 48, 8
        args.eval_prompts, args.eval_n = min(args.eval_prompts, 2), 1
        args.seeds = args.seeds or [0]
    args.seeds = args.seeds or [0, 1, 2]
    args.seed = args.data_seed  # what the shared helpers read for the warm-start and the evaluation seed
    if args.out is None:
        args.out = "outputs/replicate_long" + ("_quick" if args.quick else "")
    if args.budget <= 8:
        ap.error("--budget must be larger than the R-KV window (8)")
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds must be distinct, got {args.seeds}")
    return args


def with_seed(args, seed: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "seed": seed})


def run_dir(out: Path, preset: str, seed: int) -> Path:
    return out / preset / f"seed{seed}"


def grpo_commands(args, out: Path) -> dict[tuple[str, int], list[str]]:
    model, prompts = out / "sft" / "hf", out / "data" / "prompts.jsonl"
    return {(p, s): grpo_command(with_seed(args, s), p, model, prompts, run_dir(out, p, s),
                                 extra=() if p == "sparse_rl" else MEASURE)
            for s in args.seeds for p in args.configs}


def write_data(args, folder: Path) -> dict[str, Path]:
    env, size = env_module(args), dict(num_links=args.links)
    return {
        "prompts": write_jsonl(folder / "prompts.jsonl",
                               env.make_prompts(max(256, args.steps * args.prompts_per_step), args.data_seed, **size)),
        "sft": write_jsonl(folder / "sft.jsonl",
                           env.make_sft_examples(max(512, args.sft_steps * args.sft_batch), args.data_seed, **size)),
        "held_out": write_jsonl(folder / "held_out.jsonl",
                                env.make_prompts(args.eval_prompts, args.data_seed + 10_000, **size)),
    }


# ----------------------------------------------------------------------------- evaluation


def evaluate(args, name: str, model: Path, data: Path, out: Path, compressed: bool) -> dict[str, float]:
    """Held-out score of one policy: {"score": mean reward, "full": fraction of whole chains, "len": response tokens,
    "kv": KV retained fraction}. Reuses OUT/eval/<name>/ when its recorded command is this one."""
    folder = out / "eval" / name
    cmd = eval_command(args, model, data, folder, compressed)
    stamp = out / "eval" / f"{name}.cmd"
    if not (stamp.exists() and stamp.read_text() == shlex.join(cmd) and (folder / "samples.jsonl").exists()):
        stamp.unlink(missing_ok=True)
        run(cmd, out / "eval" / f"{name}.log")
        stamp.write_text(shlex.join(cmd))
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["dataset"] == eval_set_name(args)]
    kv = json.loads((folder / "eval.json").read_text())["datasets"][eval_set_name(args)]["kv_retained_frac"]
    return {"score": sum(r["score"] for r in rows) / len(rows), "full": sum(r["score"] >= 1.0 for r in rows) / len(rows),
            "len": sum(r["tokens"] for r in rows) / len(rows), "kv": kv}


# ----------------------------------------------------------------------------- statistics and tables


def mean_std(values: list[float]) -> tuple[float, float] | None:
    """Mean and sample standard deviation (0 for one value); None for no values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return m, var ** 0.5


def pm(stat: tuple[float, float] | None, digits: int = 3, sign: bool = False, sci: bool = False) -> str:
    if stat is None:
        return "-"
    return f"{fmt(stat[0], digits, sign, sci)} ± {fmt(stat[1], digits, False, sci)}"


def values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def run_mean(rows: list[dict], key: str) -> float | None:
    v = values(rows, key)
    return sum(v) / len(v) if v else None


def training_gain(rows: list[dict], k: int) -> float | None:
    first, last = run_mean(rows[:k], "reward/mean"), run_mean(rows[-k:], "reward/mean")
    return None if first is None or last is None else last - first


def curves(metrics: dict[tuple[str, int], list[dict]], configs: list[str], keys: tuple[str, ...]) -> dict:
    """{config: {key: {"steps", "mean", "std", "seeds"}}}: per step, over the seeds that logged the key."""
    out: dict = {}
    for c in configs:
        out[c] = {}
        for key in ("reward/mean", *keys):
            by_step: dict[int, list[float]] = {}
            for (preset, _), rows in metrics.items():
                if preset == c:
                    for r in rows:
                        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
                            by_step.setdefault(r["step"], []).append(float(r[key]))
            steps = sorted(by_step)
            stats = [mean_std(by_step[s]) for s in steps]
            out[c][key] = {"steps": steps, "mean": [m for m, _ in stats], "std": [sd for _, sd in stats],
                           "seeds": [len(by_step[s]) for s in steps]}
    return out


def plot_bands(curve: dict, keys: list[str], out: Path, title: str, cols: int = 1) -> Path:
    """One panel per key: each configuration's per-step mean over seeds, with a mean +- std band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.2 * cols if cols > 1 else 7, 3.2 * rows if cols > 1 else 4.5), dpi=120)
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        for config, per_key in curve.items():
            c = per_key.get(key)
            if not c or not c["steps"]:
                continue
            lo = [m - s for m, s in zip(c["mean"], c["std"])]
            hi = [m + s for m, s in zip(c["mean"], c["std"])]
            (line,) = ax.plot(c["steps"], c["mean"], linewidth=1.6, label=config)
            ax.fill_between(c["steps"], lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xlabel("step")
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    # wrapped to the figure width: a one-panel figure is narrower than a long title
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(fig.get_figwidth() * 13))), fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def tables(args, metrics: dict[tuple[str, int], list[dict]], evals: dict[str, dict]) -> str:
    """The markdown of summary.md's tables (also printed)."""
    k, text = args.last_k, []
    base = evals.get("warm-start_dense")
    per_run, by_config = [], {c: {"train": [], "eval": [], "eval_gain": [], "full": []} for c in args.configs}
    for (c, s), rows in metrics.items():
        gain = training_gain(rows, k)
        ev = evals.get(f"{c}_seed{s}")
        eval_gain = None if ev is None or base is None else ev["score"] - base["score"]
        for key, v in (("train", gain), ("eval", ev and ev["score"]), ("eval_gain", eval_gain), ("full", ev and ev["full"])):
            by_config[c][key].append(v)
        per_run.append([c, s, len(rows), fmt(run_mean(rows[:k], "reward/mean")), fmt(run_mean(rows[-k:], "reward/mean")),
                        fmt(gain, sign=True), fmt(ev and ev["score"]), fmt(eval_gain, sign=True),
                        fmt(run_mean(rows, "kv/retained_frac")), fmt(run_mean(rows, "perf/step_s"), 1)])
    seeds = " ".join(map(str, args.seeds))
    text.append(print_table(
        ["config", "seeds", f"train reward gain (last {k} - first {k})", "held-out dense score", "held-out gain over warm-start",
         "held-out full chains"],
        [[c, sum(v is not None for v in d["train"]), pm(mean_std(d["train"]), sign=True), pm(mean_std(d["eval"])),
          pm(mean_std(d["eval_gain"]), sign=True), pm(mean_std(d["full"]))] for c, d in by_config.items()],
        title=f"reward gain, mean ± std over seeds {seeds}"))
    diag = []
    for c in args.configs:
        runs = [rows for (p, _), rows in metrics.items() if p == c]
        stat = {key: mean_std([run_mean(rows, key) for rows in runs]) for key in (*DIAGNOSTICS, "perf/step_s")}
        diag.append([c, pm(stat["actor/entropy"]), pm(stat["actor/grad_norm"], sci=True), pm(stat["mismatch/kl"], sci=True),
                     pm(stat["mismatch/low_xi_pos_adv_frac"], 4), pm(stat["correction/rejected_seq_frac"]),
                     pm(stat["response/len_mean"], 1), pm(stat["kv/retained_frac"]), pm(stat["perf/step_s"], 1)])
    text.append(print_table(
        ["config", "entropy", "grad norm", "mismatch KL", "pos-adv tokens with xi < 0.1", "rejected seq frac",
         "response len", "kv retained frac", "s/step"], diag,
        title="diagnostics: mean over steps, then mean ± std over seeds (rejected: Sparse-RL's filters, measured only "
              "for dense / naive_sparse)"))
    text.append(print_table(["config", "seed", "steps", f"reward first {k}", f"reward last {k}", "train gain",
                             "held-out score", "held-out gain", "kv retained", "s/step"], per_run, title="every run"))
    if evals:
        text.append(print_table(["policy", "held-out score", "full chains", "response len", "kv retained"],
                                [[name, fmt(e["score"]), fmt(e["full"]), fmt(e["len"], 1), fmt(e["kv"])]
                                 for name, e in evals.items()],
                                title=f"held-out evaluation ({args.eval_prompts} prompts x {args.eval_n}, temperature 1)"))
    return "\n\n".join(text)


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    sft_dir = out / "sft"
    print(f"machine: {machine()}", flush=True)
    sft_cmd = sft_command(args, sft_dir, out / "data" / "sft.jsonl")
    commands = grpo_commands(args, out)
    if args.dry_run:
        for cmd in [sft_cmd, *commands.values()]:
            print(shlex.join(cmd))
        return

    data = write_data(args, out / "data")
    print(f"data: {out / 'data'} ({args.links} links per chain, seed {args.data_seed})")
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()
    if args.redo_sft or not (sft_dir / "hf" / "config.json").exists():
        seconds["sft"] = run(sft_cmd, out / "sft.log")
    else:
        print(f"\nwarm-start: reusing {sft_dir / 'hf'} (--redo-sft reruns it)")

    def grpo(preset, seed, cmd):
        d = run_dir(out, preset, seed)
        return run_grpo(cmd, d, args.steps, d.parent / f"seed{seed}.cmd", d.parent / f"seed{seed}.log", args.keep_checkpoints)

    took = run_all([lambda key=key, cmd=cmd: grpo(*key, cmd) for key, cmd in commands.items()], args.jobs)
    for (preset, seed), t in zip(commands, took):
        if t is not None:
            seconds[f"{preset} seed {seed}"] = t

    evals: dict[str, dict] = {}
    if args.eval_prompts:
        t0 = time.perf_counter()
        print(f"\nheld-out evaluation: {args.eval_prompts} prompts x {args.eval_n} samples, temperature 1", flush=True)
        todo = {"warm-start_dense": (sft_dir / "hf", False), "warm-start_rkv": (sft_dir / "hf", True)}
        for preset, seed in commands:
            model = run_dir(out, preset, seed) / "hf"
            todo[f"{preset}_seed{seed}"] = (model, False)
            if args.eval_compressed:
                todo[f"{preset}_seed{seed}_rkv"] = (model, True)
        results = run_all([lambda name=name, model=model, rkv=rkv: evaluate(args, name, model, data["held_out"], out, rkv)
                           for name, (model, rkv) in todo.items()], args.jobs)
        evals = dict(zip(todo, results))
        seconds["eval"] = time.perf_counter() - t0

    metrics = {key: read_metrics(run_dir(out, *key)) for key in commands}
    curve = curves(metrics, args.configs, DIAGNOSTICS)
    (out / "curves.json").write_text(json.dumps(curve, indent=1))
    kv = f"R-KV budget {args.budget}, divide_length {args.divide_length}" + (", compress_prompt" if args.compress_prompt else "")
    png = plot_bands(curve, ["reward/mean"], out / "reward.png",
                     f"long_chain ({args.links} links), {kv}: training reward, mean ± std over seeds {args.seeds}")
    diag_png = plot_bands(curve, list(DIAGNOSTICS), out / "diagnostics.png",
                          f"long_chain diagnostics, mean ± std over seeds {args.seeds}", cols=4)
    print(f"\nplots: {png}, {diag_png}\n")
    text = tables(args, metrics, evals)
    timing = ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
    total = time.perf_counter() - t_all
    print(f"\nwall time: {total / 60:.1f} min ({timing or 'nothing rerun'})")
    cmds = "\n".join(shlex.join(c) for c in [sft_cmd, *commands.values()])
    settings = (f"{args.links} links, {args.steps} steps x {args.prompts_per_step} prompts x {args.n} samples, lr {args.lr}, "
                f"max_new_tokens {args.max_new_tokens}, {kv}; warm-start {args.sft_steps} steps x {args.sft_batch}")
    (out / "summary.md").write_text(f"{settings}\n\n{text}\n\n![reward](reward.png)\n\n![diagnostics](diagnostics.png)\n\n"
                                    f"machine: {machine()}\nwall time: {total / 60:.1f} min ({timing})\n\n```\n{cmds}\n```\n")
    print(f"summary: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
