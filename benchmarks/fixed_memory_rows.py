"""The configurations of `benchmarks/fixed_memory.py`: its rows, the GRPO overrides each runs, the KV memory they
share, and the table's cells and goals (the script's docstring has the columns)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"

@dataclass(frozen=True)
class Row:
    """One configuration of the table: a replicate_gain configuration (dense | tail) and what this table changes."""

    name: str
    label: str
    config: str  # replicate_gain's: "dense" (+preset=dense, correction measured) or "tail" (R-KV under the controller)
    admission: str = "optimistic"
    engine: str = "native"
    kv_dtype: str | None = None


ROWS = (
    Row("dense_reserve", "dense, reservation", "dense", admission="reserve"),
    Row("dense_optimistic", "dense, optimistic", "dense"),
    Row("sglang_dense", "SGLang dense", "dense", engine="sglang"),
    Row("rkv_tail", "R-KV tail", "tail"),
    Row("int8", "int8 KV", "dense", kv_dtype="int8"),
    Row("rkv_int8", "R-KV tail + int8 KV", "tail", kv_dtype="int8"),
)
BY_NAME = {r.name: r for r in ROWS}
REFERENCE = "dense_optimistic"  # the "vs" columns' denominator
HEADERS = ["config", "tok/s", "vs dense opt", "running mean / peak", "retractions (recomputed tok)", "peak KV MB",
           "reward", "mean len", "step s (rollout s)", "step vs dense opt", "xi p05", "rejected"]


# ----------------------------------------------------------------------------- the task and its commands


def task_args(args, out: Path):
    """replicate_gain's parsed arguments for its cycle_walk task at this table's sizes: the warm-start command,
    the data files and the GRPO command lines come from there."""
    from benchmarks import replicate_gain

    argv = ["--task", "cycle_walk", "--out", str(out), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
            "--steps", str(args.train_steps), "--prompts-per-step", str(args.train_prompts)]
    if args.quick:
        argv.append("--quick")
    t = replicate_gain.parse_args(argv)
    if args.quick:  # replicate_gain's quick sizes, with this table's batch and length
        t.n, t.max_new_tokens, t.steps, t.prompts_per_step = args.n, args.max_new_tokens, args.train_steps, args.train_prompts
    t.seed = args.seed
    t.budget = budget(t)  # the KV keys every command carries (the dense preset ignores them)
    return t


def budget(t) -> int:
    """The tail controller's floor: the cycle_walk setting's budget (80; --quick: 40)."""
    return next(iter(t.settings.values()))


def row_overrides(row: Row, t, model: str, data: Path, run_dir: Path, memory: str) -> list[str]:
    """The GRPO run's overrides of `row` (the rollout half loads the same config)."""
    from benchmarks.replicate_gain import config_overrides, precision
    from benchmarks.replicate_sparse_rl import grpo_command

    preset, extra = config_overrides(row.config, budget(t))
    mine = [f"rollout.kv_memory={memory}", f"rollout.admission={row.admission}", "trainer.overwrite=true",
            "logger.progress=false"]
    if row.engine != "native":
        mine.append(f"rollout.engine={row.engine}")
    if row.kv_dtype is not None:
        mine.append(f"rollout.kv_dtype={row.kv_dtype}")
    cmd = grpo_command(t, preset, Path(model), data, run_dir, extra=(*extra, *precision(t), *mine))
    return cmd[cmd.index("sparserl.trainer.grpo") + 1:]


def kv_dtype_missing() -> str | None:
    """Why the int8 rows cannot run yet (None once `rollout.kv_dtype` is a config key)."""
    from sparserl.config.schema import RolloutConfig

    if "kv_dtype" in {f.name for f in dataclasses.fields(RolloutConfig)}:
        return None
    return "not available: rollout.kv_dtype is not a config key yet"


def unavailable(row: Row, args) -> str | None:
    if row.kv_dtype is not None:
        missing = kv_dtype_missing()
        if missing:
            return missing
    if row.engine == "sglang":
        if args.gpu:
            return "not run by --gpu (its own engine; docs/sglang.md)"
        if args.quick:
            return "not run under --quick (an SGLang start takes 30-60 s on two cores)"
        if not SGLANG_PYTHON.exists():
            return "not available: no .venv-sglang (bash scripts/install_sglang_cpu.sh)"
    return None


def memory_for(cfg, model: str, longest_prompt: int, dense_seqs: int) -> str:
    """`rollout.kv_memory` holding `dense_seqs` dense sequences of the longest prompt + max_new_tokens, in KB."""
    from sparserl.engine_options.sizing import SequenceSize, model_entry_bytes

    entries = SequenceSize(longest_prompt, cfg.rollout.max_new_tokens).dense_entries()
    return f"{math.ceil(dense_seqs * entries * model_entry_bytes(cfg, model) / 2**10)}KB"


