"""The actor: an FSDP2-sharded Hugging Face model, its optimizer, log-prob recompute and the PPO update.

Every DP rank trains on its own share of the sequences (the trainer first balances token counts across
ranks, trainer/balance.py `balance_ranks`). Losses are normalized by counts all-reduced over the whole
minibatch and multiplied by the DP size before backward (FSDP2 averages gradients), so the update is the
same for any world size and any micro-batch split. Ranks run the same number of forwards (short ranks run
an empty micro-batch), because every FSDP2 forward and backward is a collective.
Tensor parallelism is applied by parallelize.py (TP plans as data, vocabulary-parallel LM head).
Context parallelism (the mesh's "cp" axis > 1): the cp ranks of a DP rank hold the same sequences and run the same
micro-batches, each forward split along the sequence (logprobs.py `packed_logprobs` with `cp`, ring attention,
context_parallel.py); every cp rank gets the whole micro-batch's log-probs and computes the same loss, whose
gradient reaches each rank's own rows only; FSDP2 (over dp x cp) sums those parts, so the loss is scaled by
dp x cp before backward. Normalizers and metrics are reduced over dp only, as the cp ranks hold the same data.
With more than one process the checkpoint is read on rank 0 only and broadcast into the sharded model
(hf.py `load_model_rank0`, `load_on` / `SPARSERL_LOAD_ON=all` to read it on every rank); `full_state()` gathers
the weights back one tensor at a time, in the dtype and on the ranks the consumer asks for (`FullState`).
With `lora` (actor.lora.rank > 0, lora.py) the model carries peft adapters: only they train (optimizer, clipping,
checkpoint), `full_state()` yields the merged weights under the original names, and `reference()` is the same
model with its adapters off (the KL reference without a second copy).
Left out on purpose: CPU offload of optimizer state.
"""
from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sparserl.actor import lora as lora_lib
from sparserl.actor.hf import load_model, load_model_rank0, load_on_choice, parse_dtype
from sparserl.actor.logprobs import DEFAULT_CHUNK_MB, PackedSeqs, host_to_device, packed_logprobs, prompt_key
from sparserl.actor.optim import build_optimizer, build_scheduler
from sparserl.actor.parallelize import materialize, parallelize
from sparserl.algo.advantages import zero_advantage
from sparserl.algo.aggregation import Normalizer
from sparserl.data.packing import contiguous_minibatches, split_microbatches, split_shared_microbatches
from sparserl.actor.context_parallel import CPGroup, check_model
from sparserl.parallel import all_reduce_max, all_reduce_sum, cp_size
from sparserl.model.attention import use_packed_attention


@dataclass
class TrainBatch:
    """This rank's sequences for one update. Per-token tensors are response-aligned (B, T)."""

    ids: list[list[int]]  # prompt + response tokens
    prompt_lens: list[int]
    mask: torch.Tensor  # (B, T) 1 = trained token
    advantages: torch.Tensor  # (B,) one per sequence, or (B, T) one per token (algo/advantages.py), 0 off the mask
    logp_old: torch.Tensor | None = None  # (B, T)
    logp_sparse: torch.Tensor | None = None  # (B, T) what the rollout engine reported
    logp_ref: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # correction weights (B, T)
    kl_weights: torch.Tensor | None = None
    origin: list[tuple[int, int]] | None = None  # (DP rank, row) each row was rolled out at; None: here, in order
    # (B, T) the sampler's tokens: the model tokens of the responses, as rolled out (`mask` before the length-cut
    # mask and the correction changed it); None: `mask` is that
    response_mask: torch.Tensor | None = None
    values: torch.Tensor | None = None  # (B, T) a critic's values of the tokens' states before the update (gae)
    returns: torch.Tensor | None = None  # (B, T) the critic's targets (algo/advantages.py gae_returns)
    # (B, T) partial rollouts: the tokens drawn in this step, the only ones the sampler's statistics read (a carried
    # token's xi also holds the updates since it was drawn); None: every token
    fresh_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        return [len(x) for x in self.ids]


# loss_fn(logp, entropy, batch, index, normalizer) -> (scalar loss, metrics: floats or 0-dim tensors, best left on
# the device). It may also have `finalize(batch, index, normalizer) -> (grad_scale, {metric: scale})`, called once
# after the minibatch's last backward, for normalizers that need every micro-batch's forward first (the fused path).
LossFn = Callable[[torch.Tensor, torch.Tensor | None, TrainBatch, torch.Tensor, Normalizer], tuple[torch.Tensor, dict]]


