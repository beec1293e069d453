"""Quantized sampler weights for the native engine (`rollout.quantization`, Flash-RL style rollouts).

The engine's `nn.Linear` layers are replaced by `QuantLinear`, which keeps only the quantized weight and its
scales and re-quantizes every time weights arrive (`set_weight`: the initial load and every weight sync).
Embeddings, norms and (unless `quantize_lm_head`) the LM head stay in the rollout dtype.

Schemes, all symmetric with one scale per output channel (row of the weight):

- `int8`: weight-only. q = round(w / s), s = max|w_row| / 127, so each dequantized entry is within s / 2 of
  w. Kernels: `fused` is torch's int8 weight-only matmul (`torch._weight_int8pack_mm`); on CPU its float32
  path is a reference loop (far slower than a float32 matmul on AVX2), so float32 activations are rounded
  to bf16 for it (that rounding is part of the measured mismatch). `dequant` multiplies the int8 weight
  back into the activation dtype for each matmul (exact int8-weight semantics, no kernel needed). `auto`
  takes `fused` wherever the kernel runs and `dequant` elsewhere.
- `w8a8`: int8 weights and dynamic per-token int8 activations through `torch._int_mm` (int32
  accumulation). CUDA only: on CPU torch's int8 x int8 matmul is a slow reference kernel.
- `fp8`: e4m3 weights (s = max|w_row| / 448), dequantized per matmul. CUDA only (what Flash-RL uses on
  GPUs; it saves weight memory, the speed of fp8 GEMMs is left out).

Left out on purpose: group-wise scales, int4, quantized KV caches, and fp8 activations (`torch._scaled_mm`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparserl.utils.errors import UserError

SCHEMES = ("none", "int8", "w8a8", "fp8")
KERNELS = ("auto", "fused", "dequant")
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12  # scale floor: an all-zero row quantizes to zeros instead of NaN


def check_scheme(scheme: str, device: torch.device) -> None:
    """One-line UserError naming `rollout.quantization` when `scheme` cannot run (fast) on `device`."""
    if scheme not in SCHEMES:
        raise UserError(f"rollout.quantization={scheme}: must be one of {', '.join(SCHEMES)}")
    if scheme in ("w8a8", "fp8") and device.type != "cuda":
        why = ("torch has no fast int8 x int8 matmul on CPU (torch._int_mm is a reference loop, slower than float32); "
               "use rollout.quantization=int8 (weight-only)") if scheme == "w8a8" else \
              "fp8 weights need a GPU; on CPU use rollout.quantization=int8"
        raise UserError(f"rollout.quantization={scheme} is not supported on {device.type}: {why}")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K) and float32 scales (N,): symmetric, per output channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(_TINY)  # (N,)
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> float8_e4m3fn (N, K) and float32 scales (N,)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (M, K) -> int8 (M, K), float32 scales (M, 1)."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min(_TINY)
    return torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def fused_int8_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Does `torch._weight_int8pack_mm` accept activations of `dtype` on `device`? (a tiny trial call)"""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    try:
        x = torch.zeros(1, 32, dtype=dtype, device=device)
        torch._weight_int8pack_mm(x, torch.zeros(8, 32, dtype=torch.int8, device=device), torch.ones(8, dtype=dtype, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def fused_act_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the fused int8 kernel runs in: the rollout dtype, except float32 on CPU (bf16)."""
    return torch.bfloat16 if (device.type == "cpu" and dtype == torch.float32) else dtype


def resolve_kernel(kernel: str, scheme: str, device: torch.device, dtype: torch.dtype) -> str:
    """The int8 kernel `auto` stands for on this device and dtype; other schemes have one kernel each."""
    if kernel not in KERNELS:
        raise ValueError(f"quant kernel {kernel!r}: must be one of {', '.join(KERNELS)}")
    if scheme != "int8":
        return scheme
    if kernel == "auto":
        return "fused" if fused_int8_runs(device, fused_act_dtype(device, dtype)) else "dequant"
    return kernel


class QuantLinear(torch.nn.Module):
    """A linear layer holding quantized weights; `set_weight(w)` (re-)quantizes a float weight into it."""

    def __init__(self, in_features: int, out_features: int, bias: torch.nn.Parameter | None, kernel: str,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel  # fused | dequant (int8), w8a8, fp8
        self.dtype = dtype  # the rollout dtype: what comes in and goes out
        self.bias = bias
        wdtype = torch.float8_e4m3fn if kernel == "fp8" else torch.int8
        self.register_buffer("qweight", torch.empty(0, dtype=wdtype, device=device), persistent=False)
        self.register_buffer("scale", torch.empty(0, dtype=torch.float32, device=device), persistent=False)
        self._kscale: torch.Tensor | None = None  # the scales in the fused kernel's activation dtype

    @property
    def released(self) -> bool:
        return self.qweight.numel() == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the loaded weight (int8/fp8 entries + float32 scales), bias not included."""
        return self.out_features * self.in_features * 1 + self.out_features * 4

    @torch.no_grad()
    def set_weight(self, w: torch.Tensor) -> None:
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized linear expects a weight of shape {(self.out_features, self.in_features)}, got {tuple(w.shape)}")
        w = w.to(self.qweight.device)
        q, s = quantize_fp8(w) if self.kernel == "fp8" else quantize_int8(w)
        self.qweight, self.scale = q, s
        self._kscale = s.to(fused_act_dtype(s.device, self.dtype)) if self.kernel == "fused" else None

    def release(self) -> None:
        self.qweight = self.qweight.new_empty(0)
        self.scale = self.scale.new_empty(0)
        self._kscale = None

    def dequantized(self) -> torch.Tensor:
        """The float32 (N, K) weight this layer multiplies by."""
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.kernel == "fused":
            y = torch._weight_int8pack_mm(x2.to(self._kscale.dtype), self.qweight, self._kscale).to(x.dtype)
        elif self.kernel == "w8a8":
            y = _w8a8_matmul(x2, self.qweight, self.scale).to(x.dtype)
        else:  # dequant (int8) and fp8: weight back in the activation dtype, one matmul
            y = F.linear(x2, self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def _w8a8_matmul(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    xq, x_scale = quantize_rows_int8(x)  # (M, K), (M, 1)
    m = xq.shape[0]
    if m <= 16:  # _int_mm needs more than 16 rows
        xq = torch.cat([xq, xq.new_zeros(17 - m, xq.shape[1])])
    # The second operand is the transposed view of the row-major (N, K) weight. A contiguous (K, N) copy is what
    # cuBLASLt refused on an H200 (torch 2.11, CUDA 13: CUBLAS_STATUS_NOT_SUPPORTED below 32 rows, docs/gpu.md).
    acc = torch._int_mm(xq, q.t())[:m]  # (M, N) int32
    return acc.float() * x_scale * w_scale[None, :]


@dataclass
class QuantizedWeights:
    """What `quantize_model` did: the replaced layers by weight name, and the bytes of the engine's weights."""

    modules: dict[str, list[QuantLinear]]  # weight name -> the layers fed by it (a tied head: also the embedding's name)
    kernel: str
    weight_bytes: int  # what the engine's weights take now (quantized + the float rest)
    float_bytes: int  # what they took in the rollout dtype

    def all_layers(self) -> list[QuantLinear]:
        return list({id(m): m for ms in self.modules.values() for m in ms}.values())


def quantize_model(model: torch.nn.Module, scheme: str, kernel: str = "auto", quantize_lm_head: bool = False) -> QuantizedWeights:
    """Replace the model's linear layers (the LM head only if asked) by `QuantLinear`s holding its current
    weights, quantized; returns the map from weight names to the layers that a weight sync must re-quantize."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    check_scheme(scheme, device)
    float_bytes = weights_nbytes(model)
    kernel = resolve_kernel(kernel, scheme, device, dtype)
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    names = {id(m): n for n, m in model.named_modules()}
    modules: dict[str, list[QuantLinear]] = {}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, torch.nn.Linear) or (mod is head and not quantize_lm_head):
            continue
        if kernel == "w8a8" and (mod.in_features % 8 or mod.out_features % 8):
            continue  # _int_mm needs multiples of 8; such a layer stays in the rollout dtype
        ql = QuantLinear(mod.in_features, mod.out_features, mod.bias, kernel, dtype, device)
        ql.set_weight(mod.weight.detach())
        keys = [f"{name}.weight"]
        if mod is head and tied:  # a sync may send the shared tensor under the embedding's name only
            keys.append(f"{names[id(embed)]}.weight")
        for key in keys:
            modules.setdefault(key, []).append(ql)
        _replace(model, names[id(mod)], ql)
    quantized = QuantizedWeights(modules, kernel, 0, float_bytes)
    quantized.weight_bytes = weights_nbytes(model) + sum(m.nbytes for m in quantized.all_layers())
    return quantized


def weights_nbytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and float buffers (tied tensors once); `QuantLinear` layers not included."""
    buffers = [b for m in model.modules() if not isinstance(m, QuantLinear) for b in m.buffers(recurse=False)]
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for b in buffers if b.is_floating_point()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
