"""The GRPO trainer, recording every dense pass of its actor (for tests/e2e/test_sampler_tail.py).

    python dense_pass_recorder.py OUT key=value ...   # under tests/launch.py, one process per rank

Runs `sparserl.trainer.grpo` with `Actor.logprobs` wrapped: each call's step, sequences (token ids), dense
log-probs, sampler log-probs and loss mask go to OUT.rank<R>.pt when the run ends. The trainer's code is not
otherwise touched: the test computes what the sampler's tail must be from these records alone.
"""
import os
import sys

import torch

import sparserl.utils.seed as seed_module
from sparserl.actor.actor import Actor

out = sys.argv[1]
sys.argv = [sys.argv[0], *sys.argv[2:]]
records: list[dict] = []
current = {"step": 0}
seed_step, logprobs = seed_module.seed_step, Actor.logprobs


def recording_seed_step(seed, step, rank):  # the trainer calls it first thing in every step
    current["step"] = step
    return seed_step(seed, step, rank)


def recording_logprobs(self, batch):
    logp = logprobs(self, batch)
    if logp is not None and len(batch):
        records.append({"step": current["step"], "ids": [list(x) for x in batch.ids], "logp_old": logp.detach().cpu(),
                        "logp_sparse": batch.logp_sparse.cpu(), "mask": batch.mask.cpu()})
    return logp


seed_module.seed_step = recording_seed_step
Actor.logprobs = recording_logprobs

from sparserl.trainer import grpo  # noqa: E402

try:
    grpo.main()
finally:
    torch.save(records, f"{out}.rank{os.environ.get('RANK', '0')}.pt")
