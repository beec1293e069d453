"""Worker for tests/distributed/test_lora_dist.py: a LoRA actor on every mesh of the world.

    [torchrun --nproc_per_node=2] lora_worker.py CKPT OUT
For each mesh ((1, 1) alone; (2, 1) and (1, 2) with 2 processes), an fp32 LoRA actor with activation checkpointing:
what trains and what the optimizer holds, log-probs of the base (reference, adapters off), two updates, the merged
full state, a native engine's sampler log-probs after `sync_weights` against the actor's on the same tokens, a
save -> resume -> next step against the uninterrupted run, and the export (adapter + merged). Rank 0 writes OUT.
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from sparserl.actor import checkpoint, lora
from sparserl.actor.actor import Actor, TrainBatch
from sparserl.actor.export import export_final
from sparserl.algo.loss import LossConfig
from sparserl.config import LoRAConfig
from sparserl.engines.types import GenerationRequest, SamplingParams
from sparserl.engines.weight_sync import sync_weights
from sparserl.parallel import ParallelDims, init_distributed, teardown
from sparserl.trainer.loss import make_loss_fn
from tests.distributed.load_worker import fixed_batch

SPEC = LoRAConfig(rank=4, alpha=16.0, dropout=0.0, export_merged=True,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def build(ckpt: str, mesh, device, seed: int = 0) -> Actor:
    return Actor(ckpt, mesh, device, dtype="float32", compute_dtype="float32", lr=2e-2, max_tokens_per_device=10_000,
                 activation_checkpointing=True, lora=SPEC, seed=seed)


def step(actor: Actor, batch: TrainBatch) -> float:
    actor.accumulate_gradients(batch, make_loss_fn(LossConfig(clip_low=0.2, clip_high=0.28)), list(range(len(batch))))
    norm, applied = actor._step()
    assert applied
    return norm


def adapters(actor: Actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in lora.adapter_state(actor.model)}


def engine_parity(actor: Actor, ckpt: str) -> float:
    """Largest |logp_sparse - logp_actor| over tokens a native fp32 engine sampled after `sync_weights`."""
    from transformers import AutoModelForCausalLM

    from sparserl.engines.native.engine import NativeEngine

    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), num_slots=512, eos_token_ids=[])
    sync_weights(actor.full_state(), engine)
    prompts = [[1, 5, 7, 9, 3], [2, 8], [4, 4, 10, 11, 12, 13]]
    gens = engine.generate([GenerationRequest(p, SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3),
                                              request_id=str(i)) for i, p in enumerate(prompts)])
    T = max(len(g.token_ids) for g in gens)
    mask = torch.zeros(len(gens), T)
    for i, g in enumerate(gens):
        mask[i, : len(g.token_ids)] = 1
    batch = TrainBatch(ids=[g.prompt_token_ids + g.token_ids for g in gens], prompt_lens=[len(g.prompt_token_ids) for g in gens],
                       mask=mask, advantages=torch.zeros(len(gens)))
    logp = actor.logprobs(batch)
    worst = 0.0
    for i, g in enumerate(gens):
        n = len(g.token_ids)
        worst = max(worst, (logp[i, :n] - torch.tensor(g.logp_sparse)).abs().max().item())
    return worst


def run_mesh(ckpt: str, out: Path, mesh, device, rank: int, tag: str) -> dict:
    actor = build(ckpt, mesh, device)
    batch = fixed_batch(actor.config.vocab_size)
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    res = {"trained": names, "optimizer_is_adapters": in_optimizer == {id(p) for p in actor.params}
           and len(in_optimizer) == len(names), "frozen": sum(1 for p in actor.model.parameters() if not p.requires_grad)}
    res["logp_base"] = actor.logprobs(batch)
    res["grad_norms"] = [step(actor, batch)]
    ckpt_dir = checkpoint.save(out / f"ckpt-{tag}", 1, actor.model, actor.optimizer,
                               {"step": 1, "scheduler": actor.scheduler.state_dict()}, rank)
    res["grad_norms"].append(step(actor, batch))
    res["adapters"] = adapters(actor)
    res["merged"] = {k: v.clone() for k, v in actor.full_state()}
    res["logp_ref"] = actor.reference().logprobs(batch)
    res["logp"] = actor.logprobs(batch)
    res["parity"] = engine_parity(actor, ckpt)
    meta = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    res["checkpoint_keys"] = sorted(k for k in meta if k.startswith("model."))
    # resume: a fresh actor (other adapter init) loads step 1 and takes step 2
    resumed = build(ckpt, mesh, device, seed=7)
    state = checkpoint.load(ckpt_dir, resumed.model, resumed.optimizer)
    resumed.scheduler.load_state_dict(state["scheduler"])
    step(resumed, batch)
    res["resumed"] = adapters(resumed)
    # export: the adapter and the merged model beside it
    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(out / f"export-{tag}")), model=SimpleNamespace(path=ckpt))
    export_final(cfg, actor, None, rank)
    res["export"] = str(out / f"export-{tag}" / "hf")
    return res


def main() -> None:
    ckpt, out = sys.argv[1], Path(sys.argv[2])
    info = init_distributed("cpu")
    world = info.world_size
    shapes = [(1, 1)] if world == 1 else [(2, 1), (1, 2)]
    results = {}
    for dp, tp in shapes:
        mesh = ParallelDims(dp, tp).build_mesh("cpu")
        res = run_mesh(ckpt, out.parent, mesh, info.device, info.rank, f"{world}-{dp}-{tp}")
        everyone = [None] * world
        dist.all_gather_object(everyone, res)
        results[(dp, tp)] = everyone
    if info.rank == 0:
        torch.save(results, out)
    teardown()


if __name__ == "__main__":
    main()
