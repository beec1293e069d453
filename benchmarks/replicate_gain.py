"""Does a sparse-rollout configuration keep the dense gain? Dense, naive sparse, Sparse-RL, mismatch-tail budget
control and the dense rescue, at two KV settings, several seeds, one held-out evaluation.

    python benchmarks/replicate_gain.py                          # everything not yet recorded (see "Across sessions")
    python benchmarks/replicate_gain.py --settings loose         # one KV setting (dense runs come first either way)
    python benchmarks/replicate_gain.py --max-minutes 90         # start no new run after 90 minutes
    python benchmarks/replicate_gain.py --report-only            # the tables and plots from the records alone
    python benchmarks/replicate_gain.py --quick --out /tmp/g     # smoke run: tiny sizes, one seed
    python benchmarks/replicate_gain.py --jobs 2                 # two runs at a time, each on half the cores

The task is envs/long_chain.py at 12 links: a ~127-token prompt lists 12 word links in random order and the
response walks the chain, one numbered line per link (~78 tokens); the reward is the fraction of the chain
followed before the first mistake. A 4-step supervised warm-start of SmolLM2-135M-Instruct scores ~0.6 on it,
dense, at temperature 1: room to gain, and reward on every sample.

KV settings (`--settings NAME=BUDGET ...`, R-KV, divide_length 16, compress_prompt on, so the prompt is compressed
too): `loose` = budget 128, where the warm-start's compressed sampler keeps >= 80% of its dense reward (the
paper's regime), and `tight` = budget 96. The configurations, all from the same warm-start with the same seeds,
prompts, batch and lr:

- `dense`: `+preset=dense`, shared by both settings;
- `naive_sparse`: `+preset=naive_sparse` (compressed rollouts trained as if on-policy);
- `sparse_rl`: `+preset=sparse_rl` (rejection + importance reweighting, the reference recipe);
- `tail`: Sparse-RL with `rollout.kv.budget=auto`, the controller between the setting's budget (floor) and 1.5x
  it (ceiling), on the 5th percentile of xi (target 0.86);
- `rescue`: Sparse-RL with `algo.correction.rescue=dense`, the rejected sequences rolled out again densely.
- `tail_p01` (only when named in `--configs`): `tail` steering by the 1st percentile of xi
  (`rollout.kv.control.statistic=xi_p01`), for mismatch carried by fewer than 5% of the tokens.
- `rescue_group` (only when named in `--configs`): `rescue` re-rolling a group whole once half of it is rejected
  (`algo.correction.rescue_group_frac=0.5`), so no group mixes dense redraws with compressed survivors.

dense and naive_sparse also log what Sparse-RL's filters would reject (`algo.correction.mode=measure`).

The regime task (`--task cycle_walk`; runs under outputs/sparse_regime, records in docs/replications/sparse_regime):
envs/cycle_walk.py, a 78-token prompt (6 word links of one loop, kept whole: compress_prompt off) and a 327-token
response walking the loop for 48 numbered steps, reward = the share of the walk followed before the first mistake.
One KV setting, `b80` = budget 80 (the response is > 4x the budget; a sequence ends holding at most 96 of its
~405 entries), a 6-step warm-start, 6 GRPO steps at lr 3e-5, 340 new tokens, fp32 compute (bf16 is emulated on
CPUs without it), and `rescue_group` in place of `rescue` among the five configurations.

Each run is evaluated on the same held-out prompts, dense, temperature 1, one shared sampling seed
(`python -m sparserl.eval`; a sparse run's evaluation sets `rollout.kv.algorithm=none`, because `sparserl.eval`
otherwise samples a run's policy with the run's own compression; `--eval-as-sampled` does that instead); the score
is the mean reward. The summary reports, per setting and configuration,
the held-out gain over the warm-start (mean ± standard error over seeds, and the standard error of per-prompt
gains averaged over seeds), the share of dense's mean gain kept, KV kept per sequence (`kv/retained_frac`),
the rejected share, the rescued share, and minutes per run; every run on its own line; reward and diagnostic
curves with seed bands (OUT/<setting>_reward.png, OUT/<setting>_diagnostics.png).

Across sessions: every finished run leaves a record, `--record/<run>.json` (default
docs/replications/sparse_gain/, committed): its GRPO and evaluation commands, its per-step metrics, its held-out
scores per prompt and its wall time. A run whose record holds the same commands is not run again, so the
experiment continues where the last session stopped; the final policy and checkpoints are deleted once the record
is written (`--keep-policies` keeps them). The warm-start is rebuilt (seeded, ~2 min) when a run needs it, and its
held-out scores are checked against the recorded ones: a different machine can round a warm-start differently,
and the script then says so instead of mixing the two.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks.common import machine  # noqa: E402
from benchmarks.gain_report import KEPT, mean_se, prompt_se, report, run_gain, share  # noqa: E402,F401
from benchmarks.replicate_long import MEASURE, write_data  # noqa: E402
from benchmarks.replicate_sparse_rl import (add_jobs_arg, add_kv_scoring_args, eval_command, eval_set_name,  # noqa: E402
                                            grpo_command, read_metrics, run, run_all, run_grpo, sft_command)

CONFIGS = ("dense", "naive_sparse", "sparse_rl", "tail", "rescue")
EXTRA_CONFIGS = ("tail_p01", "rescue_group")  # run only when named in --configs
TAIL_CEILING = 1.5  # the tail controller's ceiling, times the setting's budget (its floor)
# Per task: the env, whether the prompt may be compressed, the KV settings (and --quick's), the sizes the run
# options default to, and where the runs and records go. Options given on the command line win.
TASKS = {
    "long_chain": dict(env="envs/long_chain.py", compress_prompt=True, settings=("loose=128", "tight=96"),
                       quick_settings=("loose=40", "tight=24"), configs=list(CONFIGS), links=12, max_new_tokens=120, steps=8,
                       prompts_per_step=4, n=8, lr=3e-5, sft_steps=4, eval_prompts=128, precision="bfloat16",
                       out="outputs/sparse_gain", record="docs/replications/sparse_gain"),
    "cycle_walk": dict(env="envs/cycle_walk.py", compress_prompt=False, settings=("b80=80",),
                       quick_settings=("loose=40",), configs=["dense", "naive_sparse", "sparse_rl", "tail", "rescue_group"],
                       links=6, max_new_tokens=340, steps=6,
                       prompts_per_step=4, n=8, lr=3e-5, sft_steps=6, eval_prompts=128, precision="float32",
                       # 13k-token updates of a 135M model fit in memory: recomputing activations would cost ~25%
                       grpo_overrides=("model.activation_checkpointing=false",),
                       out="outputs/sparse_regime", record="docs/replications/sparse_regime"),
}
SETTINGS = TASKS["long_chain"]["settings"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="working folder: data, warm-start, runs, evaluations, plots, summary (default per --task: "
                    "outputs/sparse_gain or outputs/sparse_regime, with _quick added under --quick)")
    ap.add_argument("--record", default=None, help="folder of the per-run records (default per --task: docs/replications/sparse_gain or sparse_regime; "
                    "with --quick OUT/records)")
    ap.add_argument("--settings", nargs="+", default=None, metavar="NAME[=BUDGET]",
                    help=f"KV settings to run, NAME=BUDGET, or a name of the defaults {' '.join(SETTINGS)}")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="trainer.seed of each repetition (default 0 1 2)")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS + EXTRA_CONFIGS, default=None,
                    help="configurations to run (default: the five above, with rescue_group for rescue under --task "
                         "cycle_walk; tail_p01 = tail on the 1st percentile of xi, "
                         "rescue_group = rescue re-rolling a group whole once half of it is rejected)")
    ap.add_argument("--quick", action="store_true", help="smoke sizes: 3-link chains, 2 steps, tiny batches, one seed")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.path of the warm-start")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the data files and of the warm-start")
    ap.add_argument("--task", choices=tuple(TASKS), default="long_chain",
                    help="long_chain: the compressed-prompt setting above; cycle_walk: a short prompt kept whole and a "
                         "response several times the budget (see 'The regime task')")
    ap.add_argument("--links", type=int, default=None, help="links per task (default per --task)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default per --task)")
    ap.add_argument("--prompts-per-step", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="rollout.n")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--divide-length", type=int, default=16)
    ap.add_argument("--precision", default=None, help="model.compute_dtype and rollout.dtype of the GRPO runs (default per --task), "
                    "pinned so that records made on different CPUs agree (auto would pick by CPU)")
    add_kv_scoring_args(ap)
    ap.set_defaults(kv_variant="reference", kv_share="layer")  # what the presets select
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=None)
    ap.add_argument("--eval-n", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes")
    ap.add_argument("--eval-as-sampled", action="store_true",
                    help="evaluate each sparse run's policy with its own run's compression (rollout.kv.* of its "
                         "config.yaml) instead of dense; the records of docs/replications/sparse_regime/as_sampled")
    ap.add_argument("--keep-policies", action="store_true", help="keep each run's final policy and checkpoints")
    ap.add_argument("--report-only", action="store_true", help="run nothing: tables and plots from the records")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for the GRPO runs")
    add_jobs_arg(ap)
    args = ap.parse_args(argv)
    task = TASKS[args.task]
    for key in ("configs", "links", "steps", "prompts_per_step", "n", "max_new_tokens", "lr", "sft_steps", "eval_prompts", "precision"):
        if getattr(args, key) is None:
            setattr(args, key, task[key])
    args.env, args.compress_prompt, args.keep_checkpoints = task["env"], task["compress_prompt"], args.keep_policies
    args.override = [*task.get("grpo_overrides", ()), *args.override]
    if args.quick:
        args.links, args.steps, args.prompts_per_step, args.n, args.max_new_tokens = 3, 2, 2, 2, 24
        args.sft_steps, args.sft_batch, args.divide_length = 1, 2, 8
        args.eval_prompts = min(args.eval_prompts, 2)
        args.seeds = args.seeds or [0]
    defaults = list(task["quick_settings"] if args.quick else task["settings"])
    args.seeds = args.seeds or [0, 1, 2]
    args.settings = parse_settings(ap, args.settings or defaults, defaults)
    # Dense ignores the KV keys; its command carries the first default setting's, whichever settings run, so that
    # its record serves every setting.
    args.dense_budget = next(iter(parse_settings(ap, defaults[:1], defaults).values()))
    args.seed = args.data_seed  # what the shared helpers read for the warm-start and the evaluation seed
    args.out = args.out or task["out"] + ("_quick" if args.quick else "")
    args.record = args.record or (str(Path(args.out) / "records") if args.quick else task["record"])
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds must be distinct, got {args.seeds}")
    return args


def parse_settings(ap: argparse.ArgumentParser, items: list[str], defaults: list[str]) -> dict[str, int]:
    known = dict(s.split("=") for s in defaults)
    out = {}
    for item in items:
        name, _, budget = item.partition("=")
        budget = budget or known.get(name)
        if not name.isidentifier() or budget is None or not budget.isdigit() or int(budget) <= 8:
            ap.error(f"--settings: {item!r} is not NAME=BUDGET with a budget above the R-KV window (8), "
                     f"nor one of {' '.join(defaults)}")
        out[name] = int(budget)
    return out


# ----------------------------------------------------------------------------- the runs


def with_(args, **kw) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **kw})


def config_overrides(config: str, budget: int) -> tuple[str, tuple[str, ...]]:
    """(preset, extra overrides) of a configuration at a KV setting's budget."""
    if config in ("dense", "naive_sparse"):
        return config, MEASURE
    if config == "sparse_rl":
        return "sparse_rl", ()
    if config in ("tail", "tail_p01"):
        ceiling = int(math.ceil(budget * TAIL_CEILING / 8) * 8)
        quantile = ("rollout.kv.control.statistic=xi_p01",) if config == "tail_p01" else ()
        return "sparse_rl", ("rollout.kv.budget=auto", f"rollout.kv.control.floor={budget}",
                             f"rollout.kv.control.ceiling={ceiling}", *quantile)
    if config == "rescue":
        return "sparse_rl", ("algo.correction.rescue=dense",)
    if config == "rescue_group":
        return "sparse_rl", ("algo.correction.rescue=dense", "algo.correction.rescue_group_frac=0.5")
    raise ValueError(config)


