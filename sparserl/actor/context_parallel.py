"""Context parallelism: one packed row split along the sequence over a `cp` process group, exact attention across
the split by ring attention. See docs/context_parallel.md for the whole design.

Layout (zigzag). Every span (one packed sequence, `model.attention.Span`) of length n is padded to the next
multiple of 2C (C = cp size) and cut into 2C chunks of c = ceil(n / 2C) rows; rank r holds chunks r and 2C-1-r of
every span, spans in packed order. A causal chunk's work grows with its index, so pairing chunk r with chunk
2C-1-r gives every rank the same causal work (exactly when no span is padded; within one chunk's worth otherwise).
Every rank holds the same number of rows, sum(2C * c) / C, so the ring buffers are all the same size.

Padding sits at the end of a span (in-span index >= n) and is masked by the attention rule below: a real query
never sees a padding key (causality keeps indices >= n out of its own span, and a prefix span's padding is
excluded explicitly). Padding queries see their own span causally, padding keys included, so every row has at
least its own key visible (no empty softmax anywhere); their outputs are garbage, never read: `shard` fills their
inputs (and so their upstream gradients) with `fill`, and `unshard` drops them.

Attention rule (per query row q, key row k, both described by span id, in-span index, validity):
    visible = (span_k == span_q and idx_k <= idx_q) or (span_k == prefix(span_q) and k is real)
which is `packed_attention`'s rule without a cache: a span with a `prefix` (a shared prompt) attends over all of
that span's rows first, then causally over itself.

Ring attention (`actor/ring_attention.py`) computes that rule across the ranks; `ZigzagPlan.block` tells it which
rows and columns of each (query rank, key rank) pair have anything visible, and builds the mask of any row range on
demand.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from sparserl.actor.ring_attention import ring_attention
from sparserl.model.attention import Span


@dataclass
class _Rows:
    """Per-row description of one rank's local rows."""

    index: torch.Tensor  # (Tl,) long: row in the packed row, -1 for padding
    span: torch.Tensor  # (Tl,) long: span id
    idx: torch.Tensor  # (Tl,) long: index inside the span (>= its length for padding)
    valid: torch.Tensor  # (Tl,) bool
    prefix: torch.Tensor  # (Tl,) long: the span's prefix span id, -1 for none


@dataclass
class _Block:
    """The visible part of one (query rank, key rank) pair: the rows / cols that have any visible entry (None: all of
    them) and their descriptions, from which `mask` builds any row range of the block's mask on demand (so no
    (rows x cols) mask is ever stored)."""

    rows: torch.Tensor | None
    cols: torch.Tensor | None
    q_span: torch.Tensor  # (rows,) long, and the same below for the selected rows / cols
    q_idx: torch.Tensor
    q_prefix: torch.Tensor
    k_span: torch.Tensor  # (cols,)
    k_idx: torch.Tensor
    k_valid: torch.Tensor

    def mask(self, a: int, b: int) -> torch.Tensor:
        """(b - a, cols) bool: the attention rule for rows [a, b) of the block."""
        qs, qi, qp = self.q_span[a:b, None], self.q_idx[a:b, None], self.q_prefix[a:b, None]
        return ((qs == self.k_span) & (self.k_idx <= qi)) | ((qp == self.k_span) & self.k_valid)


