"""Shared prompts (actor/logprobs.py): the samples of one prompt computed with the prompt once give the same
log-probs, entropies and gradients as each sequence on its own, and the packing keeps a prompt's samples together."""
import pytest
import torch

from sparserl.actor.logprobs import PackedSeqs, _layout, packed_logprobs
from sparserl.data.packing import prompt_units, split_shared_microbatches
from tests.conftest import tiny_model


def grouped_seqs(vocab: int) -> PackedSeqs:
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    a, b = rand(7), rand(4)
    ids = [a + rand(5), b + rand(6), a + rand(1), a + rand(9), rand(3) + rand(4), b + rand(2)]
    plens = [7, 4, 7, 7, 3, 4]
    # the same tokens as prompt a but a shorter prompt: a different prompt, not shared
    ids.append(a + rand(3))
    plens.append(5)
    return PackedSeqs(ids, plens)


def grads_of(model, seqs, share, coeffs):
    model.zero_grad(set_to_none=True)
    logp, ent = packed_logprobs(model, seqs, torch.device("cpu"), 0.8, with_entropy=True, share_prompts=share)
    mask = torch.zeros_like(logp)
    for i, r in enumerate(seqs.resp_lens):
        mask[i, :r] = 1
    ((logp * coeffs[0] + ent * coeffs[1]) * mask).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_prompt_forward_and_backward_match(family):
    model = tiny_model(family, vocab=120, dtype=torch.float64).train()
    seqs = grouped_seqs(120)
    g = torch.Generator().manual_seed(4)
    T = max(seqs.resp_lens)
    coeffs = (torch.randn(len(seqs.ids), T, generator=g, dtype=torch.float64),
              torch.randn(len(seqs.ids), T, generator=g, dtype=torch.float64))
    lp0, ent0, g0 = grads_of(model, seqs, False, coeffs)
    lp1, ent1, g1 = grads_of(model, seqs, True, coeffs)
    assert torch.allclose(lp1, lp0, rtol=0, atol=1e-10)
    assert torch.allclose(ent1, ent0, rtol=0, atol=1e-10)
    # Only the order of floating-point sums differs (the prompt's last row gets one gradient per sample); the
    # log-softmax runs in fp32 even for an fp64 model, so gradients agree to fp32 rounding.
    for n, g_ref in g0.items():
        assert float((g1[n] - g_ref).norm()) <= 1e-6 * float(g_ref.norm()), (n, float((g1[n] - g_ref).abs().max()))
    assert sum(float(v.abs().sum()) for v in g0.values()) > 0
    # and the tokens computed: prompt a once for its 3 samples, b once for its 2; the others whole
    flat, pos, keep, targets, spans = _layout(seqs, True)
    unshared = sum(len(x) for x in seqs.ids)
    assert len(flat) == unshared - 2 * 7 - 1 * 4
    assert len(keep) == len(targets) == sum(seqs.resp_lens)
    # a response's positions continue after its prompt
    assert pos[7:12] == list(range(7, 12))
    assert sum(sp.prefix is not None for sp in spans) == 5


def test_prompt_units_and_shared_microbatches():
    keys = ["a", "b", "a", "a", "c", "b"]
    plens = [10, 4, 10, 10, 3, 4]
    lengths = [15, 10, 12, 30, 8, 6]  # responses: a 5, 2, 20; b 6, 2; c 5
    units = prompt_units(keys, plens, lengths, 1 << 30)
    assert units == [([0, 2, 3], 10 + 5 + 2 + 20), ([1, 5], 4 + 6 + 2), ([4], 8)]
    # a cap of 20: prompt a's samples are cut into pieces, each carrying the prompt
    assert prompt_units(keys, plens, lengths, 20) == [([0, 2], 17), ([3], 30), ([1, 5], 12), ([4], 8)]
    # first-fit decreasing over the units: a (37) alone, b + c (12 + 8) together under 40
    assert split_shared_microbatches(keys, plens, lengths, 40) == [[0, 2, 3], [1, 4, 5]]
    with pytest.raises(ValueError):
        split_shared_microbatches(keys, plens, lengths, 0)
