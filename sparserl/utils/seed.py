"""Seeding and RNG-state capture for reproducible runs and exact resume.

`set_seed(seed, rank)` seeds every generator with `seed + rank`: ranks draw different dropout masks and
samples, and a run is reproducible for a fixed world size. Anything that must be identical on all ranks
(initial weights, the prompt order) must not rely on the global generators: weights are loaded from a
checkpoint, and data order uses its own generator seeded with `seed` alone.

`seed_step(seed, step, rank)` re-seeds them at the start of every training step from (seed, step, rank)
alone: a resumed run, on any number of processes, continues the same streams without saving any
generator state (sparserl/actor/checkpoint.py).

Every derived stream (a step's, an engine sample's, an eval set's, a data source's) comes from one
function, `derive(base, (key, stride), ...) = base * MIX + sum(key * stride)` (optionally reduced modulo a bound),
through the named helpers below; engines and the trainer call those and never write the mix by hand.

`rng_state()` returns only tensors, ints, floats, strings and tuples, so `torch.save` stores it and
`torch.load(weights_only=True)` reads it back.

Left out on purpose: `torch.use_deterministic_algorithms` and cuDNN flags (they cost speed and belong to
the caller's choice), and the states of generators owned by other objects (samplers, data loaders). torch is
imported inside the functions that seed it, so the derivations cost no torch import (the input checks run before it).
"""
from __future__ import annotations

import random
from typing import Any

try:
    import numpy as np
except ImportError:  # numpy is optional; torch and python random are always seeded
    np = None


MIX = 1_000_003  # a prime: streams of neighbouring bases do not overlap for any realistic key range
SAMPLE_MOD = 2**63 - 1  # sample streams fit torch.Generator.manual_seed and int64 tensors
_SAMPLE_STRIDE = 10_007  # a prime: the stride of the seed index in a sample's stream key (`sample_seed`)
_SAMPLE_STRIDE_INVERSE = pow(_SAMPLE_STRIDE, -1, SAMPLE_MOD)


def derive(base: int, *keys: tuple[int, int], modulus: int | None = None) -> int:
    """The seed of a child stream of `base`: `base * MIX + sum(key * stride for key, stride in keys)`."""
    value = int(base) * MIX + sum(int(k) * int(s) for k, s in keys)
    return value % modulus if modulus else value


def step_seed(seed: int, step: int) -> int:
    """Training step `step` of a run seeded with `seed`: the global generators and the engine's base seed."""
    return derive(seed, (step, 7_919))


def sample_seed(base: int, index: int, sample: int) -> int:
    """Sample `sample` of the request at seed index `index` under an engine (or request) seed `base`: the one
    stream key every engine draws a sample with, so that engines agree by construction."""
    return derive(base, (index, _SAMPLE_STRIDE), (sample, 1), modulus=SAMPLE_MOD)


def trajectory_index(index: int, sample: int) -> int:
    """The seed index whose sample 0 draws from the stream of sample `sample` at seed index `index`, under any base:
    `sample_seed(base, trajectory_index(index, sample), 0) == sample_seed(base, index, sample)`. A multi-turn
    trajectory's later turns are single-sample requests (n=1); keyed by this index they go on drawing from the
    trajectory's own first-turn stream, at logical positions that only grow, so no two trajectories share a stream.
    (10_007 is prime and does not divide SAMPLE_MOD: it has an inverse modulo SAMPLE_MOD.) Sample 0 keeps its index."""
    if sample == 0:
        return index
    return (int(index) + int(sample) * _SAMPLE_STRIDE_INVERSE) % SAMPLE_MOD


def set_seed(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device) with `seed + rank`; returns that value."""
    import torch

    effective = int(seed) + int(rank)
    random.seed(effective)
    if np is not None:
        np.random.seed(effective % 2**32)
    torch.manual_seed(effective)  # also seeds all CUDA devices
    return effective


def seed_step(seed: int, step: int, rank: int = 0) -> int:
    """Seed every generator for training step `step` of a run seeded with `seed` (see the module docstring)."""
    return set_seed(step_seed(seed, step), rank)


def rng_state() -> dict[str, Any]:
    """The current states of the python, numpy, torch and CUDA generators."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        st = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": st["bit_generator"],
            "key": torch.from_numpy(st["state"]["key"].astype(np.int64)),
            "pos": int(st["state"]["pos"]),
            "has_gauss": int(st["has_gauss"]),
            "gauss": float(st["gauss"]),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states from `rng_state()`; generators absent from `state` (e.g. CUDA saved on CPU) are kept."""
    import torch

    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))  # a loader may turn tuples into lists
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state and np is not None:
        st = state["numpy"]
        np.random.set_state({
            "bit_generator": st["bit_generator"],
            "state": {"key": st["key"].numpy().astype(np.uint32), "pos": st["pos"]},
            "has_gauss": st["has_gauss"],
            "gauss": st["gauss"],
        })
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        for device in range(min(len(cuda_states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda_states[device].cpu(), device)
