"""Decode attention of the static decode step (graph_step.py): each row's query over the slots of its table row.

`StaticDecodeAttention` is the `DecodeAttention` the static step plugs into `ForwardContext.decode_cache`. Once per
step, before the layers run, `prepare` takes the step's (B, W) slot table (the rows of this batch, already
gathered) and the (B,) lengths, both device tensors; every layer then attends with them:

- on CUDA with triton (and a head size it takes), `sparserl.kernels.paged_decode.paged_decode_attention` reads the
  pool through the table (no padded copy; a length-0 padding row gives zeros);
- elsewhere, the table's slots are gathered and attended with SDPA under an additive bias built on the device
  from the lengths, the query heads of one KV head as SDPA's query rows (GQA without expanding K/V), as the
  runner's eager `_decode_attention` does. Padding rows (length 0) attend over their table's first entry
  (slot 0, zeroed by the runner), so that they stay finite.

Nothing here reads a device value on the host, so both paths can be captured in a CUDA graph.
Left out on purpose: more than one query per row (prefill goes through the eager path), per-head lengths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _kernel_usable(device: torch.device, head_dim: int) -> bool:
    """CUDA, triton, and a head size the kernel takes (a power of two in [16, 256])."""
    try:
        from sparserl.kernels import paged_decode
    except ImportError:  # pragma: no cover - the module ships with the package; triton inside it is optional
        return False
    pow2 = head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256
    return device.type == "cuda" and pow2 and paged_decode.kernel_available(device)


class StaticDecodeAttention:
    def __init__(self, device: torch.device, head_dim: int, use_kernel: bool | None = None) -> None:
        self.use_kernel = _kernel_usable(device, head_dim) if use_kernel is None else use_kernel
        self.table: torch.Tensor | None = None  # (B, W) slots of this step's rows
        self.lengths: torch.Tensor | None = None  # (B,) entries per row
        self.bias: torch.Tensor | None = None  # (B, 1, 1, W) 0 / -inf, the SDPA path only
        self._fn = None

    def prepare(self, table: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype) -> None:
        """This step's table (B, W) and lengths (B,); for SDPA also its bias, in the pool's `dtype`."""
        self.table, self.lengths = table, lengths
        if self.use_kernel:
            if self._fn is None:
                from sparserl.kernels.paged_decode import paged_decode_attention

                self._fn = paged_decode_attention
            self.bias = None
            return
        width = table.shape[1]
        valid = torch.arange(width, device=table.device)[None, :] < lengths.clamp(min=1)[:, None]
        bias = torch.zeros(valid.shape, dtype=dtype, device=table.device).masked_fill_(~valid, float("-inf"))
        self.bias = bias[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """q (B, H, D) -> (B, H, D), each row over its table row's first `length` slots of this layer's pool."""
        if self.use_kernel:
            return self._fn(q, k_cache, v_cache, self.table, self.lengths, scaling)
        b, H, D = q.shape
        idx = self.table.reshape(-1)
        L = self.table.shape[1]
        k = k_cache.index_select(0, idx).view(b, L, -1, D).transpose(1, 2)  # (B, H_kv, L, D)
        v = v_cache.index_select(0, idx).view(b, L, -1, D).transpose(1, 2)
        hkv = k.shape[1]
        qg = q.view(b, hkv, H // hkv, D).to(k.dtype)  # (B, H_kv, G, D): the query heads of one KV head together
        bias = self.bias if self.bias.dtype == k.dtype else self.bias.to(k.dtype)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scaling)
        return out.reshape(b, H, D).to(q.dtype)