def plan(args, out: Path) -> list[dict]:
    """Every run in the order it is run: the dense seeds (one run per seed serves every setting), then each
    setting's seeds x configurations."""
    runs = []
    if "dense" in args.configs:
        for s in args.seeds:
            runs.append(dict(name=f"dense_seed{s}", setting=None, config="dense", seed=s, budget=args.dense_budget))
    for setting, budget in args.settings.items():
        for s in args.seeds:
            for c in args.configs:
                if c != "dense":
                    runs.append(dict(name=f"{setting}_{c}_seed{s}", setting=setting, config=c, seed=s, budget=budget))
    for r in runs:
        preset, extra = config_overrides(r["config"], r["budget"])
        a = with_(args, seed=r["seed"], budget=r["budget"])
        r["dir"] = out / "runs" / r["name"]
        r["cmd"] = grpo_command(a, preset, out / "sft" / "hf", out / "data" / "prompts.jsonl", r["dir"],
                                extra=(*extra, *precision(args)))
        # `sparserl.eval` samples a run's policy with the run's own rollout.kv.* unless the command line sets them: a
        # sparse run's policy is evaluated dense only when told so (its dense runs and the warm-start's are dense)
        force_dense = r["config"] != "dense" and not args.eval_as_sampled
        r["eval_cmd"] = evaluation(args, r["dir"] / "hf", out, r["name"], None, force_dense=force_dense)
    return runs


