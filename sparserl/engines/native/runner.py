"""The model runner: owns the KV pool tensors and turns a `ScheduledBatch` into one packed forward.

Only this file of the native engine (and graph_step.py, its static decode step) touches model tensors. Decode
tokens go first in the packed batch (one row each, attended in one padded SDPA call), prefill spans follow. The LM
head runs only on the rows that are sampled (`logits_to_keep`), never on a whole prompt.
With `cuda_graphs` the decode-only steps go through `graphs` (graph_step.py: static buffers, CUDA graphs on CUDA)
and the pool has one extra slot, the sink its padding rows write to; every other step runs here eagerly.
Left out on purpose: torch.compile, tensor parallel inference.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from sparserl.model.attention import ForwardContext, Span, forward_context, use_packed_attention
from sparserl.utils.kv_memory import entry_bytes
from sparserl.kv.kv_dtype import KVFormat, entry_parts, resolve_kv_dtype
from sparserl.engines.native.decode_cache import DecodeCache
from sparserl.engines.native.graph_step import StaticDecode
from sparserl.engines.native.prepack import Prepacker
from sparserl.engines.native.quantize import QuantizedWeights, quantize_model, weights_nbytes
from sparserl.engines.native.scheduler import ScheduledBatch
from sparserl.engines.native.sequence import Sequence


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a Hugging Face decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


SILU_TYPES = ("SiLU", "SiLUActivation")  # torch.nn.SiLU, transformers' ACT2FN["silu"]


def _inplace_gated_mlp(self, x: torch.Tensor) -> torch.Tensor:
    """A gated SiLU MLP's forward, act(gate(x)) * up(x) -> down, with the activation and the product written over the
    gate's output: the same kernels in the same order as the module's own forward, two fewer (T, intermediate)
    tensors per layer. Only without autograd (the engine's forwards run in inference mode)."""
    if torch.is_grad_enabled():
        return type(self).forward(self, x)
    h = F.silu(self.gate_proj(x), inplace=True)
    return self.down_proj(h.mul_(self.up_proj(x)))


def use_inplace_mlps(model: torch.nn.Module) -> int:
    """Give the model's gated SiLU MLPs (Llama, Qwen2/3, Mistral: `gate_proj`, `up_proj`, `down_proj`, a SiLU
    `act_fn`) the in-place forward above; returns how many. At prefill's M the two tensors it saves are ~36 MB each
    per layer (5800 rows x 1536, SmolLM2-135M): fresh mappings whose every page faults in."""
    n = 0
    for module in model.modules():
        act = getattr(module, "act_fn", None)
        if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")) and act is not None \
                and type(act).__name__ in SILU_TYPES:
            module.forward = types.MethodType(_inplace_gated_mlp, module)
            n += 1
    return n


class SlotTable:
    """Each running sequence's slot list mirrored in a device tensor, updated by appends.

    Decode attention needs a (Bd, Lmax) index of slots every step; rebuilding it from Python lists costs
    O(total cached tokens) per step, this costs O(new entries). A compaction (slots_version bump) rewrites
    the sequence's row.
    """

    def __init__(self, device: torch.device, cache: DecodeCache | None = None) -> None:
        self.device = device
        self.table = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.rows: dict[int, list[int]] = {}  # seq_id -> [row, synced length, slots_version]
        self.free: list[int] = []
        # With a decode cache the rows hold copies of the keys/values instead of slot numbers (decode_cache.py).
        self.cache = cache

    def _reserve(self, n_rows: int, width: int) -> None:
        rows, cols = self.table.shape
        if n_rows <= rows and width <= cols:
            return
        grown = torch.zeros((max(n_rows, 2 * rows), max(width, 2 * cols, 64)), dtype=torch.long, device=self.device)
        grown[:rows, :cols] = self.table
        self.table = grown

    def gather(self, seqs: list[Sequence]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Returns decode slots (Bd, Lmax) and the additive mask (Bd, 1, 1, Lmax): 0 valid, -inf padding; with a
        decode cache, (None, None) and the cache's plan for this step is set instead."""
        rows_idx, cols, vals = [], [], []
        # Sequences new to decoding take their rows shortest first, so that rows handed out together (a rollout's
        # batch starts decoding at once) lie in order of length: the decode cache attends in blocks of neighbouring
        # rows, each only as wide as its longest (decode_cache.py).
        for seq in sorted((s for s in seqs if s.seq_id not in self.rows), key=lambda s: len(s.slots)):
            self.rows[seq.seq_id] = [self.free.pop() if self.free else len(self.rows), 0, seq.slots_version]
        for seq in seqs:
            entry = self.rows[seq.seq_id]
            if entry[2] != seq.slots_version:
                entry[1], entry[2] = 0, seq.slots_version
            row, synced = entry[0], entry[1]
            new = seq.slots[synced:]
            rows_idx.extend([row] * len(new))
            cols.extend(range(synced, synced + len(new)))
            vals.extend(new)
            entry[1] = len(seq.slots)
        lengths = [len(s.slots) for s in seqs]
        if self.cache is not None:
            self.cache.plan_step(rows_idx, cols, vals, [self.rows[s.seq_id][0] for s in seqs], lengths,
                                 max(s.reserve for s in seqs))
            return None, None
        lmax = max(lengths)
        self._reserve(max(e[0] for e in self.rows.values()) + 1, lmax)
        if vals:
            self.table[torch.tensor(rows_idx, device=self.device), torch.tensor(cols, device=self.device)] = torch.tensor(vals, device=self.device)
        rows = torch.tensor([self.rows[s.seq_id][0] for s in seqs], device=self.device)
        index = self.table.index_select(0, rows)[:, :lmax]
        valid = torch.arange(lmax, device=self.device)[None, :] < torch.tensor(lengths, device=self.device)[:, None]
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=self.device).masked_fill_(~valid, float("-inf"))
        return index, bias[:, None, None, :]

    def forget(self, seq: Sequence) -> None:
        entry = self.rows.pop(seq.seq_id, None)
        if entry is not None:
            self.free.append(entry[0])


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, quantization: str = "none", quant_kernel: str = "auto",
                 quantize_lm_head: bool = False, decode_cache: bool = False, prepack: str | None = None,
                 cuda_graphs: bool = False, max_num_seqs: int = 256, kv_dtype: str = "auto") -> None:
        self.model = model.eval()
        use_packed_attention(self.model)
        use_inplace_mlps(self.model)
        # Linear layers swapped for quantized ones (rollout.quantization); None keeps the rollout dtype.
        self.quant: QuantizedWeights | None = None
        if quantization != "none":
            self.quant = quantize_model(self.model, quantization, quant_kernel, quantize_lm_head)
        self.weight_bytes = self.quant.weight_bytes if self.quant is not None else weights_nbytes(self.model)
        self.float_weight_bytes = self.quant.float_bytes if self.quant is not None else self.weight_bytes
        # Linear weights also packed for the decode batch's GEMMs (rollout.prepack; prepack.py): the kernel ("onednn" or
        # "mkl"); None = plain GEMMs.
        self.prepacker = Prepacker(self.model, prepack) if prepack else None
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # A 4-D mask is passed through by transformers' mask builders untouched: without one they look for packed
        # sequences in the positions with a host read (`find_packed_sequence_indices`) every forward. The packed
        # attention ignores it.
        self.no_mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(model.config)
        self.num_slots = num_slots
        # What a pool entry is stored as (rollout.kv_dtype, kv/kv_dtype.py): in the compute dtype the layers are plain
        # tensors, else `KVStore`s (int8 / fp8 codes with a scale per token and KV head, or another float dtype).
        self.kv_format: KVFormat = resolve_kv_dtype(kv_dtype, self.dtype)
        self.k_cache: list | None = None
        self.v_cache: list | None = None
        self.use_decode_cache = decode_cache
        self.table = self._new_table()
        self._released: dict[int, torch.Size] = {}  # id(parameter) -> shape, while the storage is dropped
        # Decode-only steps over static buffers (graph_step.py); None runs every step eagerly.
        self.graphs = StaticDecode(self, max_num_seqs, capture=self.device.type == "cuda") if cuda_graphs else None

    @property
    def bytes_per_slot(self) -> int:
        return entry_bytes(self.num_layers, self.num_kv_heads, self.head_dim, *self.kv_format.element_and_scale_bytes())

    def allocate(self) -> None:
        if self.k_cache is None:
            # The static decode step's padding rows write their K/V into one more slot, never handed out nor read.
            sink = self.graphs is not None
            shape = (self.num_slots + sink, self.num_kv_heads, self.head_dim)
            # On CPU the pool is not zero-filled: the pages of slots never handed out are never touched, so resident
            # memory follows the slots in use (the pool hands out low ids first) instead of the pool's worst-case size.
            # Every slot is written by the forward it is allocated for before anything reads it; the one read of
            # slots that may be unwritten is the padding of the gathered decode attention (slot 0, masked out), and
            # a masked entry must still be finite (0 x NaN is NaN), so slot 0 is zeroed.
            zero = self.device.type != "cpu"
            fmt = self.kv_format
            self.k_cache = [fmt.new_layer(shape, self.device, zero) for _ in range(self.num_layers)]
            self.v_cache = [fmt.new_layer(shape, self.device, zero) for _ in range(self.num_layers)]
            for layer in self.k_cache + self.v_cache:
                for t in entry_parts(layer):  # a quantized slot 0: codes and scale 0, dequantized to 0
                    t[0].zero_()

    def release(self) -> None:
        self.k_cache = self.v_cache = None
        self.table = self._new_table()
        if self.graphs is not None:
            self.graphs.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _new_table(self) -> SlotTable:
        cache = None
        if self.use_decode_cache:
            cache = DecodeCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        return SlotTable(self.device, cache)

    def forget(self, seq: Sequence) -> None:
        """A sequence stops decoding: its rows in the slot tables are free again."""
        self.table.forget(seq)
        if self.graphs is not None:
            self.graphs.forget(seq)

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def build_context(self, batch: ScheduledBatch, on_queries=None) -> tuple[ForwardContext, list[int], list[int], list[int]]:
        """Returns the context plus the packed input ids, positions and the rows to compute logits for."""
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        keep: list[int] = []
        for seq in batch.decode:
            ids.append(seq.output[-1])  # a decoding sequence feeds back its last sample
            pos.append(seq.num_cached)
            write.append(seq.slots[-1])
            keep.append(len(ids) - 1)
        spans = []
        for seq in batch.prefill:
            new = seq.pending
            start = len(ids)
            ids.extend(new)
            pos.extend(range(seq.num_cached, seq.num_cached + len(new)))
            write.extend(seq.slots[-len(new) :])
            keep.append(len(ids) - 1)
            spans.append(Span(start, len(ids), self._tensor(seq.slots), len(seq.slots) - len(new)))
        ctx = ForwardContext(
            spans=spans,
            n_decode=len(batch.decode),
            write_slots=self._tensor(write),
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            on_queries=on_queries,
        )
        if batch.decode:
            ctx.decode_slots, ctx.decode_bias = self.table.gather(batch.decode)
            ctx.decode_cache = self.table.cache
        return ctx, ids, pos, keep

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, on_queries=None) -> torch.Tensor:
        """Runs the batch; returns float32 logits (len(decode) + len(prefill), V) in that order."""
        ctx, ids, pos, keep = self.build_context(batch, on_queries)
        if self.prepacker is not None:
            self.prepacker.prepare(0 if batch.prefill else len(batch.decode))
        try:
            with forward_context(ctx):
                out = self.model(
                    input_ids=self._tensor(ids)[None],
                    position_ids=self._tensor(pos)[None],
                    attention_mask=self.no_mask,
                    use_cache=False,
                    logits_to_keep=self._tensor(keep),
                )
        finally:
            if self.prepacker is not None:
                self.prepacker.disarm()
        logits = out.logits[0].float()  # (rows, V)
        self.copy_forks(batch.forks)
        return logits

    def copy_forks(self, forks: list[Sequence]) -> None:
        """Siblings of a prompt copy the prefill their leader just wrote instead of recomputing it."""
        if not forks:
            return
        src = self._tensor([x for s in forks for x in s.fork_of.slots[: len(s.prompt)]])
        dst = self._tensor([x for s in forks for x in s.slots])
        for layer in self.k_cache + self.v_cache:
            for t in entry_parts(layer):  # a quantized pool's codes and scales alike
                t.index_copy_(0, dst, t.index_select(0, src))

    def release_weights(self) -> None:
        """Drop the parameters' storage while the actor trains; `load_weights` allocates it again."""
        if self.prepacker is not None:
            self.prepacker.drop()
        if self.graphs is not None:
            self.graphs.invalidate()  # the parameters move: graphs captured over them are stale
        for p in self.model.parameters():
            if p.numel():
                self._released[id(p)] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for layer in self._quant_layers():
            layer.release()

    def _quant_layers(self) -> list:
        return self.quant.all_layers() if self.quant is not None else []

    @property
    def weights_released(self) -> bool:
        return bool(self._released) or any(layer.released for layer in self._quant_layers())

    @torch.no_grad()
    def load_weights(self, named_tensors) -> int:
        """Copy full tensors into the model's parameters and buffers by name; returns how many were loaded.
        A weight of a quantized layer is quantized again from the tensor that arrives (every sync)."""
        # state_dict(keep_vars=True) lists tied weights under every name they have (lm_head / embeddings).
        params = self.model.state_dict(keep_vars=True)
        if self.graphs is not None and (self._released or self.quant is not None):
            self.graphs.invalidate()  # storage is allocated again (quantized layers: at every load)
        n = 0
        for name, tensor in named_tensors:
            layers = self.quant.modules.get(name, []) if self.quant is not None else []
            for layer in layers:
                layer.set_weight(tensor)
            target = params.get(name)
            if target is None and layers:
                n += 1
                continue
            if target is None:
                raise KeyError(f"update_weights: the rollout model has no parameter named {name!r}")
            shape = self._released.get(id(target), target.shape)
            if shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, the rollout model expects {tuple(shape)}")
            if id(target) in self._released:
                target.data = torch.empty(shape, dtype=target.dtype, device=target.device)
                del self._released[id(target)]
            target.copy_(tensor.to(device=target.device, dtype=target.dtype), non_blocking=True)
            n += 1
        return n
