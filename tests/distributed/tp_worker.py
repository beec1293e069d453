"""Workers for the tensor-parallel tests (run by tests/distributed/test_tensor_parallel.py).

    [torchrun --nproc_per_node=DP*TP] tp_worker.py model OUT CKPT_ROOT DP TP FAMILY [FAMILY ...]
        log-probs, loss, gradients and gradient norm of one update on a fixed batch, for each checkpoint
        CKPT_ROOT/FAMILY; every data-parallel rank takes its contiguous share of the same 8 sequences.
    torchrun --nproc_per_node=2 tp_worker.py vocab OUT
        vocab_parallel_logprobs on each rank's slice of the same random logits; records every collective's shape.
"""
import sys

import torch
import torch.distributed as dist

import sparserl.actor.logprobs as logprobs_mod
from sparserl.actor.actor import Actor, TrainBatch
from sparserl.actor.vocab_parallel import vocab_parallel_logprobs
from sparserl.algo.loss import LossConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.loss import make_loss_fn

PAD = 3  # the checkpoints' pad_token_id: embedding rows with a padding_idx get no gradient


def fixed_batch(share: int, shares: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    n, T = 8, 12
    ids, plens, masks = [], [], []
    for i in range(n):
        p, r = 3 + i % 4, 4 + (3 * i) % 9
        seq = torch.randint(0, vocab, (p + r,), generator=g)
        seq[i % (p + r)] = PAD
        ids.append(seq.tolist())
        plens.append(p)
        m = torch.zeros(T)
        m[:r] = 1.0
        masks.append(m)
    mask = torch.stack(masks)
    mask[2, 1] = 0.0  # an env token inside a response
    adv = torch.randn(n, generator=g)
    logp_old = -torch.rand(n, T, generator=g) * 3 - 4
    weights = 0.5 + torch.rand(n, T, generator=g)
    s = slice(share * n // shares, (share + 1) * n // shares)
    return TrainBatch(ids=ids[s], prompt_lens=plens[s], mask=mask[s], advantages=adv[s], logp_old=logp_old[s], weights=weights[s])


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_model(out: str, root: str, dp: int, tp: int, families: list[str]) -> None:
    info = init_distributed("cpu")
    mesh = ParallelDims(dp, tp).build_mesh("cpu")
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    seen = {"widths": [], "dense_calls": 0}

    def recording_vocab_parallel(local_logits, *args, **kwargs):
        seen["widths"].append(local_logits.shape[-1])
        return vocab_parallel_logprobs(local_logits, *args, **kwargs)

    dense = logprobs_mod.processed_logprobs

    def counting_dense(*args, **kwargs):
        seen["dense_calls"] += 1
        return dense(*args, **kwargs)

    logprobs_mod.vocab_parallel_logprobs = recording_vocab_parallel
    logprobs_mod.processed_logprobs = counting_dense
    results = {}
    for family in families:
        seen.update(widths=[], dense_calls=0)
        actor = Actor(f"{root}/{family}", mesh, info.device, dtype="float32", compute_dtype="float32",
                      max_tokens_per_device=10_000, entropy_grad=True,
                      logprob_chunk_mb=0.003)  # 3 KB of fp32 logits per chunk: several chunks per micro-batch
        batch = fixed_batch(dp_rank, dp, actor.config.vocab_size)
        res = {"logp": [(dp_rank, tp_rank, actor.logprobs(batch))], "loss": {}, "grads": {}}
        for agg in ("token", "sequence"):
            cfg = LossConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
            metrics = actor.accumulate_gradients(batch, make_loss_fn(cfg), list(range(len(batch))), with_entropy=True)
            loss = torch.tensor([metrics["actor/loss"]], dtype=torch.float64)
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            res["loss"][agg] = float(loss)
            res["grads"][agg] = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
            if agg == "token":
                actor.optimizer.zero_grad(set_to_none=True)
        res["grad_norm"], applied = actor._step()  # clip_grad_norm_ + an optimizer step over (dp, tp) parameters
        assert applied
        everyone = gather((res["logp"][0], list(seen["widths"]), seen["dense_calls"]))
        res["logp"] = [e[0] for e in everyone]
        res["widths"] = [w for e in everyone for w in e[1]]
        res["dense_calls"] = sum(e[2] for e in everyone)
        res["vocab"] = actor.config.vocab_size
        results[family] = res
        del actor
    if info.rank == 0:
        torch.save(results, out)
    teardown()


def run_vocab(out: str) -> None:
    info = init_distributed("cpu")
    group = dist.group.WORLD
    tp, rank = info.world_size, info.rank
    N, V = 7, 51  # uneven split: 26 + 25 columns
    chunk = -(-V // tp)
    start, end = rank * chunk, min(V, (rank + 1) * chunk)
    shapes = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        shapes.append(tuple(tensor.shape))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    res = {"start": start, "end": end, "runs": {}}
    for temperature in (1.0, 0.7, 0.0):
        g = torch.Generator().manual_seed(1)
        full = torch.randn(N, V, generator=g) * 3
        targets = torch.randint(0, V, (N,), generator=g)
        a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
        local = full[:, start:end].clone().requires_grad_(True)
        shapes.clear()
        logp, ent = vocab_parallel_logprobs(local, targets, start, group, temperature, with_entropy=True)
        ((a * logp).sum() + (b * ent).sum()).backward()
        only_logp, none = vocab_parallel_logprobs(full[:, start:end], targets, start, group, temperature)
        res["runs"][temperature] = {"logp": logp.detach(), "ent": ent.detach(), "grad": local.grad, "shapes": list(shapes),
                                    "local_width": local.shape[1], "only_logp": only_logp, "none": none is None}
    dist.all_reduce = real_all_reduce
    torch.save(res, f"{out}.{rank}.pt")
    teardown()


if __name__ == "__main__":
    if sys.argv[1] == "model":
        run_model(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
    else:
        run_vocab(sys.argv[2])