def precision(args) -> tuple[str, ...]:
    return (f"model.compute_dtype={args.precision}", f"rollout.dtype={args.precision}") if args.precision else ()


def warm_start_evals(args, out: Path) -> dict[str, list[str]]:
    """Evaluation commands of the warm-start, by name (= folder under OUT/eval): dense, and under each setting's
    compression."""
    cmds = {"warm-start": evaluation(args, out / "sft" / "hf", out, "warm-start", None)}
    for setting, budget in args.settings.items():
        cmds[f"warm-start_{setting}"] = evaluation(args, out / "sft" / "hf", out, f"warm-start_{setting}", budget)
    return cmds


def evaluation(args, model: Path, out: Path, name: str, budget: int | None, force_dense: bool = False) -> list[str]:
    """The held-out evaluation of `model` into OUT/eval/<name>: dense, or with R-KV at `budget`; the runs' precision.
    `force_dense`: `rollout.kv.algorithm=none` on the command line, so a sparse run's policy is evaluated dense
    rather than with the compression its run's config.yaml names."""
    a = args if budget is None else with_(args, budget=budget)
    return [*eval_command(a, model, out / "data" / "held_out.jsonl", out / "eval" / name, budget is not None),
            *precision(args), *(["rollout.kv.algorithm=none"] if force_dense else [])]