@dataclass
class ZigzagPlan:
    """The zigzag split of one packed row (see the module docstring). The same on every rank of the cp group."""

    cp: int
    starts: list[int]
    lengths: list[int]
    prefixes: list[int]  # -1: none
    total: int  # rows of the packed row
    rows: list[_Rows]  # per rank
    _inverse: torch.Tensor  # (total,) packed row -> position in the all-gathered (cp * local_len) order
    _blocks: dict = field(default_factory=dict)

    @property
    def local_len(self) -> int:
        return self.rows[0].index.shape[0]

    def chunk(self, s: int) -> int:
        return -(-self.lengths[s] // (2 * self.cp))

    # --- tensors -----------------------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, rank: int, fill: float = 0.0) -> torch.Tensor:
        """This rank's rows of a (T, ...) tensor of the packed row; padding rows hold `fill`. Differentiable."""
        assert x.shape[0] == self.total, (x.shape, self.total)
        index = self.rows[rank].index.to(x.device)
        pad = x.new_full((1, *x.shape[1:]), fill)
        return torch.cat([x, pad]).index_select(0, torch.where(index < 0, self.total, index))

    def unshard_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """(cp, local_len, ...) stacked rank shards -> the (T, ...) packed row, padding dropped. Differentiable."""
        flat = gathered.reshape(self.cp * self.local_len, *gathered.shape[2:])
        return flat.index_select(0, self._inverse.to(flat.device))

    def positions(self, rank: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Position ids (RoPE) of this rank's rows: the packed row's `position_ids` (T,) sharded, padding rows
        continuing their span's last position; without `position_ids`, positions restart at 0 in every span."""
        r = self.rows[rank]
        if position_ids is None:
            return r.idx.clone()
        lengths = torch.tensor(self.lengths, dtype=torch.long)[r.span]
        starts = torch.tensor(self.starts, dtype=torch.long)[r.span]
        last = torch.minimum(r.idx, lengths - 1)
        return position_ids.to(torch.long).cpu()[starts + last] + (r.idx - last)

    # --- attention structure -----------------------------------------------------------------------------------
    def visible(self, q_rank: int, k_rank: int) -> torch.Tensor:
        """(local_len, local_len) bool: which of `k_rank`'s rows each of `q_rank`'s rows attends to."""
        q, k = self.rows[q_rank], self.rows[k_rank]
        same = (q.span[:, None] == k.span[None]) & (k.idx[None] <= q.idx[:, None])
        pre = (q.prefix[:, None] == k.span[None]) & k.valid[None]
        return same | pre

    def block(self, q_rank: int, k_rank: int, device: torch.device) -> _Block | None:
        """The visible rows/columns of a block, cached per plan (the same for every layer, forward and backward).
        Found from per-span extremes in O(rows + spans): a query row sees something of `k_rank` when that rank holds
        a row of its span at or before it, or a real row of its prefix span; a key column is seen when `q_rank`
        holds a row of its span at or after it, or (real keys only) a row whose prefix is its span."""
        key = (q_rank, k_rank, str(device))
        if key not in self._blocks:
            q, k = self.rows[q_rank], self.rows[k_rank]
            n = len(self.lengths) + 1  # span ids, plus slot n - 1 for "no prefix" (-1)
            qp = torch.where(q.prefix < 0, n - 1, q.prefix)
            k_min = torch.full((n,), self.total + 1, dtype=torch.long).scatter_reduce(0, k.span, k.idx, "amin")
            k_real = torch.zeros(n, dtype=torch.bool).index_fill_(0, k.span[k.valid], True)
            k_real[n - 1] = False
            rows = (k_min[q.span] <= q.idx) | k_real[qp]
            if not rows.any():
                self._blocks[key] = None
            else:
                q_max = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, q.span, q.idx, "amax")
                prefixed = torch.zeros(n, dtype=torch.bool).index_fill_(0, qp, True)
                prefixed[n - 1] = False
                cols = (q_max[k.span] >= k.idx) | (prefixed[k.span] & k.valid)
                r = None if rows.all() else rows.nonzero().squeeze(1)
                c = None if cols.all() else cols.nonzero().squeeze(1)

                def pick(x, i):
                    return (x if i is None else x[i]).to(device)

                self._blocks[key] = _Block(None if r is None else r.to(device), None if c is None else c.to(device),
                                           pick(q.span, r), pick(q.idx, r), pick(q.prefix, r),
                                           pick(k.span, c), pick(k.idx, c), pick(k.valid, c))
        return self._blocks[key]

    def causal_work(self) -> list[int]:
        """Per rank: (real query, real key) pairs its queries attend to, over all key ranks."""
        out = []
        for r in range(self.cp):
            qv = self.rows[r].valid
            out.append(sum(int((self.visible(r, j) & qv[:, None] & self.rows[j].valid[None]).sum())
                           for j in range(self.cp)))
        return out


def zigzag_plan(spans: Sequence[Span] | Sequence[int], cp: int) -> ZigzagPlan:
    """The zigzag split over `cp` ranks of a packed row given by its spans (tiling [0, T) in order, no cache) or by
    plain sequence lengths (spans laid end to end)."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    starts, lengths, prefixes = [], [], []
    at = 0
    for i, sp in enumerate(spans):
        if isinstance(sp, Span):
            if sp.slots is not None:
                raise ValueError("context parallelism works on the actor's packed rows, not on cached spans")
            if sp.start != at:
                raise ValueError(f"span {i} starts at {sp.start}, expected {at}: spans must tile the row in order")
            if sp.prefix is not None and not 0 <= sp.prefix < i:
                raise ValueError(f"span {i} has prefix {sp.prefix}: a prefix must be an earlier span")
            n, pre = sp.end - sp.start, -1 if sp.prefix is None else sp.prefix
        else:
            n, pre = int(sp), -1
        if n < 0:
            raise ValueError(f"span {i} has negative length {n}")
        starts.append(at)
        lengths.append(n)
        prefixes.append(pre)
        at += n
    rows = []
    for r in range(cp):
        parts = {k: [] for k in ("index", "span", "idx", "prefix")}
        for s, (start, n) in enumerate(zip(starts, lengths)):
            c = -(-n // (2 * cp))
            for ch in (r, 2 * cp - 1 - r):
                idx = torch.arange(ch * c, (ch + 1) * c)
                parts["idx"].append(idx)
                parts["index"].append(torch.where(idx < n, start + idx, -1))
                parts["span"].append(torch.full((c,), s))
                parts["prefix"].append(torch.full((c,), prefixes[s]))
        cat = {k: torch.cat(v).long() if v else torch.zeros(0, dtype=torch.long) for k, v in parts.items()}
        rows.append(_Rows(cat["index"], cat["span"], cat["idx"], cat["index"] >= 0, cat["prefix"]))
    gathered = torch.cat([r.index for r in rows])
    where = (gathered >= 0).nonzero().squeeze(1)
    inverse = torch.empty(at, dtype=torch.long)
    inverse[gathered[where]] = where
    return ZigzagPlan(cp, starts, lengths, prefixes, at, rows, inverse)


def unshard(x: torch.Tensor, plan: ZigzagPlan, group=None) -> torch.Tensor:
    """All-gather every rank's (local_len, ...) shard and reorder: the (T, ...) packed row on every rank.
    Not differentiable (dist.all_gather)."""
    parts = [torch.empty_like(x) for _ in range(plan.cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return plan.unshard_gathered(torch.stack(parts))


# --- wiring into the actor ---------------------------------------------------------------------------------------
def check_model(config, cp: int) -> None:
    """Refuse models the ring cannot compute exactly (a `UserError`, one line): sliding-window attention, and a
    value head size different from the key's (keys and values travel stacked)."""
    from sparserl.utils.errors import UserError

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    window = getattr(text, "sliding_window", None)
    if any("sliding" in str(t) for t in layer_types) or (window and getattr(text, "use_sliding_window", True)
                                                          and not layer_types):
        raise UserError(f"parallel.cp={cp}: the model ({text.model_type}) uses sliding-window attention, which ring "
                        "attention does not implement; use parallel.cp=1")
    v_dim = getattr(text, "v_head_dim", None)
    k_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if v_dim is not None and v_dim != k_dim:
        raise UserError(f"parallel.cp={cp}: the model's value head size ({v_dim}) differs from its key head size "
                        f"({k_dim}); ring attention sends keys and values stacked; use parallel.cp=1")


@dataclass
class CPGroup:
    """This rank's place in its context-parallel group (the mesh's "cp" axis)."""

    group: object
    rank: int
    size: int


@dataclass
class CPAttention:
    """What `packed_attention` needs with context parallelism (`ForwardContext.cp`): the micro-batch's plan and the
    group; every attention layer then runs `ring_attention` on this rank's rows."""

    plan: ZigzagPlan
    group: object

    def attend(self, q, k, v, scale: float | None) -> torch.Tensor:
        return ring_attention(q, k, v, self.plan, self.group, scale)


@dataclass
class KeptRows:
    """Where the kept rows of a packed row (`keep`, the rows whose hidden state predicts a response token, in the
    log-prob order; a shared prompt's last row appears once per response) live under a plan: this rank's entries
    (`local`: its local rows, `mine`: their positions in `keep`) and how to put every rank's results back in order."""

    local: torch.Tensor  # (N_r,) long: local row of each of this rank's kept entries
    mine: torch.Tensor  # (N_r,) long: their positions in `keep`
    counts: list[int]  # N_r of every rank
    source: torch.Tensor  # (N,) long: entry j of `keep` is at source[j] of the (cp * max(counts)) gathered results


def kept_rows(plan: ZigzagPlan, keep: Sequence[int], rank: int) -> KeptRows:
    owner = torch.full((plan.total,), -1, dtype=torch.long)
    local = torch.full((plan.total,), -1, dtype=torch.long)
    for r, rows in enumerate(plan.rows):
        real = rows.valid.nonzero().squeeze(1)
        owner[rows.index[real]] = r
        local[rows.index[real]] = real
    keep_t = torch.as_tensor(list(keep), dtype=torch.long)
    owners = owner[keep_t]
    counts = [int((owners == r).sum()) for r in range(plan.cp)]
    width = max(counts) if counts else 0
    source = torch.empty(len(keep_t), dtype=torch.long)
    for r in range(plan.cp):
        at = (owners == r).nonzero().squeeze(1)
        source[at] = r * width + torch.arange(len(at))
    mine = (owners == rank).nonzero().squeeze(1)
    return KeptRows(local[keep_t[mine]], mine, counts, source)


class _GatherOwn(torch.autograd.Function):
    """All-gather (cp, width, ...) forward; backward keeps this rank's slice. Every cp rank computes the same loss
    from the gathered values, so d(loss)/d(its own rows) is exact on each rank, and the gradients of the model
    (summed over the cp ranks by FSDP2's reduce-scatter) add up to one rank's gradient without cp."""

    @staticmethod
    def forward(ctx, x, group, rank: int, size: int):
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank = rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None, None, None


def gather_kept(x: torch.Tensor, kept: KeptRows, cp: CPGroup) -> torch.Tensor:
    """This rank's per-entry results (N_r, ...) -> every kept entry's (N, ...) in `keep` order, on every cp rank.
    Differentiable: the gradient reaching this rank's entries flows back into its own forward."""
    width = max(kept.counts)
    if x.shape[0] < width:
        x = torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
    gathered = _GatherOwn.apply(x, cp.group, cp.rank, cp.size)  # (cp, width, ...)
    flat = gathered.reshape(cp.size * width, *gathered.shape[2:])
    return flat.index_select(0, kept.source.to(flat.device))
