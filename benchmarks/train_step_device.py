"""Part 4 of benchmarks/train_step.py (`--device cuda`; `--device cpu --dry-run` runs the same code on a tiny config in
seconds): the update's forward+backward on one device, for a Qwen2.5-1.5B-shaped model with random weights built on
the device from a config (benchmarks/gpu_decode.py `build_model`; nothing is downloaded), in `--dtype`.

1. An 8k-token micro-batch (8 samples of one 256-token prompt, 768-token responses; 6400 packed tokens with shared
   prompts), shared prompts on and off, activation checkpointing on and off: seconds per forward+backward (the best
   of `--repeats` after a warm-up pass; the chunked log-prob head at its default chunk, entropy as a metric), sequence
   tokens/s, MFU and peak memory. Model FLOPs = 6 * layer parameters * packed tokens + 6 * hidden * vocabulary *
   predicted tokens + 12 * head dim * heads * visible (query, key) pairs * layers; the recompute of checkpointing is
   not counted. The peak is the device's own: square GEMMs in the dtype (8192 on a side), timed with CUDA events in
   the same run.
2. One 16k-token response under a 512-token prompt in one micro-batch, checkpointing on: seconds and peak memory, or
   OOM.
3. Attention alone on the first micro-batch's packed row (shared prompts on), forward+backward: ring attention's block
   kernel (`block_attention` and its backward, what context parallelism runs per block) against one fused call of
   SDPA with the same boolean mask, and SDPA causal over the whole row without a mask (more pairs; the fused
   kernel's floor); with the largest difference of the outputs from the masked call's.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.common import _best_seconds, machine, print_table, sync
from benchmarks.gpu_decode import build_model
from sparserl.actor.context_parallel import zigzag_plan
from sparserl.actor.logprobs import PackedSeqs, _layout, chunk_mb_for, chunk_rows, packed_logprobs
from sparserl.actor.ring_attention import block_attention, block_attention_backward


@dataclass(frozen=True)
class Shape:
    samples: int
    prompt: int
    response: int
    long_prompt: int
    long_response: int
    gemm: int  # side of the peak-measuring GEMMs


FULL = Shape(samples=8, prompt=256, response=768, long_prompt=512, long_response=16384, gemm=8192)
DRY = Shape(samples=4, prompt=16, response=48, long_prompt=16, long_response=256, gemm=256)


def micro_batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0) -> PackedSeqs:
    """`n` samples of one random prompt, each with its own random response."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(10, vocab, (prompt,), generator=g).tolist()
    return PackedSeqs([p + torch.randint(10, vocab, (response,), generator=g).tolist() for _ in range(n)], [prompt] * n)


