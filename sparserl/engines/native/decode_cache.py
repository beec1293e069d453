"""A per-sequence contiguous copy of the decoding sequences' keys/values (`rollout.decode_cache`).

The KV pool stores entries at scattered slots (one pool for all sequences; compression frees slots in place),
so batched decode attention has to gather every sequence's keys/values through its slot list at every step
and layer. On a CPU that gather is most of the decode attention's time at large batches (benchmarks/
decode_attention.py: at batch 64 the gather alone costs more than SDPA over contiguous keys/values). This cache
keeps, per layer, a (rows, H_kv, width, D) copy of each decoding sequence's entries, row = the sequence's row
in the `SlotTable`, updated by appends: a decode step copies one new entry per sequence (the token it writes
in this forward), a prefill or a compaction (slots_version bump) re-copies that sequence's row from the pool.
The pool stays the source of truth (compression scores and compacts there; forks copy there). The copy holds
entries as the pool's accessor reads them (sparserl/kv/kv_dtype.py): an int8 / fp8 pool's dequantized, in the
compute dtype, so each entry is dequantized once, when it is copied in, not at every step.

Memory: the copy holds the decoding sequences' entries a second time, padded to the longest (its width in
multiples of 64 entries, sized for what the decoding sequences can reach when that is within 2x of the need:
`reserve`). Measured on this project's 2-core CPU (SmolLM2-135M fp32, batch 64, 128 new tokens, `python
benchmarks/rollout_throughput.py --engine native native:cache --batch 64`): more decode throughput, for the
entries held twice at the rollout's peak in a one-process GRPO step, where it moved the step's peak from the update
to the rollout (docs/performance.md). KV memory is what sparse rollouts exist to save, so the default is `off`; `auto` turns it on for
CPU engines only (on CUDA the gather is cheap).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparserl.kv.kv_dtype import read_entries


@dataclass
class DecodePlan:
    """What one forward's decode attention needs: the entries to copy in, and where the queries go."""

    sync_rows: torch.Tensor  # (N,) row of each new entry
    sync_cols: torch.Tensor  # (N,) its position in the row
    sync_slots: torch.Tensor  # (N,) its slot in the pool
    rows: torch.Tensor  # (Bd,) each decode query's row
    num_rows: int  # attention runs over rows [0, num_rows) when `dense_rows`, else over `rows` gathered
    dense_rows: bool
    bias: torch.Tensor  # (num_rows or Bd, 1, 1, Lmax) 0 valid, -inf padding
    width: int  # Lmax
    # With `dense_rows`: attention runs block by block over rows [start, end), each `width` entries wide (the
    # longest row of the block), instead of every row padded to Lmax.
    blocks: list[tuple[int, int, int]] | None = None


BLOCK_ROWS = 16  # rows per attention call over the contiguous rows (dense_rows)


def row_blocks(lengths: list[int], block: int = BLOCK_ROWS) -> list[tuple[int, int, int]]:
    """(start, end, width) for consecutive blocks of `block` rows, each as wide as its longest row."""
    return [(r0, min(r0 + block, len(lengths)), max(lengths[r0:r0 + block])) for r0 in range(0, len(lengths), block)]


class DecodeCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.plan: DecodePlan | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reserve(self, rows: int, width: int, reach: int = 0) -> None:
        """Grow (never shrink) to at least `rows` x `width`, keeping what is there. `reach`: the longest any decoding
        sequence can grow (its reserved slots), which a growth may size for at once (below)."""
        have_rows, have_width = (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)
        if rows <= have_rows and width <= have_width:
            return
        # A growth re-allocates and copies every layer's keys and values (~0.75 GB at batch 64 x 256 entries for
        # SmolLM2-135M), so it should come rarely. Widths are multiples of 64 entries; a growth takes the width the
        # decoding sequences can still reach when that is at most twice what is needed now (a rollout's sequences
        # reserve prompt + max_new_tokens, or their compression bound: one allocation for the whole rollout), else
        # twice the width it has (a few growths for long budgets, and never more than the sequences can reach).
        rows = have_rows if rows <= have_rows else -(-rows // 8) * 8
        if width > have_width:
            need = -(-width // 64) * 64
            reach = -(-max(reach, need) // 64) * 64
            width = reach if reach <= 2 * need else max(need, min(2 * have_width, reach))
        else:
            width = have_width
        shape = (rows, self.num_kv_heads, width, self.head_dim)
        for store in (self.k, self.v):
            for i in range(self.num_layers):
                # Every entry is written once: the old block copied, the rest zeroed (padding is read, masked, and
                # must be finite), instead of zero-filling the whole tensor and then copying over it.
                grown = torch.empty(shape, dtype=self.dtype, device=self.device)
                if store and i < len(store):
                    old = store[i]
                    r, w = old.shape[0], old.shape[2]
                    grown[:r, :, :w] = old
                    grown[:r, :, w:].zero_()
                    grown[r:].zero_()
                    store[i] = grown
                else:
                    store.append(grown.zero_())

    def plan_step(self, rows_idx: list[int], cols: list[int], slots: list[int], rows: list[int], lengths: list[int],
                  reach: int = 0) -> DecodePlan:
        """Called once per forward by the slot table: `rows_idx/cols/slots` are the entries new since the last
        step (the decode tokens' own slots included: they are written by this forward before attention); `reach`
        the most entries any of these sequences can come to hold."""
        dev = self.device
        lmax = max(lengths)
        top = max(rows) + 1
        self.reserve(top, lmax, reach)
        # Attend over the contiguous rows [0, top) when most of them decode now (finished rows are idle: their
        # outputs are dropped), else copy out just the decoding rows.
        dense_rows = 2 * len(rows) >= top
        row_t = torch.tensor(rows, device=dev)
        blocks = None
        if dense_rows:
            full = [1] * top  # idle rows: one visible entry, no NaN
            for r, n in zip(rows, lengths):
                full[r] = n
            lengths = full
            blocks = row_blocks(full, BLOCK_ROWS)
        length_t = torch.tensor(lengths, device=dev)
        valid = torch.arange(lmax, device=dev)[None, :] < length_t[:, None]
        bias = torch.zeros(valid.shape, dtype=self.dtype, device=dev).masked_fill_(~valid, float("-inf"))
        self.plan = DecodePlan(torch.tensor(rows_idx, device=dev), torch.tensor(cols, device=dev),
                               torch.tensor(slots, device=dev), row_t, top, dense_rows, bias[:, None, None, :], lmax,
                               blocks)
        return self.plan

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """Decode attention of `q` (Bd, H, D) over the cached rows, after copying this step's new entries in."""
        p = self.plan
        k_rows, v_rows = self.k[layer], self.v[layer]
        if p.sync_slots.numel():
            k_rows[p.sync_rows, :, p.sync_cols] = read_entries(k_cache, p.sync_slots)
            v_rows[p.sync_rows, :, p.sync_cols] = read_entries(v_cache, p.sync_slots)
        bd, H, D = q.shape
        hkv = self.num_kv_heads
        qg = q.view(bd, hkv, H // hkv, D).to(self.dtype)
        if p.dense_rows:
            q_all = qg.new_zeros((p.num_rows, hkv, H // hkv, D)).index_copy_(0, p.rows, qg)
            outs = [F.scaled_dot_product_attention(q_all[r0:r1], k_rows[r0:r1, :, :w], v_rows[r0:r1, :, :w],
                                                   attn_mask=p.bias[r0:r1, :, :, :w], scale=scaling)
                    for r0, r1, w in p.blocks]
            out = (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, p.rows)
        else:
            k = k_rows.index_select(0, p.rows)[:, :, : p.width]
            v = v_rows.index_select(0, p.rows)[:, :, : p.width]
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=p.bias, scale=scaling)
        return out.reshape(bd, H, D).to(q.dtype)


def resolve_decode_cache(setting: str | bool, device: torch.device) -> bool:
    """`rollout.decode_cache`: on | off | auto (on for CPU engines, off on accelerators)."""
    if isinstance(setting, bool):
        return setting
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"rollout.decode_cache must be auto, on or off, not {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cpu")
