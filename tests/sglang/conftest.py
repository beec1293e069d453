"""Fixtures for the SGLang backend tests: tiny random fp32 Llama / Qwen2 folders and one engine host per family.

The hosts are session-scoped (an SGLang start costs ~30-60 s on the CI machine) and every test that uses them
skips where sglang is not installed, so the main suite passes without it. The first test that asks for a family's
host starts every family's host the session's tests name, side by side (`EngineHost` starts without waiting), and
the modules that stop the session's hosts to run the trainer under torchrun (`STOPS_HOSTS`) run last, so each host
starts once. A module with an engine of its own registers it (`register_early`): it starts with the session's hosts
when that module's tests are selected, and the module takes it when its tests come (`take_early`).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from tests.conftest import tiny_config
from tests.sglang.host import HAVE_SGLANG, SKIP_REASON, EngineHost

FAMILIES = ("llama", "qwen2")
_HOSTS: dict[str, EngineHost] = {}
_EARLY_FACTORIES: dict[str, Callable[[dict], EngineHost]] = {}  # test module file name -> factory(tiny_dirs)
_EARLY: dict[str, EngineHost] = {}  # started, not yet taken by their module
STOPS_HOSTS = ("test_tp_sglang.py", "test_trainer_sglang.py")  # modules that call close_hosts() first


def pytest_collection_modifyitems(session, config, items):
    """The modules that stop the session's hosts go last (a stable sort: the order within each part is kept)."""
    items.sort(key=lambda item: item.path.name in STOPS_HOSTS)


def build_tiny(family: str, tokenizer, seed: int = 0):
    """A tiny random fp32 decoder over the real SmolLM2 vocabulary (so SGLang can load the tokenizer with it)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, vocab=len(tokenizer))
    cfg.update(dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizer):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        build_tiny(family, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[family] = path
    return out


def host_options(**changes):
    from sparserl.engines.sglang.engine import SGLangOptions

    base = dict(device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=8192,
                max_running_requests=64, chunked_prefill_size=4096, log_level="error")
    base.update(changes)
    return SGLangOptions(**base)


@pytest.fixture(scope="session")
def hosts(tiny_dirs, request):
    """`hosts(family)`: the session's engine host for that tiny model, started on first use together with the other
    families' hosts that the session's tests name (their ids carry the family: `[qwen2]`)."""
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    named = [f for f in FAMILIES if any(f"[{f}" in item.nodeid or f"-{f}]" in item.nodeid
                                        for item in request.session.items)]

    def get(family: str) -> EngineHost:
        for f in [family] + named:
            if f not in _HOSTS:
                _HOSTS[f] = EngineHost(tiny_dirs[f], host_options(), seed=0)
        return _HOSTS[family]

    start_early(tiny_dirs, request.session.items)
    yield get
    close_hosts()
    while _EARLY:
        _EARLY.popitem()[1].close()


def register_early(module: str, factory: Callable[[dict], EngineHost]) -> None:
    """`module`'s own engine (factory(tiny_dirs)) starts beside the session's hosts when any of its tests is selected."""
    _EARLY_FACTORIES[module] = factory


def start_early(tiny_dirs, items) -> None:
    for module, factory in _EARLY_FACTORIES.items():
        if module not in _EARLY and any(item.path.name == module for item in items):
            _EARLY[module] = factory(tiny_dirs)


def take_early(module: str, tiny_dirs) -> EngineHost:
    """The module's own engine: the one started early, else started now."""
    host = _EARLY.pop(module, None)
    return host if host is not None else _EARLY_FACTORIES[module](tiny_dirs)


def close_hosts() -> None:
    """Stop every session host (the trainer test frees their memory and cores first)."""
    while _HOSTS:
        _HOSTS.popitem()[1].close()


@pytest.fixture(scope="session")
def reference_models(tokenizer):
    """The same tiny models in transformers, in fp32, for the dense references."""
    return {family: build_tiny(family, tokenizer) for family in FAMILIES}
