"""Rollout engines by name: `build_engine(name, **kwargs)` builds `native`, `sglang` or an engine a user added with
`@register_engine(name)` (a builder that takes the keyword arguments and returns a `RolloutEngine`).

The built-in engines do not register themselves: this module imports the one asked for when it is first built
(so the CPU install never imports sglang), and nothing else imports this module back, so the engines and their
registry form no import cycle. A name a user registers wins over a built-in one of the same name.
"""
from __future__ import annotations

from typing import Any, Callable

from sparserl.engines.protocol import RolloutEngine

Builder = Callable[..., RolloutEngine]

_ENGINES: dict[str, Builder] = {}
BUILTIN = ("native", "sglang")


def register_engine(name: str) -> Callable[[Builder], Builder]:
    def deco(builder: Builder) -> Builder:
        _ENGINES[name] = builder
        return builder

    return deco


def _builtin(name: str) -> Builder | None:
    if name == "native":
        from sparserl.engines.native.engine import build_native_engine

        return build_native_engine
    if name == "sglang":
        from sparserl.engines.sglang.engine import build_sglang_engine

        return build_sglang_engine
    return None


def build_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine registered as `name` (`native`, `sglang`, or one registered by the user)."""
    builder = _ENGINES.get(name) or _builtin(name)
    if builder is None:
        raise ValueError(f"rollout.engine={name!r} is not a known engine; choose one of {sorted({*_ENGINES, *BUILTIN})}")
    return builder(**kwargs)
