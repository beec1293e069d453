"""Tool-use rollouts of a model on the local OpenReward envs: does it call tools, and what do they cost?

    python benchmarks/tool_use_rollout.py                      # SmolLM2-135M-Instruct, calculator + guessing game
    python benchmarks/tool_use_rollout.py --model /ckpt/Qwen2.5-1.5B-Instruct --prompts 16 --n 8 --new-tokens 256

Serves `envs/tool_use.py` on 127.0.0.1 (in a thread), takes the first `--prompts` train tasks of each env and rolls
them out with the real worker and the native engine (temperature 1, `--n` samples each, up to `--turns` turns).
Prints one row per env: samples, statuses, turns, tool calls / malformed calls / refused calls per sample, mean
reward, share of samples that called a tool at all, and the rollout's wall time and new tokens per second. The
first response of each env is printed too (`--show 0` to skip).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine, print_table  # noqa: E402
from sparserl.actor.hf import load_model, load_tokenizer, resolve_model_path  # noqa: E402
from sparserl.data.dataset import PromptRow  # noqa: E402
from sparserl.engines.native.engine import NativeEngine  # noqa: E402
from sparserl.rollout.openreward.driver import ROW_KEY, OpenRewardEnvs  # noqa: E402
from sparserl.rollout.openreward.serve import ThreadServer, environment_classes  # noqa: E402
from sparserl.rollout.openreward.spec import EnvSpec  # noqa: E402
from sparserl.engines.types import SamplingParams  # noqa: E402
from sparserl.rollout.worker import rollout  # noqa: E402
from sparserl.utils import precision  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=4, help="tasks per env")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--parser", default="hermes")
    ap.add_argument("--show", type=int, default=1, help="responses printed per env")
    args = ap.parse_args()

    dtype = precision.choose_auto(torch.device("cpu")).dtype if args.dtype == "auto" else args.dtype
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    engine = NativeEngine(load_model(path, dtype, torch.device("cpu")), tokenizer, num_slots=65536, seed=0)
    classes = environment_classes("envs/tool_use.py")
    server = ThreadServer(classes)
    try:
        specs = [EnvSpec(f"local/{c.__name__}", max_turns=args.turns) for c in classes]
        envs = OpenRewardEnvs(specs, server.url, tool_parser=args.parser,
                              variants={s.name: s.name.split("/")[1].lower() for s in specs})
        rows = [PromptRow(prompt=f"{s.name} train[{i}]", answer=None, extra={ROW_KEY: {"env": s.name, "split": "train", "index": i}},
                          index=len(specs) * i + k) for k, s in enumerate(specs) for i in range(args.prompts)]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, seed=0)
        t0 = time.perf_counter()
        samples, _ = rollout(engine, tokenizer, envs, rows, [r.prompt for r in rows], params, step_timeout_s=60)
        wall = time.perf_counter() - t0
    finally:
        server.stop()
    table = []
    for spec in specs:
        mine = [s for s in samples if s.extra_info[ROW_KEY]["env"] == spec.name]
        k = len(mine)
        stat = lambda key: sum(s.tool_stats.get(key, 0) for s in mine) / k  # noqa: E731
        status = Counter(s.status for s in mine)
        table.append([spec.name, k, ", ".join(f"{n} {c}" for c, n in sorted(status.items())), f"{sum(s.num_turns for s in mine) / k:.2f}",
                      f"{stat('calls'):.2f}", f"{stat('malformed'):.2f}", f"{stat('errors'):.2f}",
                      f"{sum(s.tool_stats.get('calls', 0) + s.tool_stats.get('malformed', 0) > 0 for s in mine) / k:.2f}",
                      f"{sum(s.reward for s in mine) / k:.3f}"])
        for s in mine[: args.show]:
            print(f"--- {spec.name}, first response ({s.status}, reward {s.reward:g}):\n{tokenizer.decode(s.response_ids)}\n")
    new_tokens = sum(sum(s.loss_mask) for s in samples)
    print_table(["env", "samples", "status", "turns", "calls", "malformed", "refused", "called a tool", "reward"], table,
                      f"{args.model} ({dtype}), {args.prompts} tasks x {args.n} samples per env, {args.new_tokens} new tokens "
                      f"per turn, up to {args.turns} turns: {wall:.1f} s, {new_tokens / wall:.1f} new tok/s; {machine()}")


if __name__ == "__main__":
    main()
