"""CPU test harness only: a stand-in for `sgl_kernel` on CPUs that have no build of it.

SGLang's CPU path (`SGLANG_USE_CPU_ENGINE=1`) imports a few `sgl_kernel` names at import time, but PyPI
ships only CUDA builds of sgl-kernel (their .so files need libcuda), and the CPU build, which exists only
as source, targets AVX512-BF16/AMX. For the dense decoders the tests run, SGLang imports these names and
never calls them (its torch_native attention and plain-torch fallbacks do the work). This module therefore
hands out, for any name, a function that raises when called, naming the kernel: if a code path ever does
need one, the failure says which.

`scripts/install_sglang_cpu.sh` copies this package into the CPU test venv. It is never installed on GPU,
where `pip install -e ".[sglang]"` brings the real sgl-kernel.
"""
from __future__ import annotations

__version__ = "0.0.0+sparserl.cpu.stand.in"
IS_STAND_IN = True


class MissingKernel(NotImplementedError):
    pass


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise MissingKernel(
            f"sgl_kernel.{name} was called, but this is sparserl's CPU test stand-in for sgl_kernel, which has no "
            "kernels; this SGLang code path needs the real sgl-kernel"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):  # keep Python's module protocol (e.g. __path__ probes) honest
        raise AttributeError(name)
    fn = _missing(name)
    globals()[name] = fn
    return fn
