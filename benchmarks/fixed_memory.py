"""At one fixed KV memory: how many sequences each rollout configuration runs, how fast, and what a training step
costs. Dense with worst-case reservation, dense optimistic (admission on the current need, retraction when the pool
runs out), SGLang dense (its own scheduler), R-KV under the tail controller, int8 KV alone, R-KV + int8 KV.

    python benchmarks/fixed_memory.py                        # the table: rollout half + a 3-step training run per row
    python benchmarks/fixed_memory.py --no-train             # the rollout half only
    python benchmarks/fixed_memory.py --prompts 8 --train-prompts 2   # smaller halves (what fits a shared CPU)
    python benchmarks/fixed_memory.py --quick                # CI smoke run: a tiny random model, tiny sizes (~1 min)
    python benchmarks/fixed_memory.py --gpu                  # the rollout half at a Qwen2.5-1.5B shape on CUDA
    python benchmarks/fixed_memory.py --gain [--dry-run]     # held-out gain: dense optimistic vs R-KV tail, 3 seeds

The task is envs/cycle_walk.py with the warm-start and settings of `benchmarks/replicate_gain.py --task cycle_walk`
(a 6-step supervised warm-start of SmolLM2-135M-Instruct, built once into OUT/sft/hf with that script's command;
78-token prompts, 340 new tokens, fp32; R-KV `variant=reference share=layer`, divide_length 16, compress_prompt off,
`rollout.kv.budget=auto` between 80 and 120). Every row gets the same `rollout.kv_memory`: the bytes of
`--dense-seqs` (8) dense sequences of the longest prompt + max_new_tokens in the rollout dtype, so an int8 pool holds
more entries in the same bytes and a compressed sequence needs fewer of them.

Rollout half (in this process, through the trainer's own config and engine-building code): `--prompts` (32) prompts
of the task's data file x `--n` (8) samples, temperature 1, one seed; one short warm-up generate first, not timed.
Columns: new tokens per second of the timed generate; sequences running per forward step, mean and peak
(`EngineStats.mean_running`, `peak_running`); retractions and the tokens they recomputed; the pool's high-water mark
in MB (peak KV bytes); the env's reward of the samples and their mean length. R-KV rows run at the controller's
first budget (its ceiling, 120): the KV-heaviest end of its range.

Training half (`python -m sparserl.trainer.grpo`, one run per row, `--train-steps` 3 steps of `--train-prompts` (32)
prompts x `--n` from the warm-start, the same KV memory): mean seconds per step (`perf/step_s`) and its rollout part,
the sampler's mismatch tail (`sampler/xi_p05`, every sampled token scored densely, before any filter; the dense rows
log it too, `algo.correction.mode=measure`), the share of sequences the correction rejects
(`sampler/rejected_seq_frac`) and the controller's budget after the last step. The "vs" columns divide by the dense
optimistic row (throughput: row / dense; step time: dense / row, so > 1 is faster).

After the rows, the keyed draw is checked: the first `--bitwise-prompts` (8) prompts are rolled out again, alone and
in a pool twice the size, for dense optimistic and for R-KV; a sample's draw is keyed by (seed, prompt index, sample
index, logical position), so its tokens should not depend on how many sequences share the pool. The line says how
many sequences came out with the same token ids, and the largest log-prob difference.

The SGLang row runs where `.venv-sglang` exists (`bash scripts/install_sglang_cpu.sh`): this script re-runs itself
there for that row (`--only sglang_dense`); otherwise, and under `--quick` (an SGLang start alone takes 30-60 s on
two cores), the row says why it did not run. The int8 rows run once `rollout.kv_dtype` is a config key; until then
they say so.

`--gpu`: the rollout half only, on CUDA, at a Qwen2.5-1.5B shape (random weights built from its config in bf16, no
download), captured decode on (`rollout.cuda_graphs=on`), prompts of random token ids as long as the task's (78),
`--prompts` 16 x 8 samples; the mismatch tail is measured in place of the training half (the sampled tokens scored
densely by the same weights, xi = p_dense / p_sampler, its 5th percentile). A random model does not end early, so every
sequence runs to max_new_tokens there: dense optimistic gains nothing over reservation but exercises retraction.

`--gain`: the held-out half, through `benchmarks/replicate_gain.py --task cycle_walk` (its warm-start, runs, records and
dense evaluation) with this script's KV memory added to every run: dense (optimistic admission, the default) and
the tail-controlled R-KV configuration (`--gain-int8`: with int8 KV), 6 steps, seeds 0 1 2, evaluated dense with
`--eval-n` 4 samples per held-out prompt; records in OUT/gain_records.

Left out on purpose: the pool sizes of a multi-GPU run (one engine here) and prefix caching (the native engine has
none; SGLang's radix cache is on, as SGLang runs by default).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmarks.common import machine, print_table  # noqa: E402
from benchmarks.fixed_memory_rollout import Prompts, random_model, rollout_half, task_prompts, tiny_model  # noqa: E402
from benchmarks.fixed_memory_rows import (  # noqa: E402, F401 (kv_dtype_missing, bitwise_line: the tests read them here)
    BY_NAME, HEADERS, REFERENCE, ROWS, SGLANG_PYTHON, Row, bitwise_line, cells, goals, kv_dtype_missing, load_row_config,
    memory_for, row_overrides, task_args, unavailable,
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="working folder (default outputs/fixed_memory, _quick / _gpu added)")
    ap.add_argument("--model", default=None, help="the policy (default: the cycle_walk warm-start, built into OUT/sft/hf "
                                                  "if missing; --quick: a tiny random Llama built from a config)")
    ap.add_argument("--rows", nargs="+", choices=tuple(BY_NAME), default=None, help="rows to run (default: all)")
    ap.add_argument("--prompts", type=int, default=None, help="rollout half: prompts (default 32; --gpu 16)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=340)
    ap.add_argument("--dense-seqs", type=int, default=8, help="the KV memory: this many dense sequences' bytes")
    ap.add_argument("--train-prompts", type=int, default=32, help="training half: trainer.prompts_per_step")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--no-train", action="store_true", help="the rollout half only")
    ap.add_argument("--bitwise-prompts", type=int, default=8, help="prompts of the keyed-draw check (0: skip it)")
    ap.add_argument("--seed", type=int, default=0, help="the rollouts' and the training runs' seed")
    ap.add_argument("--quick", action="store_true", help="CI smoke sizes: a tiny random model, 4 prompts x 4, 24 tokens")
    ap.add_argument("--gpu", action="store_true", help="the rollout half on CUDA at a Qwen2.5-1.5B shape, captured decode")
    ap.add_argument("--device", default=None, help="--gpu's device (default cuda; cpu runs the same code slowly)")
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=("qwen2.5-1.5b", "tiny"), help="--gpu's model shape")
    ap.add_argument("--gain", action="store_true", help="the held-out half instead of the table (see above)")
    ap.add_argument("--gain-int8", action="store_true", help="--gain: the sparse runs with int8 KV as well")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--gain: seeds")
    ap.add_argument("--eval-n", type=int, default=4, help="--gain: samples per held-out prompt")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    ap.add_argument("--only", choices=tuple(BY_NAME), default=None, help=argparse.SUPPRESS)  # one row's rollout, as JSON
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.max_new_tokens, args.dense_seqs = args.prompts or 4, 4, 24, 4
        args.train_prompts, args.bitwise_prompts = 2, min(args.bitwise_prompts, 2)
    if args.gpu:
        args.no_train = True
    args.prompts = args.prompts or (16 if args.gpu else 32)
    args.out = args.out or "outputs/fixed_memory" + ("_quick" if args.quick else "_gpu" if args.gpu else "")
    return args


# ----------------------------------------------------------------------------- the training half


def train_half(row: Row, overrides: list[str], run_dir: Path, log: Path, steps: int) -> dict:
    """One GRPO run of `row` (`python -m sparserl.trainer.grpo`, SGLang's in .venv-sglang); its per-step numbers."""
    from benchmarks.replicate_sparse_rl import read_metrics

    python = str(SGLANG_PYTHON) if row.engine == "sglang" else sys.executable
    cmd = [python, "-m", "sparserl.trainer.grpo", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "SPARSERL_PROGRESS": "0"}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    metrics = read_metrics(run_dir)
    if code != 0 or len(metrics) < steps:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{row.name}: the training run failed (exit {code}, {len(metrics)} of {steps} steps); "
                           f"{log}:\n" + "\n".join(tail))

    def mean(key):
        values = [m[key] for m in metrics if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
        return sum(values) / len(values) if values else None

    return {"step_s": mean("perf/step_s"), "rollout_s": mean("perf/rollout_s"), "xi_p05": mean("sampler/xi_p05"),
            "rejected": mean("sampler/rejected_seq_frac"), "train_retractions": mean("kv/retractions"),
            "budgets": [m.get("kv/budget") for m in metrics], "train_wall_s": time.perf_counter() - t0,
            "cmd": shlex.join(["python", *cmd[1:]])}


def ensure_warm_start(t, out: Path) -> str:
    """The cycle_walk warm-start (replicate_gain's command), built into OUT/sft/hf when missing."""
    from benchmarks.replicate_sparse_rl import run, sft_command

    hf = out / "sft" / "hf"
    if not (hf / "config.json").exists():
        print("building the cycle_walk warm-start (benchmarks/replicate_gain.py --task cycle_walk's command)", flush=True)
        run(sft_command(t, out / "sft", out / "data" / "sft.jsonl"), out / "sft.log")
    return str(hf)


# ----------------------------------------------------------------------------- main


def one_row(args) -> None:
    """`--only ROW --json PATH`: one row's rollout half, written as JSON (how the SGLang row runs in its venv)."""
    row, out = BY_NAME[args.only], Path(args.out).resolve()
    t = task_args(args, out)
    model = args.model
    cfg = load_row_config(row_overrides(row, t, model, out / "data" / "prompts.jsonl", out / "runs" / row.name, args.memory))
    from sparserl.actor.hf import load_tokenizer
    from sparserl.utils.envload import load_env

    tok = load_tokenizer(model)
    prompts, longest = task_prompts(cfg, tok, out / "data" / "prompts.jsonl", args.prompts)
    res = rollout_half(row, cfg, model, tok, prompts, longest, "cpu", load_env(str(ROOT / t.env)).module)
    Path(args.json).write_text(json.dumps({k: v for k, v in res.items() if k not in ("tokens", "logps")}))


def sglang_rollout(args, model: str, memory: str, out: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.json"
        cmd = [str(SGLANG_PYTHON), str(Path(__file__).resolve()), "--only", "sglang_dense", "--json", str(path),
               "--memory", memory, "--model", model, "--out", str(out), "--prompts", str(args.prompts), "--n", str(args.n),
               "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
        log = out / "logs" / "sglang_dense_rollout.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise RuntimeError(f"the SGLang rollout failed (exit {code}); its output: {log}")
        return json.loads(path.read_text())


def run_gain(args, out: Path, model_memory: str) -> None:
    """The held-out half through replicate_gain (its warm-start, runs, records, dense evaluation)."""
    from benchmarks import replicate_gain

    records = out / "gain_records"
    base = ["--task", "cycle_walk", "--out", str(out), "--record", str(records), "--eval-n", str(args.eval_n),
            "--seeds", *map(str, args.seeds), *(["--quick"] if args.quick else []), *(["--dry-run"] if args.dry_run else [])]
    memory = [f"rollout.kv_memory={model_memory}"]
    replicate_gain.main([*base, "--configs", "dense", "--override", *memory])
    replicate_gain.main([*base, "--configs", "tail", "--override", *memory,
                         *(["rollout.kv_dtype=int8"] if args.gain_int8 else [])])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.only:
        return one_row(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    print(f"machine: {machine()}", flush=True)
    if args.gpu:
        return gpu_main(args, out, t0)
    from benchmarks.replicate_long import write_data

    t = task_args(args, out)
    data = write_data(t, out / "data")
    model = args.model or (tiny_model(out / "tiny") if args.quick else ensure_warm_start(t, out))
    from sparserl.actor.hf import load_tokenizer
    from sparserl.utils.envload import load_env

    reference_cfg = load_row_config(row_overrides(BY_NAME[REFERENCE], t, model, data["prompts"], out / "runs" / "x", "0"))
    tok = load_tokenizer(model)
    prompts, longest = task_prompts(reference_cfg, tok, data["prompts"], args.prompts)
    memory = memory_for(reference_cfg, model, longest, args.dense_seqs)
    if args.gain:
        return run_gain(args, out, memory)
    env = load_env(str(ROOT / t.env)).module
    rows = [BY_NAME[n] for n in args.rows] if args.rows else list(ROWS)
    print(f"task: {t.env}, {args.prompts} prompts x {args.n} samples (rollout half), {args.max_new_tokens} new tokens, "
          f"longest prompt {longest}; model {model}; rollout.kv_memory={memory} (= {args.dense_seqs} dense sequences); "
          + ("no training half" if args.no_train else
             f"training half: {args.train_steps} steps of {args.train_prompts} prompts x {args.n}"), flush=True)
    if args.dry_run:
        for row in rows:
            print(shlex.join(["python", "-m", "sparserl.trainer.grpo",
                              *row_overrides(row, t, model, data["prompts"], out / "runs" / row.name, memory)]))
        return
    print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS), flush=True)
    results: dict[str, dict] = {}
    for row in rows:
        results[row.name] = measure(row, args, t, model, tok, prompts, longest, memory, env, data["prompts"], out)
        print("| " + " | ".join(map(str, cells(row, results[row.name], results.get(REFERENCE)))) + " |", flush=True)
    lines = bitwise(args, t, model, tok, prompts, longest, memory, data["prompts"], out, results)
    wall = time.perf_counter() - t0
    print()
    text = print_table(HEADERS, [cells(r, results[r.name], results.get(REFERENCE)) for r in rows],
                       title=f"cycle_walk at rollout.kv_memory={memory} ({args.dense_seqs} dense sequences)")
    summary = [*lines, *goals(results),
               f"machine: {machine()}; wall {wall / 60:.1f} min, this process's CPU time {(time.process_time() - cpu0) / 60:.1f} min "
               f"(training runs in their own processes)"]
    print("\n".join(summary), flush=True)
    (out / "table.md").write_text(text + "\n\n" + "\n".join(summary) + "\n")
    (out / "results.json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk not in ("tokens", "logps")} for k, v in results.items()}, indent=1))


def measure(row: Row, args, t, model: str, tok, prompts: Prompts, longest: int, memory: str, env, data: Path,
            out: Path) -> dict:
    """One row: its rollout half, then its training half; a row that cannot run says why in its first cell."""
    why = unavailable(row, args)
    if why:
        return {"error": why}
    overrides = row_overrides(row, t, model, data, out / "runs" / row.name, memory)
    cfg = load_row_config(overrides)
    if row.engine == "sglang":
        res = sglang_rollout(args, model, memory, out)
    else:
        res = rollout_half(row, cfg, model, tok, prompts, longest, "cpu", env, with_xi=args.no_train)
    if not args.no_train:
        res.update(train_half(row, overrides, out / "runs" / row.name, out / "logs" / f"{row.name}.log",
                              args.train_steps))
    return res


def bitwise(args, t, model, tok, prompts: Prompts, longest: int, memory: str, data: Path, out: Path,
            results: dict, device="cpu", model_obj=None) -> list[str]:
    """The keyed-draw check: the first prompts again, alone, in a pool of twice the memory."""
    k = min(args.bitwise_prompts, len(prompts.ids))
    lines = []
    reserve, optimistic = results.get("dense_reserve"), results.get(REFERENCE)
    if reserve and optimistic and "tokens" in reserve and "tokens" in optimistic:  # one pool, two schedules: free
        same = sum(x == y for x, y in zip(reserve["tokens"], optimistic["tokens"]))
        lines.append(f"keyed draw across schedules, dense reservation vs optimistic (the same pool, {reserve['peak_running']} "
                     f"vs {optimistic['peak_running']} running at most, {optimistic['retractions']} retractions): {same}/"
                     f"{len(reserve['tokens'])} sequences with the same token ids")
        print(lines[-1], flush=True)
    for name in (REFERENCE, "rkv_tail"):
        full = results.get(name)
        if k == 0 or not full or "error" in full:
            continue
        double = f"{2 * int(memory[:-2])}KB"
        cfg = load_row_config(row_overrides(BY_NAME[name], t, model, data, out / "runs" / name, double))
        small = rollout_half(BY_NAME[name], cfg, model, tok, Prompts(prompts.ids[:k], prompts.answers[:k]), longest,
                             device, model=model_obj)
        lines.append(bitwise_line(BY_NAME[name].label, full, small, k, args.n, (full["pool_slots"], small["pool_slots"])))
        print(lines[-1], flush=True)
    return lines


def gpu_main(args, out: Path, t0: float) -> None:
    """--gpu: the rollout half at a Qwen2.5-1.5B shape, random weights, captured decode, the mismatch tail measured."""
    import torch

    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device is visible (--device cpu runs the same code on the CPU, slowly)")
    dtype = "bfloat16"
    t = task_args(argparse.Namespace(**{**vars(args), "quick": False}), out)
    t.precision = dtype
    folder, model = random_model(args.shape, out / f"{args.shape}-config", device, getattr(torch, dtype))
    g = torch.Generator().manual_seed(args.seed)
    prompt_len = 78  # the cycle_walk prompt's length in SmolLM2's tokenizer
    vocab = model.config.vocab_size
    ids = [torch.randint(2, vocab - 1, (prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = Prompts(ids, [None] * len(ids))
    data = out / "data" / "prompts.jsonl"  # the runs' config needs a data file; the prompts above are what runs
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps({"prompt": "x", "answer": "x"}) + "\n")
    extra = ["rollout.cuda_graphs=on"] if device == "cuda" else []
    ref_cfg = load_row_config([*row_overrides(BY_NAME[REFERENCE], t, folder, data, out / "runs" / "x", "0"), *extra])
    memory = memory_for(ref_cfg, folder, prompt_len, args.dense_seqs)
    rows = [BY_NAME[n] for n in args.rows] if args.rows else list(ROWS)
    print(f"--gpu: {args.shape} random weights ({dtype}) on {device}, {args.prompts} prompts x {args.n} of {prompt_len} "
          f"random tokens, {args.max_new_tokens} new tokens; rollout.kv_memory={memory} (= {args.dense_seqs} dense "
          f"sequences); captured decode {'on' if extra else 'off (not CUDA)'}", flush=True)
    print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS), flush=True)
    results = {}
    for row in rows:
        why = unavailable(row, args)
        if why:
            results[row.name] = {"error": why}
        else:
            cfg = load_row_config([*row_overrides(row, t, folder, data, out / "runs" / row.name, memory), *extra])
            results[row.name] = rollout_half(row, cfg, folder, None, prompts, prompt_len, device, model=model, with_xi=True)
        print("| " + " | ".join(map(str, cells(row, results[row.name], results.get(REFERENCE)))) + " |", flush=True)
    ns = argparse.Namespace(**vars(args))
    lines = bitwise(ns, t, folder, None, prompts, prompt_len, memory, data, out, results, device, model)
    print()
    print_table(HEADERS, [cells(r, results[r.name], results.get(REFERENCE)) for r in rows],
                title=f"--gpu {args.shape} at rollout.kv_memory={memory}")
    captures = ", ".join(f"{name} {r['graph_capture_s']:.1f}" for name, r in results.items()
                         if isinstance(r.get("graph_capture_s"), float))
    print("\n".join([*lines, *goals(results), *([f"graph capture s (inside the timed generate): {captures}"] if captures else []),
                     f"machine: {machine()}; wall {(time.perf_counter() - t0) / 60:.1f} min"]))


if __name__ == "__main__":
    main()