def load_row_config(overrides: list[str]):
    from sparserl.config.load import load_config

    return load_config(overrides, "grpo")


# ----------------------------------------------------------------------------- the table


def cells(row: Row, res: dict, ref: dict | None) -> list:
    def num(key, fmt="{:.3f}"):
        v = res.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    if "error" in res:
        return [row.label, res["error"]] + ["-"] * (len(HEADERS) - 2)
    native = row.engine == "native"
    tok = res["tok_s"]
    ratio = f"{tok / ref['tok_s']:.2f}x" if ref and ref.get("tok_s") else "-"
    running = f"{res['mean_running']:.1f} / {res['peak_running']}" if native else "- / -"
    retract = f"{res['retractions']} ({res['recomputed']})" if native else "-"
    peak = f"{res['peak_kv_bytes'] / 2**20:.{1 if res['peak_kv_bytes'] >= 2**20 else 3}f}" if res.get("peak_kv_bytes") else "-"
    step = (f"{res['step_s']:.1f} ({res['rollout_s']:.1f})" if res.get("step_s") is not None
            and res.get("rollout_s") is not None else "-")
    step_vs = (f"{ref['step_s'] / res['step_s']:.2f}x" if ref and ref.get("step_s") and res.get("step_s") else "-")
    label = row.label + (f" ({res['range']}, rollout at {res['budget']})" if res.get("range") else
                         f" (b={res['budget']})" if res.get("budget") else "")
    return [label, f"{tok:.1f}", ratio, running, retract, peak, num("reward"), num("mean_len", "{:.0f}"), step, step_vs,
            num("xi_p05", "{:.4f}"), num("rejected", "{:.1%}")]


def bitwise_line(name: str, full: dict, small: dict, n_prompts: int, n: int, pools: tuple[int, int]) -> str:
    a, b = full["tokens"][: n_prompts * n], small["tokens"]
    same = sum(x == y for x, y in zip(a, b))
    diffs = [max((abs(p - q) for p, q in zip(x, y)), default=0.0)
             for x, y, ta, tb in zip(full["logps"], small["logps"], a, b) if ta == tb]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    where = "" if first is None else (f"; first differing: prompt {first // n} sample {first % n}, at token "
                                      f"{next((k for k, (p, q) in enumerate(zip(a[first], b[first])) if p != q), min(len(a[first]), len(b[first])))}")
    return (f"keyed draw across pool sizes, {name}: {same}/{len(b)} sequences with the same token ids "
            f"({n_prompts} prompts x {n}, pool of {pools[0]} vs {pools[1]} entries, {full['peak_running']} vs "
            f"{small['peak_running']} running at most); largest log-prob difference among them "
            f"{max(diffs, default=0.0):.2e}{where}")


def goals(results: dict[str, dict]) -> list[str]:
    """Which of the table's goals the measured rows meet (a goal whose rows are missing says so)."""
    def get(name, key):
        r = results.get(name) or {}
        return r.get(key) if "error" not in r else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    lines = []
    tput = ratio(get("rkv_tail", "tok_s"), get(REFERENCE, "tok_s"))
    step = ratio(get(REFERENCE, "step_s"), get("rkv_tail", "step_s"))
    seqs = ratio(get("rkv_int8", "mean_running"), get("rkv_tail", "mean_running"))
    opt = ratio(get(REFERENCE, "tok_s"), get("dense_reserve", "tok_s"))
    sgl = ratio(get(REFERENCE, "tok_s"), get("sglang_dense", "tok_s"))

    def say(text, value, target, fmt="{:.2f}x"):
        verdict = "not measured" if value is None else ("met" if value >= target else "not met")
        lines.append(f"- {text}: {'-' if value is None else fmt.format(value)} ({verdict}; goal >= {fmt.format(target)})")

    say("R-KV tail vs dense optimistic, rollout throughput", tput, 2.5)
    say("R-KV tail vs dense optimistic, step time (dense / R-KV)", step, 1.3)
    say("R-KV + int8 vs R-KV alone, sequences running (mean)", seqs, 1.6)
    say("dense optimistic vs dense reservation, rollout throughput", opt, 1.0)
    say("dense optimistic vs SGLang dense, rollout throughput", sgl, 0.9)
    rej = get("rkv_int8", "rejected")
    if rej is not None:
        lines.append(f"- R-KV + int8: the correction rejects {rej:.1%} of its sampled sequences "
                     f"(R-KV alone: {get('rkv_tail', 'rejected') or 0:.1%})")
    return lines
