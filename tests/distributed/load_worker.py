"""Workers for tests/distributed/test_load_rank0.py: an actor read on rank 0 only against one read on every rank.

    [torchrun --nproc_per_node=2] load_worker.py CKPT_ROOT OUT FAMILY:DTYPE [FAMILY:DTYPE ...]
For each checkpoint CKPT_ROOT/FAMILY, actor dtype DTYPE, and each mesh of the world ((1, 1) alone;
(2, 1) and (1, 2) with 2 processes): log-probs of a fixed batch, the full state, the non-persistent buffers,
then the same after one update, for `load_on="rank0"` and (with 2 processes) `load_on="all"`. With 2
processes it also exports the rank-0 actor (`export_final`) and pushes its weights into bf16 engines through
`sync_weights`. Rank 0 writes OUT (a torch.save'd dict) for the test to compare.
"""
import contextlib
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import transformers

from sparserl.actor.actor import Actor, TrainBatch
from sparserl.algo.loss import LossConfig
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.engines.weight_sync import sync_weights
from sparserl.trainer.loss import make_loss_fn

PAD = 3  # the checkpoints' pad_token_id


def fixed_batch(vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    n, T = 4, 8
    ids, plens, masks = [], [], []
    for i in range(n):
        p, r = 3 + i, 4 + i
        seq = torch.randint(0, vocab, (p + r,), generator=g)
        seq[i] = PAD
        ids.append(seq.tolist())
        plens.append(p)
        m = torch.zeros(T)
        m[:r] = 1.0
        masks.append(m)
    return TrainBatch(ids=ids, prompt_lens=plens, mask=torch.stack(masks), advantages=torch.randn(n, generator=g),
                      logp_old=-torch.rand(n, T, generator=g) * 3 - 4)


def local_buffers(actor: Actor) -> dict[str, torch.Tensor]:
    persistent = set(actor.model.state_dict())
    return {n: (b.to_local() if hasattr(b, "to_local") else b).clone()
            for n, b in actor.model.named_buffers() if n not in persistent}


def snapshot(actor: Actor) -> dict:
    """What the test compares: log-probs, every full tensor, the non-persistent buffers; then one update."""
    batch = fixed_batch(actor.config.vocab_size)
    out = {"logp": actor.logprobs(batch), "state": {k: v.clone() for k, v in actor.full_state()},
           "buffers": local_buffers(actor)}
    actor.accumulate_gradients(batch, make_loss_fn(LossConfig(clip_low=0.2, clip_high=0.28)), list(range(len(batch))))
    out["grad_norm"], applied = actor._step()
    assert applied
    out["updated"] = {k: v.clone() for k, v in actor.full_state()}
    out["logp_updated"] = actor.logprobs(batch)
    return out


class RecordingEngine:
    """An engine that keeps what `sync_weights` hands it, and says what it wants as real engines do."""

    def __init__(self, receives: bool, dtype):
        self.receives_weights, self.weight_dtype = receives, dtype
        self.got: dict[str, torch.Tensor] = {}

    def update_weights(self, named):
        for name, t in named:
            self.got[name] = t.clone()


@contextlib.contextmanager
def checkpoint_reads_refused(rank: int):
    """On ranks other than 0, reading a checkpoint inside the block is an error."""
    cls = transformers.AutoModelForCausalLM
    own = vars(cls).get("from_pretrained")  # None: inherited, so deleting the patch restores it

    def refuse(*args, **kwargs):
        raise AssertionError(f"rank {rank} read a checkpoint although load_on='rank0'")

    if rank != 0:
        cls.from_pretrained = refuse
    try:
        yield
    finally:
        if rank != 0:
            if own is None:
                del cls.from_pretrained
            else:
                cls.from_pretrained = own


def main() -> None:
    root, out, specs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    info = init_distributed("cpu")
    world = info.world_size
    shapes = [(1, 1)] if world == 1 else [(2, 1), (1, 2)]
    results = {}
    for spec in specs:
        family, dtype = spec.split(":")
        ckpt = str(root / family)
        for dp, tp in shapes:
            mesh = ParallelDims(dp, tp).build_mesh("cpu")
            kw = dict(dtype=dtype, compute_dtype=dtype, max_tokens_per_device=10_000)
            with checkpoint_reads_refused(info.rank):
                actor = Actor(ckpt, mesh, info.device, load_on="rank0", **kw)
            head, embed = actor.model.get_output_embeddings(), actor.model.get_input_embeddings()
            res = {"rank0": snapshot(actor), "tied": head.weight is embed.weight,
                   "param_dtypes": sorted({str(p.dtype) for p in actor.model.parameters()})}
            if world > 1:
                res["all"] = snapshot(Actor(ckpt, mesh, info.device, load_on="all", **kw))
                if (dp, tp) == (1, 2):
                    res.update(export_and_sync(actor, Path(out).parent / f"export-{family}-{dtype}", info.rank))
            everyone = [None] * world
            dist.all_gather_object(everyone, res)
            results[(family, dtype, dp, tp)] = everyone
            del actor
    if info.rank == 0:
        torch.save(results, out)
    teardown()


def export_and_sync(actor: Actor, folder: Path, rank: int) -> dict:
    from sparserl.engines.native.engine import NativeEngine
    from sparserl.actor.export import export_final

    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(folder)))
    export_final(cfg, actor, None, rank)
    res = {"export": str(folder / "hf")}
    full = {k: v.clone() for k, v in actor.full_state()}
    # A bf16 engine on rank 0; rank 1 plays a TP peer whose engine lives in another process.
    fake = RecordingEngine(receives=rank == 0, dtype=torch.bfloat16)
    metrics = sync_weights(actor.full_state(), fake, bucket_mb=0.01)
    res["fake"] = {"got": fake.got, "gb": metrics["perf/weight_sync_gb"],
                   "expect": {k: v.to(torch.bfloat16) for k, v in full.items()},
                   "full_bytes": sum(v.numel() * v.element_size() for v in full.values())}
    # The native engine says its dtype itself: a bf16 rollout model gets the bf16 casts of the actor's weights.
    rollout_model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(actor.config), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in rollout_model.parameters():
            p.zero_()
    engine = NativeEngine(rollout_model, num_slots=64)
    metrics = sync_weights(actor.full_state(), engine)
    res["native"] = {"dtype": str(engine.weight_dtype), "gb": metrics["perf/weight_sync_gb"],
                     "equal": all(torch.equal(v, full[k].to(torch.bfloat16)) for k, v in rollout_model.state_dict().items())}
    return res


if __name__ == "__main__":
    main()