def portable(cmd: list[str], out: Path) -> str:
    """The command as recorded: the interpreter and the working folder replaced, so records match across checkouts."""
    return shlex.join(["python", *cmd[1:]]).replace(str(out), "OUT")


def scores(folder: Path, args) -> dict:
    """Per-prompt held-out scores (in file order), response length and KV retained of one evaluation folder."""
    name = eval_set_name(args)
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["dataset"] == name]
    summary = json.loads((folder / "eval.json").read_text())["datasets"][name]
    return {"scores": [r["score"] for r in rows], "len": sum(r["tokens"] for r in rows) / len(rows),
            "kv": summary["kv_retained_frac"]}


def load_record(path: Path, cmd: str, eval_cmd: str) -> dict | None:
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    return rec if rec.get("cmd") == cmd and rec.get("eval_cmd") == eval_cmd else None


def ensure_warm_start(args, out: Path, records: Path) -> None:
    """Build the warm-start if it is not there, evaluate it, and check it against the recorded one."""
    sft_dir = out / "sft"
    if not (sft_dir / "hf" / "config.json").exists():
        run(sft_command(args, sft_dir, out / "data" / "sft.jsonl"), out / "sft.log")
    evals = warm_start_evals(args, out)
    run_all([lambda name=name, cmd=cmd: run(cmd, out / "eval" / f"{name}.log") for name, cmd in evals.items()
             if not (out / "eval" / name / "samples.jsonl").exists()], args.jobs)
    for name, cmd in evals.items():
        folder = out / "eval" / name
        rec = {"cmd": portable(cmd, out), "eval": scores(folder, args), "machine": machine()}
        path = records / f"{name}.json"
        old = json.loads(path.read_text()) if path.exists() else None
        if old and old["cmd"] == rec["cmd"] and old["eval"]["scores"] != rec["eval"]["scores"]:
            sys.exit(f"{path}: this warm-start's held-out scores differ from the recorded ones (recorded on "
                     f"{old['machine']}; this is {rec['machine']}); move the records aside to start a new experiment")
        if not old or old["cmd"] != rec["cmd"]:
            path.write_text(json.dumps(rec, indent=1) + "\n")


