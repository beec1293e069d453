"""Which logged metrics are read off a histogram, for every run-against-run comparison (CP, TP, goldens, precision).

A tail quantile of xi (`mismatch/xi_p01`, `mismatch/xi_p05`, `sampler/xi_p01`, `sampler/xi_p05`, and
`kv/budget_tail`, which is one of them) is read off a histogram of log xi with bins of 0.002
(`sparserl/algo/correction.py`). Two runs that agree to the last bits can still put one token on either side of a bin
edge, and the quantile then moves by up to one bin: ~0.2% of xi. A CPU with other kernels (AVX-512 against AVX2,
native bf16 or not) moves the last bits, so such a comparison allows one bin for these keys and keeps its own
tolerance for every other one. Keys added later that are read off a histogram belong here, and nowhere else.
"""
from __future__ import annotations

import re

# One bin of the log-xi histogram (0.002 in log xi) as a relative change of xi, with room for the interpolation.
HISTOGRAM_BIN_REL = 3e-3

# A key is a histogram read when it ends in a percentile (`*_p01`, `*_p05`, any `_pNN`), or it is a copy of one.
_PERCENTILE = re.compile(r"_p\d\d$")
_COPIES = ("kv/budget_tail",)


def is_histogram_read(key: str) -> bool:
    return key in _COPIES or _PERCENTILE.search(key) is not None


def tolerance(key: str, rel: float) -> float:
    """The relative tolerance a run-against-run comparison allows for `key`: one bin for a histogram read, else `rel`."""
    return max(HISTOGRAM_BIN_REL, rel) if is_histogram_read(key) else rel


def differences(ref: dict, got: dict, keys, rel: float, floor: float = 1.0) -> dict[str, tuple[float, float]]:
    """The keys whose values differ by more than `tolerance(key, rel)` relative to max(|ref|, |got|, floor)."""
    return {k: (ref[k], got[k]) for k in keys
            if abs(ref[k] - got[k]) > tolerance(k, rel) * max(abs(ref[k]), abs(got[k]), floor)}
