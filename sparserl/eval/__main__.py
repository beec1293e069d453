"""`python -m sparserl.eval key=value ...` (or `torchrun --nproc_per_node=N -m sparserl.eval ...`): evaluate a
model on eval sets with the rollout engine, dense or with `rollout.kv.*` compression.

Reads `configs/eval.yaml` over the same schema as training; a training run's folder (or its `hf/` or a checkpoint;
a folder of runs such as `outputs/grpo` stands for its newest run, the one `outputs/grpo/latest` points to)
is evaluated with the run's length cap and KV settings unless the command line sets them (eval/run_settings.py,
which prints what it took); checks every input (sets, keys, k <= n, model path, KV settings) before anything is
written; shards prompts over the processes; rank 0 writes `eval.output_dir/eval.json` and `samples.jsonl` and
prints the table.
Left out on purpose: serving the model over HTTP, comparing several models in one call (run it per model).
"""
from __future__ import annotations

import sys
from pathlib import Path

from sparserl.cli import parse_cli
from sparserl.config import Config
from sparserl.engines.handle import EngineHandle
from sparserl.eval.datasets import load_eval_sets
from sparserl.eval.model import resolve_eval_model
from sparserl.eval.report import format_table, settings, write_outputs
from sparserl.eval.run import evaluate, format_prompts
from sparserl.eval.run_settings import command_line_keys, run_folder, take_run_settings
from sparserl.parallel import ParallelDims, init_distributed
from sparserl.actor.hf import load_tokenizer
from sparserl.engine_options.checks import check_engine
from sparserl.engine_options.build import build_rollout_engine
from sparserl.engine_options.sizing import SequenceSize, memory_slots
from sparserl.utils.precision import resolve_precision
from sparserl.utils.errors import run_main
from sparserl.utils.logging import log0
from sparserl.utils.runs import follow_latest


def pool_slots(cfg: Config, lengths: list[int], seqs_per_rank: int, model_path: str, device) -> int:
    """rollout.kv_memory in entries, else rollout.kv_pool_tokens, else enough for rollout.max_num_seqs dense sequences
    of the longest prompt."""
    slots = memory_slots(cfg, model_path, device, SequenceSize(max(lengths), cfg.eval.max_new_tokens))
    if slots is not None:
        return slots
    if cfg.rollout.kv_pool_tokens > 0:
        return cfg.rollout.kv_pool_tokens
    return max(1, min(seqs_per_rank, cfg.rollout.max_num_seqs)) * (max(lengths) + cfg.eval.max_new_tokens)


def env_path(cfg: Config, argv: list[str]) -> str:
    """The env of the `env` eval set (eval/datasets.py): the evaluated run's env.path unless the command line sets one."""
    run = run_folder(cfg.model.path)
    if run is None or "env.path" in command_line_keys(argv):
        return cfg.env.path
    import yaml

    saved = ((yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}).get("env") or {}).get("path")
    return str(saved) if saved else cfg.env.path


def run(cfg: Config, argv: list[str] | None = None) -> None:
    """`argv`: the command line `cfg` was loaded from; the keys it sets keep their values over a run's."""
    newest = follow_latest(cfg.model.path)  # a folder of runs (outputs/grpo): the run its `latest` points to
    if str(newest) != str(Path(cfg.model.path).expanduser()):
        log0(f"model.path={cfg.model.path}: its newest run, {newest}")
        cfg.model.path = str(newest)
    cfg, taken = take_run_settings(cfg, list(sys.argv[1:] if argv is None else argv))
    for line in taken:
        log0(line)
    args = list(sys.argv[1:] if argv is None else argv)
    sets = load_eval_sets(cfg.eval, env_path(cfg, args))  # user errors surface here, before anything is written
    model = resolve_eval_model(cfg.model.path)
    check_engine(cfg)
    info = init_distributed(cfg.parallel.device, cfg.parallel.backend)
    dims = ParallelDims.from_world(info.world_size, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.dp_replicate)
    resolve_precision(cfg, info.device)
    dp = dims.build_mesh(info.device.type)["dp"]
    replica_group = dims.replica_group(info.rank)  # with tp or cp > 1 its owner evaluates for its peers
    tokenizer = load_tokenizer(model.path)
    texts = format_prompts(cfg, sets, tokenizer)
    lengths = [len(ids) for t in texts for ids in tokenizer(t, add_special_tokens=False)["input_ids"]]
    per_rank = max(-(-len(s.rows) // dims.dp) for s in sets) * cfg.eval.n
    engine = build_rollout_engine(cfg, model.path, tokenizer, info.device,
                                  pool_slots(cfg, lengths, per_rank, model.path, info.device), cfg.eval.seed,
                                  SequenceSize(max(lengths), cfg.eval.max_new_tokens))
    weights = model.weights()  # a DCP checkpoint's, or base + LoRA adapter merged (eval/model.py)
    if weights is not None:
        engine.update_weights(weights)
    log0(f"evaluating {model.describe()} on {', '.join(f'{s.name} ({len(s.rows)})' for s in sets)}: "
         f"n={cfg.eval.n}, temperature {cfg.eval.temperature}, kv {cfg.rollout.kv.algorithm}, {info.world_size} process(es)")
    result = evaluate(EngineHandle(engine, replica_group), tokenizer, cfg, sets, texts, dp.get_local_rank(), dp.size(),
                      dp.get_group(), info.rank)
    if info.rank == 0:
        out = write_outputs(cfg.eval.output_dir, result, settings(cfg, model.describe(), info.world_size))
        print(format_table(result), flush=True)
        print(f"wrote {out / 'eval.json'} and {out / 'samples.jsonl'}", flush=True)
    engine.close()


def main(argv: list[str] | None = None) -> None:
    def go() -> None:
        args = list(sys.argv[1:] if argv is None else argv)
        cfg = parse_cli(args, "eval")
        if cfg is not None:  # None: --help or --cfg job was answered
            run(cfg, args)

    run_main(go)


if __name__ == "__main__":
    main()