class Actor:
    def __init__(self, model_path: str, mesh, device: torch.device, *, dtype: str = "float32", compute_dtype: str = "bfloat16",
                 lr: float = 1e-6, betas=(0.9, 0.999), weight_decay: float = 0.0, lr_schedule: str = "constant",
                 warmup_steps: int = 0, total_steps: int = 1, min_lr_ratio: float = 0.0, max_grad_norm: float = 1.0,
                 max_tokens_per_device: int = 8192, activation_checkpointing: bool = False, trainable: bool = True,
                 sampling: tuple[float, float, int] = (1.0, 1.0, 0), entropy_grad: bool = False,
                 logprob_chunk_mb: float | None = DEFAULT_CHUNK_MB, share_prompts: bool = True, load_on: str | None = None,
                 lora=None, seed: int = 0, skip_zero_advantage: bool = False, extend=None) -> None:
        self.device = device
        # Sequences whose advantage is exactly 0 (a group whose rewards all tie) add nothing to a loss that is
        # linear in the advantage: their forward runs without autograd (for logp_old and the metrics) and backward
        # skips them. The caller says when the loss is such a loss (trainer/loss.py `zero_advantage_no_grad`).
        self.skip_zero_advantage = skip_zero_advantage
        self.mesh = mesh
        self.max_tokens = max_tokens_per_device
        self.max_grad_norm = max_grad_norm
        self.temperature, self.top_p, self.top_k = sampling
        self.entropy_grad = entropy_grad  # False: entropy is only a metric, computed without autograd
        self.chunk_mb = logprob_chunk_mb  # None: by device (logprobs.py `chunk_mb_for`)
        self.share_prompts = share_prompts  # the samples of one prompt share its forward (actor/logprobs.py)
        # load_on="rank0" (default; None reads SPARSERL_LOAD_ON): only global rank 0 reads the checkpoint, the
        # other ranks build the model on the meta device and get their shards from rank 0 once it is parallelized.
        # "all": every rank reads it. One process always reads it directly.
        from_rank0 = load_on_choice(load_on) == "rank0" and dist.is_initialized() and dist.get_world_size() > 1
        # lora: a sparserl LoRAConfig; adapters are injected before parallelism, A seeded by `seed` on every rank.
        self.lora = lora if trainable and lora_lib.enabled(lora) else None
        inject = (lambda m: lora_lib.inject(m, self.lora, seed)) if self.lora is not None else None
        # extend(model): modules added to the loaded model before parallelism, after the adapters (a reward head).
        prepare = _in_order(inject, extend)
        if from_rank0:
            model, full_state, buffers = load_model_rank0(model_path, dtype, prepare)
        else:
            model = load_model(model_path, dtype, device, prepare)
        use_packed_attention(model)
        self.cp = None  # CPGroup with context parallelism
        if cp_size(mesh) > 1:
            check_model(model.config, cp_size(mesh))
            cp = mesh["cp"]
            self.cp = CPGroup(cp.get_group(), cp.get_local_rank(), cp.size())
            # A micro-batch row is split over the cp ranks: each holds about max_tokens_per_device of it.
            self.max_tokens = max_tokens_per_device * self.cp.size
        if activation_checkpointing:  # transformers >= 5 renamed it (the old name warns)
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.config = model.config
        compute = parse_dtype(compute_dtype)  # gradients are reduced in fp32 (fp64 for an fp64 model)
        self.model = parallelize(model, mesh, param_dtype=compute, reduce_dtype=torch.promote_types(compute, torch.float32))
        if from_rank0:
            materialize(self.model, device, full_state, buffers)
            del full_state, buffers
        self.dp_size = mesh["dp"].size()
        self.dp_group = mesh["dp"].get_group()
        # FSDP2 averages gradients over its mesh (dp, or dp x cp); the loss is already globally normalized, and
        # the cp ranks' gradients are parts of one sum: this undoes the average.
        self.grad_scale = self.dp_size * (self.cp.size if self.cp is not None else 1)
        self.optimizer = self.scheduler = None
        self.consecutive_skips = 0  # optimizer steps skipped in a row by the non-finite guard (_step)
        self._bad_loss = torch.zeros((), dtype=torch.bool, device=device)
        # What the optimizer, clipping and gradient scaling touch: every parameter, or only the adapters. FSDP2
        # gathers the frozen base for forward and backward only; it reduce-scatters gradients of these alone.
        self.params = [p for p in self.model.parameters() if p.requires_grad] if trainable else []
        if trainable:
            self.model.train()
            self.optimizer = build_optimizer(self.params, lr, betas, weight_decay)
            self.scheduler = build_scheduler(self.optimizer, lr_schedule, warmup_steps, total_steps, min_lr_ratio)
        else:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)

    summed = property(lambda self: _SUMMED, doc="the loss's metrics that are a share of a global quantity (summed)")

    # ------------------------------------------------------------------ micro-batching
    def _microbatches(self, batch: TrainBatch, index: list[int]) -> list[list[int]]:
        """Micro-batches of `index`; padded with empty ones so every DP rank runs the same count."""
        return self._pad_to_ranks(self._plan(batch, index))[0]

    def _plan(self, batch: TrainBatch, index: list[int]) -> list[list[int]]:
        lengths = [len(batch.ids[i]) for i in index]
        if self.share_prompts:  # a prompt's samples go together, so its forward is shared
            keys = [prompt_key(batch.ids[i], batch.prompt_lens[i]) for i in index]
            plan = split_shared_microbatches(keys, [batch.prompt_lens[i] for i in index], lengths, self.max_tokens)
        else:
            plan = split_microbatches(lengths, self.max_tokens)
        return [[index[j] for j in mb] for mb in plan] if index else []

    def _pad_to_ranks(self, *plans: list[list[int]]) -> list[list[list[int]]]:
        """Each plan padded with empty micro-batches to its longest over the DP ranks (one all-reduce for all)."""
        counts = all_reduce_max(torch.tensor([len(p) for p in plans], device=self.device), self.dp_group).tolist()
        return [p + [[] for _ in range(int(c) - len(p))] for p, c in zip(plans, counts)]

    def _zero_advantage_split(self, batch: TrainBatch, index: list[int]) -> tuple[list[int], list[int]]:
        """(trained, no-grad) sequences of `index`. No-grad: those of a prompt whose every sequence here has a zero
        advantage (a prompt's samples stay together, so shared prompts are still computed once)."""
        if not self.skip_zero_advantage or not index:
            return index, []
        zero = zero_advantage(batch.advantages[index]).tolist()
        keys = [prompt_key(batch.ids[i], batch.prompt_lens[i]) for i in index] if self.share_prompts else index
        signal = {k for k, z in zip(keys, zero) if not z}
        trained = [i for i, k in zip(index, keys) if k in signal]
        return trained, [i for i, k in zip(index, keys) if k not in signal]

    def _forward(self, batch: TrainBatch, mb: list[int], with_entropy: bool, hold_context=None):
        if not mb:  # keep the collectives in step with other ranks: a one-token dummy sequence
            seqs = PackedSeqs([[0, 0]], [1])
        else:
            seqs = PackedSeqs([batch.ids[i] for i in mb], [batch.prompt_lens[i] for i in mb])
        return packed_logprobs(self.model, seqs, self.device, self.temperature, self.top_p, self.top_k, with_entropy,
                               self.entropy_grad, hold_context, self.chunk_mb, self.share_prompts, self.cp)

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Dense log-probs of every response token under the current weights: (B, T)."""
        T = batch.mask.shape[1]
        out = None
        with self._without_adapter_dropout():
            for mb in self._microbatches(batch, list(range(len(batch)))):
                logp, _ = self._forward(batch, mb, with_entropy=False)
                if out is None:  # float32, or float64 for a float64 model
                    out = torch.zeros(len(batch), T, device=self.device, dtype=logp.dtype)
                for row, i in enumerate(mb):
                    out[i, : logp.shape[1]] = logp[row]
        return out

    @contextlib.contextmanager
    def _without_adapter_dropout(self):
        """LoRA dropout (actor.lora.dropout) regularizes the update only: log-probs are the policy's, in eval mode."""
        if self.lora is None or self.lora.dropout == 0 or not self.model.training:
            yield
            return
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    # ------------------------------------------------------------------ update
    def update(self, batch: TrainBatch, loss_fn: LossFn, num_minibatches: int = 1, epochs: int = 1,
               with_entropy: bool = True, minibatches: list[list[int]] | None = None) -> dict[str, float]:
        """One optimizer step per minibatch, `epochs` times. Minibatches are this rank's share of each step's
        sequences: `num_minibatches` contiguous slices unless given (every rank must give the same count)."""
        assert self.optimizer is not None, "this actor is frozen"
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        grad_norms = []
        if minibatches is None:
            minibatches = contiguous_minibatches(len(batch), num_minibatches)
        num_minibatches = len(minibatches)
        skipped = 0
        for _ in range(epochs):
            for index in minibatches:
                for key, v in self.accumulate_gradients(batch, loss_fn, index, with_entropy).items():
                    sums[key] = sums.get(key, 0.0) + v
                    counts[key] = counts.get(key, 0) + 1
                norm, applied = self._step()
                if applied:
                    grad_norms.append(norm)
                skipped += not applied
        steps = num_minibatches * epochs
        metrics = {k: (v / steps if k in self.summed else v / counts[k]) for k, v in sums.items()}
        metrics = self._mean_over_ranks(metrics, counts)
        if not self.skip_zero_advantage:
            metrics.pop("actor/no_grad_seq_frac", None)
        metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        metrics["actor/skipped_steps"] = float(skipped)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def accumulate_gradients(self, batch: TrainBatch, loss_fn: LossFn, index: list[int], with_entropy: bool = True) -> dict[str, float]:
        """Forward/backward of one minibatch (sequence indices `index` on this rank) in packed micro-batches.
        Gradients accumulate in the parameters; metrics come back summed over micro-batches. No host reads between
        micro-batches: metrics a loss returns as tensors are summed on the device in float64 (the sums of host
        floats) and read once, after the last backward."""
        norm = self._normalizer(batch, index)
        out: dict[str, float | torch.Tensor] = {}
        computed = 0

        def run_loss(logp, ent, mb) -> torch.Tensor:
            nonlocal computed
            idx = host_to_device(mb, self.device)
            loss, metrics = loss_fn(logp, ent, batch, idx, norm)
            self._bad_loss |= ~torch.isfinite(loss.detach())  # read at the optimizer step, no sync here
            computed += 1
            for key, v in metrics.items():
                v = v.detach().to(torch.float64).reshape(()) if isinstance(v, torch.Tensor) else float(v)
                out[key] = out[key] + v if key in out else 0.0 + v
            return loss

        trained, no_grad = self._zero_advantage_split(batch, index)
        grad_mbs, no_grad_mbs = self._pad_to_ranks(self._plan(batch, trained), self._plan(batch, no_grad))
        if no_grad_mbs and not grad_mbs:
            # Nothing to train on any rank: one empty backward still gives every parameter a (zero) gradient, so
            # the optimizer steps exactly as it would have with the zero-advantage sequences' gradients.
            grad_mbs = [[]]
        # Before the backward passes: FSDP2's root forward under no_grad after them drops its own parameters' gradients.
        with torch.no_grad():
            for mb in no_grad_mbs:  # their loss is 0: only logp_old, the metrics and the non-finite guard need them
                logp, ent = self._forward(batch, mb, with_entropy)
                if mb:
                    run_loss(logp, ent, mb)
        for mb in grad_mbs:
            with contextlib.ExitStack() as stack:  # the context outlives backward (activation checkpointing)
                logp, ent = self._forward(batch, mb, with_entropy, hold_context=stack)
                loss = run_loss(logp, ent, mb) if mb else logp.sum() * 0.0
                # FSDP2 averages gradients over DP (x CP) ranks; the loss is already globally normalized.
                (loss * self.grad_scale).backward()
        on_device = [k for k, v in out.items() if isinstance(v, torch.Tensor)]  # read once, all together
        out.update(zip(on_device, torch.stack([out[k] for k in on_device]).tolist() if on_device else []))
        if self.skip_zero_advantage:  # summed over ranks: the global share
            out["actor/no_grad_seq_frac"] = len(no_grad) / norm.seqs if norm.seqs else 0.0
        finalize = getattr(loss_fn, "finalize", None)
        if finalize is not None:  # normalizers known only now (trainer/loss_path.py FusedOldLogprobLoss)
            grad_scale, metric_scales = finalize(batch, index, norm)
            if grad_scale != 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
            out = {k: v * metric_scales.get(k, 1.0) for k, v in out.items()}
        # Shares of globally normalized terms add up; per-micro-batch rates are averaged.
        return {k: v if k in self.summed else v / max(computed, 1) for k, v in out.items()}

    def _normalizer(self, batch: TrainBatch, index: list[int]) -> Normalizer:
        mask = batch.mask[index] if index else batch.mask[:0]
        t = torch.tensor([float(mask.sum()), float(len(index))], dtype=torch.float64, device=self.device)
        all_reduce_sum(t, self.dp_group)
        return Normalizer(tokens=float(t[0]), seqs=float(t[1]))

    def _step(self) -> tuple[float, bool]:
        """Clip and apply the accumulated gradients; returns (global grad norm, applied).

        Non-finite guard: when the loss of any micro-batch on any DP rank, or the global gradient norm, is not
        finite, no rank steps the optimizer or the LR schedule (the decision is the same everywhere: the
        flags are all-reduced and the norm is global), the gradients are dropped and
        `consecutive_skips` counts it for the trainer's `trainer.max_skipped_steps`."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        flags = torch.stack([self._bad_loss.to(self.device, torch.float32),
                             (~torch.isfinite(norm.detach())).to(self.device, torch.float32)])
        bad = bool(all_reduce_max(flags, self.dp_group).any())
        self._bad_loss = torch.zeros((), dtype=torch.bool, device=self.device)
        if bad:
            self.optimizer.zero_grad(set_to_none=True)
            self.consecutive_skips += 1
            return float(norm), False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.consecutive_skips = 0
        return float(norm), True

    def _mean_over_ranks(self, metrics: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
        keys = sorted(self.summed | set(counts))
        vals = torch.tensor([metrics.get(k, 0.0) for k in keys] + [float(counts.get(k, 0) > 0) for k in keys],
                            dtype=torch.float64, device=self.device)
        all_reduce_sum(vals, self.dp_group)
        n = len(keys)
        out = {}
        for i, k in enumerate(keys):
            if k in self.summed:
                out[k] = float(vals[i])  # shares of a globally normalized quantity add up
            elif vals[n + i] > 0:
                out[k] = float(vals[i] / vals[n + i])
        return out

    # ------------------------------------------------------------------ weights out
    def full_state(self) -> "FullState":
        """(name, full tensor) for every parameter and buffer, gathered from shards as it is iterated; a collective
        every rank must iterate to the end. See `FullState.gather` for the engine's dtype and non-receiving ranks."""
        return FullState(self.model)

    def reference(self) -> "AdaptersOff":
        """The KL reference of a LoRA actor: this model with its adapters off, i.e. the base model."""
        assert self.lora is not None, "reference(): only a LoRA actor holds its base model"
        return AdaptersOff(self)


