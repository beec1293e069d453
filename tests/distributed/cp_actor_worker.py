"""Workers for the actor's context-parallel tests (run by tests/distributed/test_cp_actor.py).

    [torchrun --nproc_per_node=DP*CP*TP] cp_actor_worker.py OUT CKPT DP CP TP MAX_TOKENS [ac]
One update's log-probs, entropies, losses, gradients and gradient norm on a fixed batch (uneven lengths, groups
of samples sharing a prompt, a response of one token), for token and sequence aggregation with an entropy term,
and the fused path (logp_old from the update's own forward, with the correction applied). Every DP rank
takes its contiguous share of the same 10 sequences; rank 0 saves what every rank saw.
"""
import sys

import torch
import torch.distributed as dist

import sparserl.actor.context_parallel as cp_mod
from sparserl.actor.actor import Actor, TrainBatch
from sparserl.algo import CorrectionConfig
from sparserl.algo.loss import LossConfig
from sparserl.config import AlgoConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.loss import make_loss_fn
from sparserl.trainer.loss_path import FusedOldLogprobLoss

N, T = 10, 14


def fixed_batch(share: int, shares: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids, plens, masks = [], [], []
    prompts = [torch.randint(5, vocab, (p,), generator=g).tolist() for p in (5, 3, 7)]
    for i in range(N):
        if i < 6:  # three groups of two samples sharing a prompt
            prompt = prompts[i // 2]
        else:
            prompt = torch.randint(5, vocab, (2 + i % 4,), generator=g).tolist()
        r = 1 if i == 7 else 2 + (5 * i) % (T - 2)
        ids.append(prompt + torch.randint(5, vocab, (r,), generator=g).tolist())
        plens.append(len(prompt))
        m = torch.zeros(T)
        m[:r] = 1.0
        masks.append(m)
    mask = torch.stack(masks)
    mask[2, 1] = 0.0  # an env token inside a response
    adv = torch.randn(N, generator=g)
    logp_old = -torch.rand(N, T, generator=g) * 3 - 3
    sparse = logp_old + torch.randn(N, T, generator=g) * 0.3
    s = slice(share * N // shares, (share + 1) * N // shares)
    return TrainBatch(ids=ids[s], prompt_lens=plens[s], mask=mask[s], advantages=adv[s], logp_old=logp_old[s],
                      logp_sparse=(sparse * mask)[s])


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main(out: str, ckpt: str, dp: int, cp: int, tp: int, max_tokens: int, ac: bool) -> None:
    info = init_distributed("cpu")
    ring_calls = []
    attend = cp_mod.CPAttention.attend

    def counting(self, q, *args):
        ring_calls.append(q.shape[0])  # this rank's rows in the layer
        return attend(self, q, *args)

    cp_mod.CPAttention.attend = counting
    dims = ParallelDims(dp=dp, tp=tp, cp=cp)
    mesh = dims.build_mesh("cpu")
    dp_rank = mesh["dp"].get_local_rank()
    actor = Actor(ckpt, mesh, info.device, dtype="float32", compute_dtype="float32", max_tokens_per_device=max_tokens,
                  entropy_grad=True, activation_checkpointing=ac, logprob_chunk_mb=0.01)
    batch = fixed_batch(dp_rank, dp, actor.config.vocab_size)
    index = list(range(len(batch)))
    res = {"logp": actor.logprobs(batch), "loss": {}, "grads": {}}
    runs = {"token": make_loss_fn(LossConfig(loss_agg="token", clip_low=0.2, clip_high=0.28, entropy_coef=0.01)),
            "sequence": make_loss_fn(LossConfig(loss_agg="sequence", clip_low=0.2, clip_high=0.28, entropy_coef=0.01))}
    corr = CorrectionConfig(enable=True, normalize_over="kept")
    fused = FusedOldLogprobLoss(AlgoConfig(loss_agg="token", correction=corr),
                                LossConfig(loss_agg="token", clip_low=0.2, clip_high=0.28), actor.dp_group)
    runs["fused"] = fused
    for name, loss_fn in runs.items():
        b = batch
        if name == "fused":
            b = fixed_batch(dp_rank, dp, actor.config.vocab_size)
            b.logp_old = None
        m = actor.accumulate_gradients(b, loss_fn, index, with_entropy=True)
        sums = torch.tensor([m["actor/loss"], m["actor/pg_loss"], m["actor/entropy"]], dtype=torch.float64)
        dist.all_reduce(sums, group=mesh["dp"].get_group())
        res["loss"][name] = sums.tolist()
        res["grads"][name] = {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
        if name == "fused":
            res["fused_metrics"] = {k: float(v) for k, v in fused.metrics.items()}
        actor.optimizer.zero_grad(set_to_none=True)
    # One step on the token loss's gradients: clipping needs the global norm over the dp x cp (x tp) shards.
    actor.accumulate_gradients(batch, runs["token"], index, with_entropy=True)
    res["grad_norm"], applied = actor._step()
    assert applied
    res["after"] = actor.logprobs(batch)  # the updated weights
    res["ring_calls"] = len(ring_calls)
    everyone = gather((dp_rank, mesh["cp"].get_local_rank(), res))
    if info.rank == 0:
        torch.save(everyone, out)
    teardown()


if __name__ == "__main__":
    a = sys.argv
    main(a[1], a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6]), len(a) > 7 and a[7] == "ac")
