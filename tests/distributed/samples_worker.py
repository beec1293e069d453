"""One training step as `trainer/grpo.py` runs it, with the logged samples next to the tensors its loss received.
Used by tests/process/test_samples_run.py.

    [torchrun --nproc_per_node=N] tests/distributed/samples_worker.py CKPT OUT fused|separate [uneven]

A real rollout of the tiny model on the arithmetic env's prompts with R-KV compression (budget 16, prompt
compressed too, so every sequence is compressed at its first decode step and every 8 tokens after), then three
sampler log-probs per rank pushed off so that the veto and both token masks fire. `policy_objective` is wrapped
to record what it receives; each rank saves, per row it trained on, the loss's logp_old, mask, weights and the
batch's logp_sparse, keyed by where the row was rolled out, to OUT/loss_<rank>.pt. Rank 0's records (every
sequence it rolled out) are in OUT/samples/step_1.jsonl. With `uneven` (2 ranks) rank 0 rolls out 3 of the 4 prompts
and rank 1 one, as partial rollouts leave ranks with different sample counts.
"""
import sys

import torch

import sparserl.trainer.loss as L
import sparserl.trainer.loss_path as O
from sparserl.cli import parse_cli
from sparserl.rollout.worker import rollout
from sparserl.engine_options.build import build_rollout_engine, sampling_params
from sparserl.trainer.build import build_actor, format_prompts, load_tokenizer, start_processes
from sparserl.trainer.advantages import set_advantages
from sparserl.trainer.balance import balance_ranks
from sparserl.trainer.preflight import validate_inputs
from sparserl.trainer.samples import SampleLog
from sparserl.trainer.train_batch import to_train_batch

SEEN: dict = {}
CURRENT: dict = {}


class Recording:
    """The loss closure, unchanged, telling the recorder which batch rows the next `policy_objective` call is for."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.finalize = getattr(inner, "finalize", None)

    def __call__(self, logp, entropy, batch, idx, norm):
        CURRENT.update(batch=batch, idx=idx.tolist())
        return self.inner(logp, entropy, batch, idx, norm)


def recording_objective(real):
    def objective(cfg, logp, logp_old, adv, mask, norm, weights=None, **kw):
        batch, T = CURRENT["batch"], logp.shape[1]
        for k, row in enumerate(CURRENT["idx"]):
            origin = tuple(batch.origin[row]) if batch.origin is not None else (CURRENT["rank"], row)
            SEEN[origin] = {"logp_old": logp_old[k].detach().clone(), "mask": mask[k].detach().clone(),
                            "weights": None if weights is None else weights[k].detach().clone(),
                            "logp_sparse": batch.logp_sparse[row, :T].detach().clone(), "advantage": float(adv[k, 0])}
        return real(cfg, logp, logp_old, adv, mask, norm, weights=weights, **kw)

    return objective


def main() -> None:
    ckpt, out, path = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = parse_cli([f"model.path={ckpt}", "model.compute_dtype=float32", "rollout.dtype=float32", "env.path=envs/arithmetic.py",
                     f"trainer.output_dir={out}", "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=20",
                     "rollout.kv.algorithm=rkv", "rollout.kv.budget=16", "rollout.kv.window=4", "rollout.kv.divide_length=8",
                     "rollout.kv.kernel=3", "rollout.kv.compress_prompt=true", "algo.correction.enable=true",
                     "algo.correction.normalize_over=all", f"actor.fuse_old_logprobs={str(path == 'fused').lower()}",
                     "actor.max_tokens_per_device=256", "trainer.log_samples=64"], "grpo")
    inputs = validate_inputs(cfg)
    info, dims, mesh = start_processes(cfg)
    CURRENT["rank"] = info.rank
    tokenizer = load_tokenizer(inputs.model_path)
    rows = inputs.rows[:cfg.trainer.prompts_per_step]
    share = len(rows) // dims.dp
    if sys.argv[4:] == ["uneven"]:
        rows = rows[:3] if info.rank == 0 else rows[3:]
    else:
        rows = rows[info.rank * share:(info.rank + 1) * share]
    texts = format_prompts(cfg, rows, tokenizer)
    params = sampling_params(cfg)
    actor = build_actor(cfg, inputs.model_path, mesh, info.device)
    engine = build_rollout_engine(cfg, inputs.model_path, tokenizer, info.device, 4096, cfg.trainer.seed + info.rank)
    samples, _ = rollout(engine, tokenizer, inputs.env, rows, texts, params)
    for i, (t, push) in zip((1, 2, 3), ((2, 12.0), (0, -1.0), (3, 1.0))):  # veto; xi = e (high); xi = 1/e (low)
        samples[i].logp_sparse[t] += push

    batch = to_train_batch(samples, info.device)
    loss_cfg = L.loss_config(cfg.algo)
    fused = path == "fused"
    if not fused:
        batch.logp_old = actor.logprobs(batch)
    rejected, correction_metrics = L.apply_correction(cfg.algo, batch, actor.dp_group) if not fused else (None, {})
    set_advantages(cfg.algo, batch, samples, params.n, rejected, loss_cfg)
    batch, minibatches, _ = balance_ranks(batch, 1, actor.dp_group)
    L.policy_objective = recording_objective(L.policy_objective)  # both loss closures' objective
    O.policy_objective = recording_objective(O.policy_objective)
    loss_fn = O.FusedOldLogprobLoss(cfg.algo, loss_cfg, actor.dp_group) if fused else L.make_loss_fn(loss_cfg)
    actor.update(batch, Recording(loss_fn), 1, 1, minibatches=minibatches)
    if fused:
        correction_metrics = loss_fn.metrics
    norm_factor = correction_metrics["correction/norm_factor"]
    log = SampleLog(out, cfg.trainer.log_samples, info.rank, cfg.algo.correction, tokenizer)
    log.log(1, samples, batch, norm_factor, actor.dp_group)
    torch.save({"seen": SEEN, "norm_factor": norm_factor, "fused": fused,
                "compressions": [s.kv[0].compressions for s in samples]}, f"{out}/loss_{info.rank}.pt")


if __name__ == "__main__":
    main()
