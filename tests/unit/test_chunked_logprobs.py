"""The chunked LM head (actor/logprobs.py) gives the same log-probs, entropies and gradients as full logits."""
import pytest
import torch

from sparserl.actor.logprobs import LogprobHead, PackedSeqs, chunk_rows, packed_logprobs
from sparserl.model.sampling import processed_logprobs
from tests.conftest import tiny_model


def reference(model, seqs: PackedSeqs, temperature, top_p):
    """Each sequence alone through the stock model (SDPA attention, full logits), then the sampling transform."""
    logps, ents = [], []
    for ids, p in zip(seqs.ids, seqs.prompt_lens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, p - 1 : len(ids) - 1]  # (r, V)
        lp = processed_logprobs(logits, temperature, top_p)
        logps.append(lp.gather(-1, torch.tensor(ids[p:])[:, None]).squeeze(-1))
        pr = lp.exp()
        ents.append(-(pr * lp.masked_fill(pr == 0, 0.0)).sum(-1))
    return logps, ents


def loss_of(logps, ents, coeffs):
    a, b = coeffs  # tokens outside the top-p kept set have log-prob -inf: left out of the loss
    finite = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # noqa: E731
    return sum((finite(x) * a[i, : len(x)]).sum() + (e * b[i, : len(e)]).sum() for i, (x, e) in enumerate(zip(logps, ents)))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_chunked_matches_full_logits(temperature, top_p):
    model = tiny_model("qwen2", vocab=200)
    g = torch.Generator().manual_seed(0)
    seqs = PackedSeqs([torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 14, 6, 11)], [3, 5, 2, 4])
    coeffs = (torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g))
    ref_lp, ref_ent = reference(model, seqs, temperature, top_p)
    loss_of(ref_lp, ref_ent, coeffs).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # 0.002 MB of fp32 logits = 2 rows of a 200-token vocabulary: 14 chunks for 27 response tokens.
    assert chunk_rows(200, 0.002) == 2
    for chunk_mb in (0, 0.002):
        model.zero_grad(set_to_none=True)
        logp, ent = packed_logprobs(model, seqs, torch.device("cpu"), temperature, top_p, with_entropy=True,
                                    entropy_grad=True, chunk_mb=chunk_mb)  # (4, T)
        for i, (r_lp, r_ent) in enumerate(zip(ref_lp, ref_ent)):
            torch.testing.assert_close(logp[i, : len(r_lp)], r_lp.detach(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent[i, : len(r_ent)], r_ent.detach(), rtol=1e-5, atol=1e-5)
            assert (logp[i, len(r_lp):] == 0).all()
        rows = [logp[i, : len(x)] for i, x in enumerate(ref_lp)]
        ents = [ent[i, : len(x)] for i, x in enumerate(ref_ent)]
        loss_of(rows, ents, coeffs).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"{name} chunk_mb={chunk_mb}")
        assert model.lm_head.weight.grad.abs().sum() > 0


def test_head_outside_the_actor_forward_is_the_plain_linear():
    model = tiny_model("llama", vocab=64)
    ids = torch.randint(0, 64, (1, 7))
    before = model(input_ids=ids).logits
    packed_logprobs(model, PackedSeqs([ids[0].tolist()], [2]), torch.device("cpu"))  # installs the chunked head
    after = model(input_ids=ids).logits
    assert after.shape == (1, 7, 64)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_mb", [0, 0.002])
def test_fused_head_matches_full_logits(temperature, chunk_mb):
    """The actor's usual head (no top-p / top-k, entropy as a metric) runs `_FusedHead`: same log-probs and
    entropies as full logits, and the gradient of a log-prob loss through its hand-written backward."""
    model = tiny_model("llama", vocab=200)
    g = torch.Generator().manual_seed(1)
    seqs = PackedSeqs([torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 14, 6, 11)], [3, 5, 2, 4])
    coeffs = (torch.randn(4, 12, generator=g), torch.zeros(4, 12))
    ref_lp, ref_ent = reference(model, seqs, temperature, 1.0)
    loss_of(ref_lp, [e.detach() for e in ref_ent], coeffs).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    head = LogprobHead(torch.zeros(3, dtype=torch.long), temperature, with_entropy=True, entropy_grad=False,
                       chunk_mb=chunk_mb)
    assert head._fused(torch.zeros(3, 8), None, grad=True)
    logp, ent = packed_logprobs(model, seqs, torch.device("cpu"), temperature, with_entropy=True, entropy_grad=False,
                                chunk_mb=chunk_mb)
    assert not ent.requires_grad and logp.requires_grad
    for i, (r_lp, r_ent) in enumerate(zip(ref_lp, ref_ent)):
        torch.testing.assert_close(logp[i, : len(r_lp)], r_lp.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[i, : len(r_ent)], r_ent.detach(), rtol=1e-5, atol=1e-5)
    loss_of([logp[i, : len(x)] for i, x in enumerate(ref_lp)], [ent[i, : len(x)] for i, x in enumerate(ref_ent)],
            coeffs).backward()
    for name, p in model.named_parameters():
        # Float32 sums in another order (chunks accumulated with addmm_): on an AVX2 CPU one embedding-gradient entry
        # of 12,800 came out 1.2e-6 from the full-logits reference.
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=5e-6, msg=lambda m: f"{name}: {m}")
    assert model.lm_head.weight.grad.abs().sum() > 0
    with torch.no_grad():  # the old-log-prob pass: forward only, the same values
        again, _ = packed_logprobs(model, seqs, torch.device("cpu"), temperature, chunk_mb=chunk_mb)
    torch.testing.assert_close(again, logp.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_equals_the_checkpointed_chunks(dtype, monkeypatch):
    """Bit-identical log-probs to the checkpointed per-chunk head it replaces, and the same gradients up to the
    order in which the weight's chunk gradients are summed (bf16 weights: GEMMs in bf16, softmax in fp32)."""
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(300, 16, generator=g) * 0.3).to(dtype)
    hidden = torch.randn(1, 50, 16, generator=g).to(dtype)
    targets = torch.randint(0, 300, (50,), generator=g)
    upstream = torch.randn(50, generator=g)
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(LogprobHead, "_fused", lambda *a, **k: False)
        w, h = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
        head = LogprobHead(targets, 0.8, with_entropy=True, entropy_grad=False, chunk_mb=0.01)  # 8 rows a chunk
        head(h, w, None)
        (head.logp * upstream).sum().backward()
        out[fused] = (head.logp.detach(), head.entropy, h.grad, w.grad)
    (lp, ent, dh, dw), (lp0, ent0, dh0, dw0) = out[True], out[False]
    assert torch.equal(lp, lp0)
    torch.testing.assert_close(ent, ent0, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dh, dh0, **tol)
    torch.testing.assert_close(dw, dw0, **tol)


def test_head_falls_back_where_the_fused_one_does_not_apply():
    h = torch.zeros(3, 8)
    assert not LogprobHead(torch.zeros(3, dtype=torch.long), top_p=0.9)._fused(h, None, grad=False)
    assert not LogprobHead(torch.zeros(3, dtype=torch.long), top_k=5)._fused(h, None, grad=False)
    assert not LogprobHead(torch.zeros(3, dtype=torch.long))._fused(h, torch.zeros(8), grad=False)  # a bias
    entropy_bonus = LogprobHead(torch.zeros(3, dtype=torch.long), with_entropy=True, entropy_grad=True)
    assert not entropy_bonus._fused(h, None, grad=True) and entropy_bonus._fused(h, None, grad=False)
    assert not LogprobHead(torch.zeros(0, dtype=torch.long))._fused(h[:0], None, grad=True)  # no rows
