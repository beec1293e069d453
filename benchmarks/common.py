"""Helpers shared by the benchmark scripts: machine description, prompts, table printing."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# The eval sets ship with the package (sparserl/data/eval/README.md).
EVAL_DATA = Path(__file__).resolve().parents[1] / "sparserl" / "data" / "eval"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({cpu}), {os.cpu_count()} cores"
    return f"{dev}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def gsm8k_prompts(tokenizer, n: int, path: Path | None = None) -> list[list[int]]:
    """The first `n` GSM8K questions in the model's chat template, as token ids."""
    path = path or EVAL_DATA / "gsm8k.jsonl"
    rows = [json.loads(line) for line in open(path)][:n]
    out = []
    for r in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(f"**{title}**\n")
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _linear_weights(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the LM head's weight, every other linear layer's weight)."""
    head = model.get_output_embeddings()
    return head.weight, [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]


def bench_device(name: str) -> torch.device:
    """`--device`: auto (CUDA when visible, else CPU), cpu or cuda."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return torch.device(name)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a host clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(run, device: torch.device, repeats: int, inference: bool = True) -> float:
    """The best of `repeats` timed calls of `run()` (GEMMs back to back), after one warm-up call; `inference=False`
    for a `run` that needs autograd (a backward)."""
    best = float("inf")
    with torch.inference_mode(inference):
        for _ in range(repeats + 1):  # the first run warms the BLAS up
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return best


def _best_mm_seconds(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> float:
    """The best of `repeats` runs of `torch.mm(a, b)` over `pairs`, back to back, after one warm-up run."""
    def run():
        for a, b in pairs:
            torch.mm(a, b)

    return _best_seconds(run, pairs[0][0].device, repeats)


def _random_inputs(like: torch.Tensor):
    """A maker of (m, n) random inputs in `like`'s dtype and device, one tensor per shape, made before any clock."""
    made: dict[tuple[int, int], torch.Tensor] = {}

    def rand(m: int, n: int) -> torch.Tensor:
        if (m, n) not in made:
            made[(m, n)] = torch.randn(m, n, dtype=like.dtype, device=like.device)
        return made[(m, n)]

    return rand


def matmul_floor(model, rows: list[int], head_rows: list[int], repeats: int = 5) -> float:
    """Seconds for the model's own linear layers' GEMMs, back to back and nothing else (no attention, no norms, no
    sampling): every layer but the LM head once per entry of `rows` (its M), the LM head once per entry of
    `head_rows`. The best of `repeats` runs, each on inputs made before the clock starts. The floor a forward of
    that many rows cannot beat with these weights and this BLAS."""
    head, linears = _linear_weights(model)
    rand = _random_inputs(head)
    plan = [(w, m) for m in rows for w in linears] + [(head, m) for m in head_rows]
    return _best_mm_seconds([(rand(m, w.shape[1]), w.t()) for w, m in plan], repeats)


def _fused_linear_weights(model) -> list[torch.Tensor]:
    """Every linear weight but the LM head's, with the sibling projections the native engine packs as one weight
    (oneDNN's kernel: q/k/v, gate/up; engines/native/prepack.py `sibling_groups`) concatenated."""
    from sparserl.engines.native.prepack import sibling_groups

    head = model.get_output_embeddings()
    groups = sibling_groups(model)
    grouped = {id(x) for members in groups for x in members}
    out = [torch.cat([x.weight.detach() for x in members]) for members in groups]
    return out + [x.weight for x in model.modules()
                  if isinstance(x, torch.nn.Linear) and x is not head and id(x) not in grouped]


def packed_matmul_floor(model, m: int, repeats: int = 5, kernel: str | None = None, fuse: bool = True) -> float:
    """`matmul_floor(model, [m], [m])` with every weight packed for M = m rows first, in `kernel`'s layout ("onednn" or
    "mkl"; default: the one the native engine's `rollout.prepack=auto` picks on this CPU, engines/native/prepack.py).
    With oneDNN's layout and `fuse`, the sibling projections run as one GEMM, as the engine runs them. What the
    engine's decode steps run with `rollout.prepack`. Needs float32 on CPU."""
    from sparserl.engines.native.prepack import default_kernel, pack_weight, packed_linear

    kernel = kernel or default_kernel()
    head, linears = _linear_weights(model)
    if fuse and kernel == "onednn":
        linears = _fused_linear_weights(model)
    rand = _random_inputs(head)
    calls = [(rand(m, w.shape[1]), pack_weight(w, kernel, m), w) for w in linears + [head]]

    def run():
        for x, packed, w in calls:
            packed_linear(x, packed, w, None, kernel, m)

    return _best_seconds(run, head.device, repeats)


def train_matmul_floor(model, micro_batches: list[tuple[int, int]], chunk_rows: int, recompute: bool,
                       repeats: int = 3) -> float:
    """Seconds for the GEMMs of a forward+backward over packed micro-batches, back to back and nothing else.
    `micro_batches` holds (packed tokens, rows that predict a response token) per micro-batch. Each linear layer
    but the LM head runs at M = tokens: its forward (twice with `recompute`, activation checkpointing), then
    dX = dY W and dW = dY^T X. The LM head runs on the predicting rows in chunks of `chunk_rows`, each chunk's
    forward twice (the actor's head is checkpointed per chunk), dX and dW. The best of `repeats` runs."""
    head, linears = _linear_weights(model)
    rand = _random_inputs(head)

    def gemms(w: torch.Tensor, m: int, forwards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, dy = rand(m, w.shape[1]), rand(m, w.shape[0])
        return [(x, w.t())] * forwards + [(dy, w), (dy.t(), x)]

    pairs = []
    for tokens, head_rows in micro_batches:
        for w in linears:
            pairs += gemms(w, tokens, 2 if recompute else 1)
        for start in range(0, head_rows, chunk_rows):
            pairs += gemms(head, min(chunk_rows, head_rows - start), 2)
    return _best_mm_seconds(pairs, repeats)


@torch.inference_mode()
def log_ratios(model, gens, batch_tokens: int = 4096) -> torch.Tensor:
    """(tokens,) logp_sampler - logp_dense of every sampled token, dense = a full-attention recompute."""
    from sparserl.actor.logprobs import PackedSeqs, packed_logprobs

    out, chunk = [], []

    def flush():
        seqs = PackedSeqs([g.prompt_token_ids + g.token_ids for g in chunk], [len(g.prompt_token_ids) for g in chunk])
        logp, _ = packed_logprobs(model, seqs, next(model.parameters()).device)
        logp = logp.float().cpu()
        for row, g in enumerate(chunk):
            out.append(torch.tensor(g.logp_sparse) - logp[row, : len(g.token_ids)])
        chunk.clear()

    for g in gens:
        chunk.append(g)
        if sum(len(c.prompt_token_ids) + len(c.token_ids) for c in chunk) >= batch_tokens:
            flush()
    if chunk:
        flush()
    return torch.cat(out) if out else torch.zeros(0)
