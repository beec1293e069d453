"""Linear weights pre-packed for the decode batch (`rollout.prepack`): float32 engines on CPU.

A float32 GEMM of a decode step (M = the batch, a few dozen rows) spends a large share of its time re-packing the
weight into the BLAS's internal blocked layout, on every call. Two libraries in torch's CPU build can keep a weight
packed, and the engine holds its linear weights packed in one of them (the kernel):

- `onednn`: oneDNN's blocked weight (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`). The layout does
  not depend on M, so one packing serves every decode batch, of any size, until the weights change.
- `mkl`: MKL's packed GEMM (`cblas_sgemm_pack`, `torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`). The
  packed layout is made for one M: torch runs the packed GEMM only when the input has exactly that many rows. So a
  packing for P rows serves batches of P - max(P // 8, 4) to P rows, their input zero-padded to P rows (each output
  row of a GEMM depends only on its own input row, so the padding changes nothing but time); a batch outside that
  band is packed again for its own size (~0.1-0.2 s for SmolLM2-135M, about one decode step). A batch that shrinks
  from 64 rows to 4 as sequences finish repacks about 12 times. Under 4 rows MKL runs matrix-vector kernels that gain
  nothing from packing, and the plain GEMMs run.

Which is faster depends on the CPU, so `auto`/`on` pick by vendor (`default_kernel`): MKL's on Intel CPUs, where its
packed GEMM ran SmolLM2-135M's decode-step GEMMs faster than the plain ones (M = 4-256, an AVX-512 Xeon), and
oneDNN's elsewhere: on an AVX2 AMD EPYC, MKL's packed GEMM was slower than the plain one and oneDNN's faster
(M = 4-64; docs/performance.md, `benchmarks/prepack.py` measures all three on the machine at hand). The rule is
fixed rather than timed at start-up because the two kernels round differently (below): a choice that flipped with
the machine's load would change sampled tokens between runs of the same seed. `mkl` or `onednn` name one.

Before each forward the runner calls `prepare(rows)` with the rows of a decode-only forward (0 for a forward with
prefill rows: those keep the plain GEMMs, which are as fast at prefill's M in the thousands). Results agree with the
plain GEMM to float32 rounding: MKL's packed GEMM gave the plain one's bits in every test; oneDNN's sums in another
order (~1e-6 relative per GEMM; SmolLM2-135M's sampled log-probs against the trainer's, 32 x 48 tokens: |diff| max
4.6e-5, mean 5.0e-6, against 2.7e-5 / 2.3e-6 for the plain and MKL GEMMs). Cost: the
packed copy holds the linear weights a second time (the embeddings excepted), dropped with the engine's weights
(`release_weights`) and packed again after a sync.

With oneDNN's packing, projections that read the same input are packed as one weight (`FUSED_GROUPS`: an attention
layer's q/k/v, a gated MLP's gate/up): the first of them (the leader) runs one GEMM for all and hands each its
columns of the output. A decode step then runs 4 GEMMs per layer instead of 7 (less GEMM time per decode step at
SmolLM2-135M's shapes, docs/performance.md), and every column has the separate GEMM's bits (oneDNN sums each output over
the input features in the same order whatever the other columns are: equal bits at M = 1-64 in every check).
A follower hands out its columns only for the very input the leader just ran on (the same tensor object, and outside
inference mode unchanged since); any other input runs its own plain GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparserl.utils.errors import UserError

MIN_ROWS = 4  # below this MKL runs matrix-vector kernels and its packing gains nothing
# Sibling projections of one module that read the same input, in the order a forward calls them (the first leads).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
KERNELS = ("onednn", "mkl")
SETTINGS = ("auto", "on", "off") + KERNELS


def serves_from(packed_rows: int) -> int:
    """The fewest rows an MKL packing for `packed_rows` serves (zero-padded): within 1/8 of it, or 4 rows for small
    ones."""
    return packed_rows - max(packed_rows // 8, 4)


def available_kernels() -> list[str]:
    """The packed float32 kernels this torch build has."""
    out = []
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        out.append("onednn")
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        out.append("mkl")
    return out


def prepack_available() -> bool:
    """Does this torch have a packed float32 GEMM (oneDNN's or MKL's)?"""
    return bool(available_kernels())


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...; "" where it is not to be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_kernel(kernels: list[str] | None = None, vendor: str | None = None) -> str | None:
    """`auto`'s kernel: MKL's on Intel CPUs, oneDNN's elsewhere (the module docstring says what was measured);
    the other where this torch has only one; None where it has neither."""
    kernels = available_kernels() if kernels is None else kernels
    vendor = cpu_vendor() if vendor is None else vendor
    order = ("mkl", "onednn") if vendor == "GenuineIntel" else ("onednn", "mkl")
    return next((k for k in order if k in kernels), None)


def resolve_prepack(setting: str | bool, device: torch.device, dtype: torch.dtype, quantization: str) -> str | None:
    """`rollout.prepack` -> the kernel to pack for: None (plain GEMMs), "mkl" or "onednn" (auto / on where it applies:
    a CPU engine in float32, unquantized, torch with a packed kernel: `default_kernel`)."""
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    if setting not in SETTINGS:
        raise ValueError(f"rollout.prepack must be one of {', '.join(SETTINGS)}, not {setting!r}")
    kernels = available_kernels()
    applies = device.type == "cpu" and dtype == torch.float32 and quantization == "none" and bool(kernels)
    if setting != "auto" and setting != "off" and not applies:
        raise UserError(f"rollout.prepack={setting} needs a CPU engine in float32 without rollout.quantization and a "
                        f"torch built with oneDNN or MKL (here: {device.type}, {dtype}, quantization={quantization}, "
                        f"packed kernels: {', '.join(kernels) or 'none'}); use auto or off")
    if setting in KERNELS and setting not in kernels:
        raise UserError(f"rollout.prepack={setting}: this torch build has no {setting} packed GEMM "
                        f"(it has: {', '.join(kernels) or 'none'}); use auto")
    if setting == "off" or not applies:
        return None
    return setting if setting in KERNELS else default_kernel(kernels)


def pack_weight(weight: torch.Tensor, kernel: str, rows: int) -> torch.Tensor:
    """`weight` (out, in) packed for `kernel`: for MKL, for exactly `rows` input rows; for oneDNN, any (`rows` a hint)."""
    if kernel == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def packed_linear(x2: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  kernel: str, rows: int) -> torch.Tensor:
    """y = x2 W^T + b on a packed weight; `x2` is (rows, in) with `rows` the MKL packing's M."""
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x2, packed, weight, bias, rows)