def peak_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 20) -> float:
    """FLOP/s of back-to-back (n x n) @ (n x n) GEMMs in `dtype`: CUDA events on a GPU, the host clock elsewhere."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    c = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=c)
        seconds = time.perf_counter() - t0
    return 2 * n**3 * repeats / seconds


def visible_pairs(spans) -> int:
    """(query, key) pairs the packed attention rule lets through: causal in each span, plus its prefix span."""
    total = 0
    for sp in spans:
        n = sp.end - sp.start
        total += n * (n + 1) // 2
        if sp.prefix is not None:
            total += n * (spans[sp.prefix].end - spans[sp.prefix].start)
    return total


def model_flops(model, seqs: PackedSeqs, share: bool) -> tuple[float, int]:
    """(model FLOPs of one forward+backward, packed tokens) of a micro-batch."""
    flat, _, keep, _, spans = _layout(seqs, share)
    cfg = model.config
    layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 12 * head_dim * cfg.num_attention_heads * visible_pairs(spans) * cfg.num_hidden_layers
    return 6 * layer_params * len(flat) + 6 * cfg.hidden_size * cfg.vocab_size * len(keep) + attn, len(flat)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> str:
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}" if device.type == "cuda" else "-"


def fwd_bwd(model, seqs: PackedSeqs, device: torch.device, share: bool) -> float:
    """Seconds of one forward+backward of a policy-gradient-shaped loss over the micro-batch."""
    model.zero_grad(set_to_none=True)
    sync(device)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as hold:  # the context outlives backward (activation checkpointing)
        logp, _ = packed_logprobs(model, seqs, device, with_entropy=True, entropy_grad=False, hold_context=hold,
                                  share_prompts=share)
        (-logp.sum() / len(seqs.ids)).backward()
    sync(device)
    return time.perf_counter() - t0


def _checkpointing(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def update_rows(model, seqs: PackedSeqs, device: torch.device, peak: float, repeats: int) -> list[list]:
    tokens = sum(len(x) for x in seqs.ids)
    rows = []
    for ac in (True, False):
        _checkpointing(model, ac)
        for share in (True, False):
            _reset_peak(device)
            seconds = min(fwd_bwd(model, seqs, device, share) for _ in range(repeats + 1))
            flops, packed = model_flops(model, seqs, share)
            rows.append(["on" if ac else "off", "on" if share else "off", packed, f"{seconds:.3f}",
                         f"{tokens / seconds:.0f}", f"{flops / seconds / peak:.1%}", _peak_gb(device)])
    return rows


def long_row(model, seqs: PackedSeqs, device: torch.device) -> list:
    _checkpointing(model, True)
    _reset_peak(device)
    try:
        seconds = fwd_bwd(model, seqs, device, True)
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return [sum(map(len, seqs.ids)), "OOM", "-", _peak_gb(device)]
    tokens = sum(map(len, seqs.ids))
    return [tokens, f"{seconds:.3f}", f"{tokens / seconds:.0f}", _peak_gb(device)]


def attention_rows(model, seqs: PackedSeqs, device: torch.device, dtype: torch.dtype, repeats: int) -> list[list]:
    """Forward+backward of attention alone on the micro-batch's packed row (shared prompts): the ring block kernel
    against fused SDPA calls."""
    cfg = model.config
    flat, _, _, _, spans = _layout(seqs, True)
    t, h, hkv = len(flat), cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(t, n, d, device=device, generator=g).to(dtype) for n in (h, hkv, hkv))
    dout = torch.randn(t, h, d, device=device, generator=g).to(dtype)
    scale = d**-0.5
    blk = zigzag_plan(spans, 1).block(0, 0, device)  # cp = 1: one block, all rows and columns
    mask = zigzag_plan(spans, 1).visible(0, 0).to(device)
    outs = {}

    def ring():
        out, lse = block_attention(q, k, v, blk.mask, scale)
        block_attention_backward(q, k, v, blk.mask, scale, dout, lse, out)
        outs["ring"] = out

    # SDPA's operands: (1, H, T, D) leaves, keys/values expanded to every query head beforehand
    qq, kk, vv = (x.repeat_interleave(h // x.shape[1], 1).transpose(0, 1)[None].detach().requires_grad_()
                  for x in (q, k, v))

    def sdpa(masked: bool):
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask if masked else None, is_causal=not masked,
                                             scale=scale)
        out.backward(dout.transpose(0, 1)[None])
        outs["masked" if masked else "causal"] = out[0].transpose(0, 1)

    rows = []
    for name, run in (("ring block kernel (block_attention + backward)", ring),
                      ("SDPA, the same mask, one call", lambda: sdpa(True)),
                      ("SDPA causal over the whole row, no mask", lambda: sdpa(False))):
        _reset_peak(device)
        seconds = _best_seconds(run, device, repeats, inference=False)
        rows.append([name, t, f"{seconds * 1e3:.2f}", _peak_gb(device)])
    diff = (outs["ring"].float() - outs["masked"].float()).abs().max().item()
    rows[0].append(f"{diff:.2e}")
    rows[1].append("0")
    rows[2].append("-")
    return rows


def device_update(args) -> None:
    """`benchmarks/train_step.py --device ...`: the three tables of this module's docstring."""
    from benchmarks.common import bench_device

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' checkpointing API rename
    device, dtype = bench_device(args.device), getattr(torch, args.dtype)
    shape = DRY if args.dry_run else FULL
    repeats = 1 if args.dry_run else args.repeats
    t0 = time.perf_counter()
    model = build_model(args.dry_run, device, dtype).train()
    vocab = model.config.vocab_size
    peak = peak_flops(device, dtype, shape.gemm)
    seqs = micro_batch(shape.samples, shape.prompt, shape.response, vocab)
    rows = chunk_rows(vocab, chunk_mb_for(None, device))
    print(f"machine: {machine()}\nmodel: {'tiny' if args.dry_run else 'Qwen2.5-1.5B'}-shaped, random weights, "
          f"{args.dtype}, built in {time.perf_counter() - t0:.1f} s; GEMM peak {peak / 1e12:.3g} TFLOP/s "
          f"({shape.gemm}-square {args.dtype} GEMMs); log-prob head chunk {rows} rows; best of {repeats} after a "
          "warm-up\n")
    print_table(["activation ckpt", "shared prompts", "packed tokens", "fwd+bwd s", "tokens/s", "MFU", "peak GB"],
                update_rows(model, seqs, device, peak, repeats),
                title=f"one micro-batch of {sum(map(len, seqs.ids))} tokens: {shape.samples} samples of a "
                      f"{shape.prompt}-token prompt, {shape.response}-token responses")
    print()
    long = micro_batch(1, shape.long_prompt, shape.long_response, vocab, seed=1)
    print_table(["tokens", "fwd+bwd s", "tokens/s", "peak GB"], [long_row(model, long, device)],
                title=f"one {shape.long_response}-token response under a {shape.long_prompt}-token prompt, "
                      "activation checkpointing on")
    print()
    print_table(["attention", "packed tokens", "fwd+bwd ms", "peak GB", "max |out - masked SDPA|"],
                attention_rows(model, seqs, device, dtype, repeats), title="attention alone, forward+backward")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