class AdaptersOff:
    """A LoRA actor's base model (adapters off) as a frozen actor: `logprobs` only, sharing the actor's weights."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        with lora_lib.adapters_off(self.actor.model):
            return self.actor.logprobs(batch)


class FullState:
    """A model's state by name, each tensor gathered from its shards when the walk reaches it (one at a time).

    Iterating yields (name, full tensor) in the model's dtypes on every rank. `gather(dtype, keep)` is the same
    walk for a consumer that knows more, such as `engines.weight_sync.sync_weights`:
      - dtype: every floating tensor is cast to it shard by shard, before its all-gather (a bf16 engine: the
        collective moves half the bytes of fp32 and no full fp32 copy is made). Casting commutes with gathering,
        so the values are those the consumer would get by casting the full tensor.
      - keep=False: this rank only takes part in the gathers (collectives) and drops each result at once; it
        yields (name, None).
    A model with LoRA adapters yields its merged weights under the original (non-peft) names (lora.py
    `merged_state`): an adapted weight is merged in the actor's dtype and cast afterwards.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.gather()

    def gather(self, dtype: torch.dtype | None = None, keep: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
        if lora_lib.has_adapters(self.model):  # merged weights under the original names
            yield from lora_lib.merged_state(self.model, dtype, keep)
            return
        for name, t in self.model.state_dict().items():  # state_dict() tensors are detached
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)  # on a DTensor: the local shard, no communication
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if not keep:
                del t, full
                yield name, None
            else:
                yield name, full


def _in_order(*steps):
    """One model-preparing function that runs the given ones (None: skipped) in order; None if there are none."""
    steps = [f for f in steps if f is not None]
    return (lambda m: [f(m) for f in steps]) if steps else None


# Metrics from policy_objective that are a micro-batch's share of a global quantity (summed, not averaged).
_SUMMED = {"actor/loss", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/no_grad_seq_frac"}