def run_one(args, r: dict, out: Path, records: Path) -> dict:
    took = run_grpo(r["cmd"], r["dir"], args.steps, out / "runs" / f"{r['name']}.cmd", out / "runs" / f"{r['name']}.log",
                    args.keep_checkpoints)
    metrics = read_metrics(r["dir"])
    if len(metrics) < args.steps:
        sys.exit(f"{r['dir']}: {len(metrics)} of {args.steps} steps logged")
    run(r["eval_cmd"], out / "eval" / f"{r['name']}.log")
    rec = {"cmd": portable(r["cmd"], out), "eval_cmd": portable(r["eval_cmd"], out), "setting": r["setting"],
           "config": r["config"], "seed": r["seed"], "budget": r["budget"],
           "wall_s": took if took is not None else sum(m.get("perf/step_s", 0.0) for m in metrics),
           "metrics": [{k: m[k] for k in ("step", *KEPT) if k in m} for m in metrics],
           "eval": scores(out / "eval" / r["name"], args), "machine": machine()}
    (records / f"{r['name']}.json").write_text(json.dumps(rec, indent=1) + "\n")
    if not args.keep_policies:
        shutil.rmtree(r["dir"] / "hf", ignore_errors=True)
    return rec


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    out, records = Path(args.out).resolve(), Path(args.record)
    if not records.is_absolute():
        records = (ROOT / records).resolve()
    runs = plan(args, out)
    print(f"machine: {machine()}", flush=True)
    if args.dry_run:
        print(shlex.join(sft_command(args, out / "sft", out / "data" / "sft.jsonl")))
        for cmd in warm_start_evals(args, out).values():
            print(shlex.join(cmd))
        for r in runs:
            print(shlex.join(r["cmd"]))
        return
    records.mkdir(parents=True, exist_ok=True)
    t0, done_now = time.perf_counter(), 0
    if not args.report_only:
        write_data(args, out / "data")
        ensure_warm_start(args, out, records)
        todo = []
        for i, r in enumerate(runs):
            if load_record(records / f"{r['name']}.json", portable(r["cmd"], out), portable(r["eval_cmd"], out)):
                print(f"[{i + 1}/{len(runs)}] {r['name']}: recorded, not rerun", flush=True)
            else:
                todo.append((i, r))

        def start(i: int, r: dict) -> bool:
            minutes = (time.perf_counter() - t0) / 60
            if args.max_minutes is not None and minutes >= args.max_minutes:
                return False
            print(f"\n[{i + 1}/{len(runs)}] {r['name']} ({minutes:.1f} min so far)", flush=True)
            run_one(args, r, out, records)
            return True

        done_now = sum(run_all([lambda i=i, r=r: start(i, r) for i, r in todo], args.jobs))
        if done_now < len(todo):
            print(f"\n--max-minutes {args.max_minutes}: stopping after {(time.perf_counter() - t0) / 60:.1f} min; "
                  f"{len(todo) - done_now} runs left")
    out.mkdir(parents=True, exist_ok=True)
    text = report(args, out, records, EXTRA_CONFIGS)
    print("\n" + text)
    wall = (time.perf_counter() - t0) / 60
    (out / "summary.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(f"{text}\n\nmachine: {machine()}\nthis invocation: {done_now} runs, {wall:.1f} min\n")
    print(f"\nsummary: {out / 'summary.md'} ({done_now} runs in {wall:.1f} min)")


if __name__ == "__main__":
    main()