class PackState:
    """What the packed layers read at every call: the kernel, the rows the weights are packed for (0: not packed)
    and whether the coming forward may use them. Shared by the layers and their `Prepacker`, and referencing
    neither, so a dropped model is freed at once (no reference cycle left for the garbage collector)."""

    def __init__(self) -> None:
        self.rows = 0
        self.armed = False
        self.kernel: str | None = None
        self.onednn_linear = None  # torch.ops.mkldnn._linear_pointwise.default, looked up once (kernel "onednn")

    def fits(self, rows: int) -> bool:
        if self.rows <= 0 or rows <= 0:
            return False
        if self.kernel == "onednn":
            return True  # one packing serves every M
        return rows <= self.rows and rows >= serves_from(self.rows)


def sibling_groups(model: nn.Module) -> list[list[nn.Linear]]:
    """The model's `FUSED_GROUPS` that can run as one GEMM: linear layers of one module reading inputs of one width,
    all with a bias or none."""
    groups = []
    for module in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(m, nn.Linear) for m in members) and len({m.in_features for m in members}) == 1 \
                    and len({m.bias is None for m in members}) == 1:
                groups.append(members)
    return groups


def _version(x: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference tensors (the engine's forwards) keep none: 0."""
    return 0 if x.is_inference() else x._version


class FusedGroup:
    """Sibling layers packed as one weight (oneDNN only; the module docstring). The leader's forward runs the GEMM
    and keeps its input and the outputs' column views for the followers, which take theirs once."""

    def __init__(self, sizes: list[int]) -> None:
        # No reference to the layers (they reference the group): a dropped model is freed at once, as with PackState.
        self.sizes = sizes
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.input: torch.Tensor | None = None
        self.input_version = -1
        self.outputs: list[torch.Tensor | None] = []

    def pack(self, layers: list[PackedLinear], rows: int) -> None:
        self.packed = pack_weight(torch.cat([layer.weight.detach() for layer in layers]), "onednn", rows)
        biases = [layer.bias for layer in layers]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.forget()

    def drop(self) -> None:
        self.packed = self.bias = None
        self.forget()

    def forget(self) -> None:
        self.input, self.input_version, self.outputs = None, -1, []

    def lead(self, x: torch.Tensor, linear) -> torch.Tensor:
        y = linear(x, self.packed, self.bias, "none", [], "")
        self.outputs = list(y.split(self.sizes, dim=-1))
        self.input, self.input_version = x, _version(x)
        first, self.outputs[0] = self.outputs[0], None
        return first

    def follow(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """The follower's columns of the leader's output for this input, once; None where the leader did not just
        run on this very input."""
        if x is not self.input or _version(x) != self.input_version or index >= len(self.outputs):
            return None
        out, self.outputs[index] = self.outputs[index], None
        if all(o is None for o in self.outputs):
            self.forget()
        return out


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose class was switched in place by `Prepacker` (same parameters, names and hooks); its
    forward takes the packed GEMM while the shared `PackState` is armed for its input's rows."""

    _pack_state: PackState
    _packed: torch.Tensor | None
    _group: FusedGroup | None = None
    _group_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self._pack_state
        group = self._group
        if group is not None and state.armed and group.packed is not None:
            if self._group_index == 0:
                return group.lead(x, state.onednn_linear)
            out = group.follow(self._group_index, x)
            return out if out is not None else F.linear(x, self.weight, self.bias)
        if self._packed is None or not state.armed:
            return F.linear(x, self.weight, self.bias)
        if state.kernel == "onednn":
            # Any M, any leading shape: the shortest path, as this runs ~200 times per decode step (at batch 8 the
            # Python around a GEMM is a sizeable share of the GEMM itself).
            return state.onednn_linear(x, self._packed, self.bias, "none", [], "")
        rows = x.numel() // self.in_features if x.dim() else 0
        if not state.fits(rows):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        if rows < state.rows:
            x2 = F.pad(x2, (0, 0, 0, state.rows - rows))
        y = packed_linear(x2.contiguous(), self._packed, self.weight, self.bias, state.kernel, state.rows)
        return y[:rows].view(*x.shape[:-1], self.out_features)


class Prepacker:
    """Owns the packed copies of a model's `nn.Linear` weights (see the module docstring); `kernel`: "onednn" or
    "mkl"."""

    def __init__(self, model: nn.Module, kernel: str = "mkl", fuse: bool = True) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"Prepacker: kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")
        self.state = PackState()
        self.state.kernel = kernel
        if kernel == "onednn":
            self.state.onednn_linear = torch.ops.mkldnn._linear_pointwise.default
        self.layers: list[PackedLinear] = []
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = PackedLinear
                module._pack_state, module._packed = self.state, None
                self.layers.append(module)
        # Sibling projections packed as one weight (oneDNN's layout only: MKL's needs the plain weight beside it).
        self.groups: list[tuple[FusedGroup, list[PackedLinear]]] = []
        if fuse and kernel == "onednn":
            for members in sibling_groups(model):
                if all(type(m) is PackedLinear for m in members):
                    group = FusedGroup([m.out_features for m in members])
                    for i, m in enumerate(members):
                        m._group, m._group_index = group, i
                    self.groups.append((group, members))
        self.versions: list[tuple[int, int]] = []  # each weight's (storage, version counter) when it was packed
        self.packs = 0  # times the weights were packed (stats for tests and benchmarks)
        self.packed_forwards = 0  # forwards that ran on packed weights

    @property
    def kernel(self) -> str:
        return self.state.kernel

    @property
    def rows(self) -> int:
        """The M the weights are packed for (for oneDNN only a hint); 0 = not packed."""
        return self.state.rows

    @property
    def armed(self) -> bool:
        return self.state.armed

    @property
    def nbytes(self) -> int:
        """The packed copies' size, counted as the float32 weights they hold."""
        return sum(layer.weight.numel() * 4 for layer in self.layers
                   if layer._packed is not None or (layer._group is not None and layer._group.packed is not None))

    def prepare(self, rows: int) -> None:
        """Arms the packed GEMMs for the next forward when it is `rows` decode rows (0: a forward with prefill),
        packing again when the current packing does not serve that batch or a weight changed since."""
        if rows < (1 if self.kernel == "onednn" else MIN_ROWS):
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
            if layer._group is None:
                layer._packed = pack_weight(layer.weight, self.kernel, rows)
        for group, members in self.groups:
            group.pack(members, rows)
        self.state.rows = rows
        self.versions = self._weight_versions()
        self.packs += 1

    def drop(self) -> None:
        """Free the packed copies (the engine's weights are being released, or they are stale)."""
        for layer in self.layers:
            layer._packed = None
        for group, _ in self.groups:
            group.drop()
        self.state.rows, self.state.armed, self.versions = 0, False, []

    def disarm(self) -> None:
        self.state.armed = False
        for group, _ in self.groups:
            group.forget()  # no output is held past the forward
