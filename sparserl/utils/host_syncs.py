"""Count device-to-host synchronizations in a block of code (a test and debugging tool).

A device-to-host read (`.item()`, `bool(t)`, `int(t)`, `.tolist()`, a copy to the CPU) blocks the host until
the device has caught up, which stalls the launch queue: in a per-token loop (the samplers, the LM-head
chunks of the actor, the KV compaction bookkeeping) one such read per call costs more than the kernels.

`HostSyncs` counts, while active:
- `aten._local_scalar_dense` (what `.item()`, `bool()`, `int()`, `float()` of a tensor dispatch to);
- copies from a non-CPU device to the CPU (`aten._to_copy` / `aten.copy_`);
- `Tensor.tolist()` and `Tensor.numpy()` calls, which never reach the dispatcher; they are counted whatever
  the tensor's device, so on a CPU-only machine the count is an upper bound of what a GPU run would sync.
`events` lists what was counted, in order. Not thread-safe: count in one thread at a time.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = "aten._local_scalar_dense"
_COPIES = ("aten._to_copy", "aten.copy_")


class HostSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self._saved: dict[str, object] = {}

    @property
    def count(self) -> int:
        return len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        name = name if name.startswith("aten.") else f"aten.{name}"
        if name == _SCALAR:
            self.events.append("item")
        elif name in _COPIES and _to_host(name, args, kwargs):
            self.events.append("copy to cpu")
        return func(*args, **kwargs)

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(t, *a, _original=original, _method=method, **kw):
                self.events.append(_method)
                return _original(t, *a, **kw)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)


def _to_host(name: str, args, kwargs) -> bool:
    if name == "aten._to_copy":
        src, dst = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    dst, src = args[0], args[1]
    return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
