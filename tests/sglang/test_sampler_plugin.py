"""sparserl's SGLang sampler without an engine: the batch's settings follow SGLang's batch changes (build, filter,
merge, the overlap scheduler's forward copy), and a sampling step reads them without host syncs.

The step runs in this process on CPU with SGLang's own logprob processor; `torch.tensor` / `torch.as_tensor`
(from lists), `.tolist()`, `.item()` and `nonzero` are patched to count calls, and `HostSyncs` counts what
reaches the dispatcher. The engine tests (test_sampling.py, test_parity.py) run the same code inside SGLang.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from tests.sglang.host import HAVE_SGLANG, SKIP_REASON

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON)
V = 50


@pytest.fixture(scope="module")
def plugin():
    import os

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sparserl.engines.sglang import sampler_plugin

    return sampler_plugin


def _req(seed=None, temperature=1.0, top_p=1.0, top_k=0, sglang_top_k=1 << 30):
    custom = None if seed is None else {"sparserl": [seed, temperature, top_p, top_k]}
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom, temperature=temperature, top_p=top_p,
                                                           top_k=sglang_top_k))


def _info(plugin, reqs):
    info = SimpleNamespace(device="cpu", sampling_mask_batch_indices=None, grammars=None,
                           has_custom_logit_processor=False)
    plugin._after_from_schedule_batch(None, info, SimpleNamespace(reqs=reqs), V)
    return info


def _rows(info, plugin):
    return [list(r) for r in getattr(info, plugin.ROWS).rows]


def _same(a, b):
    for name in ("temperature", "top_p", "top_k", "seeds"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.all_greedy, a.truncate, a.any_greedy, a.shared_temperature) == \
           (b.all_greedy, b.truncate, b.any_greedy, b.shared_temperature)


def test_settings_follow_build_filter_merge_and_the_forward_copy(plugin):
    from sparserl.engines import draw

    a = _info(plugin, [_req(11, 0.7, 0.9, 5), _req(12, 0.0), _req(13, 1.0, 1.0, 0)])
    b = _info(plugin, [_req(14, 0.7), _req(15, 1.3, 0.5, 0)])
    _same(getattr(a, plugin.ROWS).settings, draw.RowSettings.from_rows(_rows(a, plugin), "cpu"))
    expected = _rows(a, plugin) + _rows(b, plugin)
    plugin._after_merge_batch(None, a, b)
    _same(getattr(a, plugin.ROWS).settings, draw.RowSettings.from_rows(expected, "cpu"))
    keep = [0, 2, 4]
    plugin._after_filter_batch(None, a, keep, torch.tensor(keep))
    kept = [expected[i] for i in keep]
    assert _rows(a, plugin) == kept
    _same(getattr(a, plugin.ROWS).settings, draw.RowSettings.from_rows(kept, "cpu"))
    setattr(a, plugin.LOGICAL_POSITIONS, torch.arange(3))
    copy = plugin._after_copy_for_forward(SimpleNamespace(), a)
    assert getattr(copy, plugin.ROWS) is getattr(a, plugin.ROWS)
    assert getattr(copy, plugin.LOGICAL_POSITIONS) is getattr(a, plugin.LOGICAL_POSITIONS)


def test_a_foreign_request_uses_its_sglang_settings_and_a_random_seed(plugin):
    info = _info(plugin, [_req(None, 0.5, 0.8, sglang_top_k=1 << 30), _req(None, 1.0, 1.0, sglang_top_k=7)])
    (s0, t0, p0, k0), (_, _, _, k1) = _rows(info, plugin)
    assert (t0, p0, k0, k1) == (0.5, pytest.approx(0.8), 0, 7) and 0 <= s0 < 2**62


def test_hooks_match_sglang_signatures_and_are_registered(plugin, monkeypatch):
    from sglang.srt.layers import sampler as sglang_sampler
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    params = {"adjusted_from_schedule_batch": ["self", "batch", "vocab_size"],
              "adjusted_filter_batch": ["self", "keep_indices", "keep_indices_device"],
              "adjusted_merge_batch": ["self", "other"], "copy_for_forward": ["self"]}
    for name, expected in params.items():
        assert list(inspect.signature(getattr(SamplingBatchInfo, name)).parameters) == expected, name
    registered = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, hook, kind: registered.append(target)))
    monkeypatch.setattr(sglang_sampler, "_CUSTOM_SAMPLER_FACTORIES", {})
    monkeypatch.setattr(plugin, "register_sampler_backend", lambda b, f: sglang_sampler._CUSTOM_SAMPLER_FACTORIES.update({b: f}))
    monkeypatch.setenv(plugin.SAMPLER_ENV_FLAG, "1")
    plugin.register()
    assert sorted(t.rsplit(".", 1)[1] for t in registered) == sorted(params)


class _Counted:
    """Counts calls of the patched functions during a block."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for owner, name, from_lists in ((torch, "tensor", True), (torch, "as_tensor", True), (torch.Tensor, "tolist", False),
                                        (torch.Tensor, "item", False), (torch.Tensor, "nonzero", False),
                                        (torch, "nonzero", False)):
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), name, from_lists))

    def _wrap(self, fn, name, from_lists):
        def counted(*args, **kwargs):
            if not from_lists or (args and isinstance(args[0], (list, tuple))):
                self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


def _sampler(plugin):
    from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

    sampler = plugin.SparserlSampler.__new__(plugin.SparserlSampler)
    torch.nn.Module.__init__(sampler)
    sampler.output_logprob_processor = OutputLogprobProcessor()
    return sampler


@pytest.mark.parametrize("logical", [False, True])
def test_a_sampling_step_copies_and_reads_nothing_and_draws_as_draw_sample(plugin, monkeypatch, logical):
    from sparserl.engines import draw
    from sparserl.utils.host_syncs import HostSyncs

    reqs = [_req(21, 0.8, 0.9, 0), _req(22, 0.0), _req(23, 1.0, 1.0, 4), _req(24, 1.2)]
    info = _info(plugin, reqs)
    positions = torch.tensor([5, 9, 3, 12])
    if logical:
        setattr(info, plugin.LOGICAL_POSITIONS, positions + 100)
    torch.manual_seed(0)
    logits = torch.randn(len(reqs), V)
    out = SimpleNamespace(next_token_logits=logits.clone())
    sampler = _sampler(plugin)
    counted = _Counted(monkeypatch)
    with HostSyncs() as syncs:
        tokens = sampler.forward(out, info, True, [0] * len(reqs), [None] * len(reqs), positions)
    assert counted.calls == [] and syncs.events == []
    monkeypatch.undo()
    want, logp = draw.sample(logits, draw.RowSettings.from_rows(_rows(info, plugin), "cpu"),
                             positions + (100 if logical else 0))
    assert torch.equal(tokens, want.to(torch.int32))
    assert torch.equal(out.next_token_logprobs, logp.clamp(min=torch.finfo(logp.dtype).min)[torch.arange(4), want])
    assert torch.equal(getattr(info, plugin.DRAWN_POSITIONS), positions + (100 if logical else 0))
