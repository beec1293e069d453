"""Dynamic sampling's rounds as `trainer/grpo.py` runs them, without the update: real rollouts of the tiny model
through an env module, the real prompt sampler, the counts and the moving groups over real collectives.
Used by tests/distributed/test_dynamic_sampling_dist.py.

    [torchrun --nproc_per_node=N] tests/distributed/dynamic_sampling_worker.py CKPT DATA ENV OUT STEPS

Each rank saves, per step, the (round, place) keys of the groups it would train on, their samples' rewards, the
rounds' prompt counts and the step's dynamic/* metrics to OUT/rank_<rank>.pt.
"""
import sys
from functools import partial

import torch

from sparserl.cli import parse_cli
from sparserl.data.prompt_sampler import PromptSampler
from sparserl.engine_options.build import build_rollout_engine, sampling_params
from sparserl.rollout.worker import rollout
from sparserl.trainer.build import format_prompts, load_tokenizer, start_processes
from sparserl.trainer.dynamic_sampling import DynamicSampling, Round, round_seed
from sparserl.trainer.preflight import validate_inputs


def main() -> None:
    ckpt, data, env, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    cfg = parse_cli([f"model.path={ckpt}", "model.compute_dtype=float32", "rollout.dtype=float32", f"env.path={env}",
                     f"data.train_path={data}", f"trainer.output_dir={out}", "trainer.prompts_per_step=4", "rollout.n=2",
                     "rollout.max_new_tokens=3", "algo.dynamic_sampling.enable=true",
                     "algo.dynamic_sampling.max_rounds=3"], "grpo")
    inputs = validate_inputs(cfg)
    info, dims, mesh = start_processes(cfg)
    tokenizer = load_tokenizer(inputs.model_path)
    rows = inputs.rows
    texts = format_prompts(cfg, rows, tokenizer)
    params = sampling_params(cfg)
    engine = build_rollout_engine(cfg, inputs.model_path, tokenizer, info.device, 1024, cfg.trainer.seed)
    dp_rank = mesh["dp"].get_local_rank()
    sampler = PromptSampler(len(rows), 4, dp_rank, dims.dp, cfg.trainer.seed)
    group = mesh["dp"].get_group() if dims.dp > 1 else None
    dynamic = DynamicSampling(cfg.algo, params.n, cfg.rollout.max_new_tokens, 4, sampler, group, dp_rank, dims.dp,
                              info.device)
    sizes: list[int] = []

    def roll(step, draw, round_):
        sizes.append(len(draw.global_indices))
        engine.set_seed(round_seed(cfg.trainer.seed, step, round_))
        picked = draw.local_indices
        samples, metrics = rollout(engine, tokenizer, inputs.env, [rows[i] for i in picked], [texts[i] for i in picked],
                                   params, seed_indices=[draw.local_start + j for j in range(len(picked))]) \
            if picked else ([], {})
        return Round(samples, metrics, engine.stats())

    record = []
    engine.wake()
    for step in range(1, steps + 1):
        sizes.clear()
        got = dynamic.collect(sampler.next(), partial(roll, step))
        record.append({"keys": got.keys, "rewards": [s.reward for s in got.samples], "sizes": list(sizes),
                       "metrics": got.metrics, "rows": [s.extra_info["index"] for s in got.samples]})
    torch.save({"steps": record, "sampler": sampler.state_dict()}, f"{out}/rank_{info.rank}.pt")


if __name__ == "__main__":
    main()
