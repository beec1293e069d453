"""Linear weights pre-packed for the decode batch (`rollout.prepack`): float32 engines on CPU.

A float32 GEMM of a decode step (M = the batch, a few dozen rows) spends a large share of its time re-packing the
weight into MKL's internal blocked layout, on every call. MKL can keep a weight packed (`cblas_sgemm_pack`, exposed by
torch as `torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`); the packed call then skips that work. The
packed layout is made for one M: torch runs the packed GEMM only when the input has exactly that many rows, and
falls back to the plain one otherwise.

So the engine packs for the decode batch it runs. Before each forward the runner calls `prepare(rows)` with the
rows of a decode-only forward (0 for a forward with prefill rows: those keep the plain GEMMs). A packing for P rows
serves batches of P - max(P // 8, 4) to P rows, their input zero-padded to P rows (each output row of a GEMM
depends only on its own input row, so the padding changes nothing but time); a batch outside that band is packed
again for its own size (~0.1-0.2 s for SmolLM2-135M, about one decode step). A batch that shrinks from 64 rows to 4
as sequences finish repacks about 12 times. Under 4 rows MKL runs matrix-vector kernels that gain nothing from
packing, and the plain GEMMs run.

Measured on a 2-core AVX-512 Xeon (SmolLM2-135M's linear layers and LM head, fp32, back to back, exact M): 1.3-1.6x
at 4-24 rows, 1.2-1.3x at 32-256, none at 1-3. Results agree with the plain GEMM to float32 rounding (the same
kernels, a different blocking: at most a few ulps, bit-identical for most shapes). Cost: the packed copy holds the
linear weights a second time (the embeddings excepted), dropped with the engine's weights (`release_weights`) and
packed again after a sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparserl.utils.errors import UserError

MIN_ROWS = 4  # below this MKL runs matrix-vector kernels and packing gains nothing


def serves_from(packed_rows: int) -> int:
    """The fewest rows a packing for `packed_rows` serves (zero-padded): within 1/8 of it, or 4 rows for small ones."""
    return packed_rows - max(packed_rows // 8, 4)


def prepack_available() -> bool:
    """Does this torch have MKL's packed float32 GEMM?"""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def resolve_prepack(setting: str | bool, device: torch.device, dtype: torch.dtype, quantization: str) -> bool:
    """`rollout.prepack`: on | off | auto (on where it applies: a CPU engine in float32, unquantized, torch with MKL)."""
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"rollout.prepack must be auto, on or off, not {setting!r}")
    applies = device.type == "cpu" and dtype == torch.float32 and quantization == "none" and prepack_available()
    if setting == "on" and not applies:
        raise UserError(f"rollout.prepack=on needs a CPU engine in float32 without rollout.quantization and a torch "
                        f"built with MKL (here: {device.type}, {dtype}, quantization={quantization}, "
                        f"MKL {'yes' if prepack_available() else 'no'}); use auto or off")
    return setting == "on" or (setting == "auto" and applies)


class PackState:
    """What the packed layers read at every call: the rows the weights are packed for (0: not packed) and whether
    the coming forward may use them. Shared by the layers and their `Prepacker`, and referencing neither, so a
    dropped model is freed at once (no reference cycle left for the garbage collector)."""

    def __init__(self) -> None:
        self.rows = 0
        self.armed = False

    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.rows and rows >= serves_from(self.rows)


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose class was switched in place by `Prepacker` (same parameters, names and hooks); its
    forward takes the packed GEMM while the shared `PackState` is armed for its input's rows."""

    _pack_state: PackState
    _packed: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self._pack_state
        rows = x.numel() // self.in_features if x.dim() else 0
        if self._packed is None or not state.armed or not state.fits(rows):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        if rows < state.rows:
            x2 = F.pad(x2, (0, 0, 0, state.rows - rows))
        y = torch.ops.mkl._mkl_linear(x2, self._packed, self.weight, self.bias, state.rows)
        return y[:rows].view(*x.shape[:-1], self.out_features)


class Prepacker:
    """Owns the packed copies of a model's `nn.Linear` weights (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.state = PackState()
        self.layers: list[PackedLinear] = []
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = PackedLinear
                module._pack_state, module._packed = self.state, None
                self.layers.append(module)
        self.versions: list[tuple[int, int]] = []  # each weight's (storage, version counter) when it was packed
        self.packs = 0  # times the weights were packed (stats for tests and benchmarks)
        self.packed_forwards = 0  # forwards that ran on packed weights

    @property
    def rows(self) -> int:
        """The M the weights are packed for; 0 = not packed."""
        return self.state.rows

    @property
    def armed(self) -> bool:
        return self.state.armed

    @property
    def nbytes(self) -> int:
        """The packed copies' size, counted as the float32 weights they hold."""
        return sum(layer.weight.numel() * 4 for layer in self.layers if layer._packed is not None)

    def prepare(self, rows: int) -> None:
        """Arms the packed GEMMs for the next forward when it is `rows` decode rows (0: a forward with prefill),
        packing again when the current packing does not serve that batch or a weight changed since."""
        if rows < MIN_ROWS:
            self.state.armed = False
            return
        if not self.state.fits(rows) or self.versions != self._weight_versions():
            self.pack(rows)
        self.state.armed = True
        self.packed_forwards += 1

    def _weight_versions(self) -> list[tuple[int, int]]:
        return [(layer.weight.data_ptr(), layer.weight._version) for layer in self.layers]

    @torch.no_grad()
    def pack(self, rows: int) -> None:
        self.drop()
        for layer in self.layers:
            layer._packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), rows)
        self.state.rows = rows
        self.versions = self._weight_versions()
        self.packs += 1

    def drop(self) -> None:
        """Free the packed copies (the engine's weights are being released, or they are stale)."""
        for layer in self.layers:
            layer._packed = None
        self.state.rows, self.state.armed, self.versions = 0, False, []

    def disarm(self) -> None:
        self.state.armed = False
