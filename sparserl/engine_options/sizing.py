"""The KV pool of a run's engine in entries, from `rollout.kv_memory` (bytes) and the model's shape, and what it
holds, said once at start-up.

An entry is one token's keys and values in every layer (`utils/kv_memory.py` `entry_bytes`: 2 x layers x KV heads x
(head dim x the element's bytes + a quantized pool's scale bytes), of `rollout.kv_dtype`, auto = `rollout.dtype`); an
SGLang engine with `parallel.tp` ranks holds its share of the KV heads on each, and `rollout.kv_memory` is per
device. A memory that holds no sequence of the run's longest prompt
and `max_new_tokens` (its worst case: dense, or the compression bound) is a `UserError` naming the key.
Left out on purpose: the memory the engine's weights and activations take (the fraction form of `rollout.kv_memory`
is of the memory free before the engine is built; SGLang's `mem_fraction_static` still caps its own pool).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from sparserl.config import Config
from sparserl.utils.kv_memory import at_least, entry_bytes, kv_element_bytes, mb, parse_kv_memory
from sparserl.kv import CompressionSchedule, KVPolicyConfig
from sparserl.kv.schedule import keep_floor
from sparserl.utils.errors import UserError
from sparserl.utils.memory import release_free_memory


@dataclass(frozen=True)
class SequenceSize:
    """The longest sequence the engine must hold: its prompt and the response cap."""

    prompt: int
    max_new_tokens: int

    def dense_entries(self) -> int:
        # The last sampled token is never fed back, so a sequence holds at most prompt + max_new - 1 entries.
        return self.prompt + self.max_new_tokens - 1

    def compressed_entries(self, kv: KVPolicyConfig) -> int:
        """The compression bound (`CompressionSchedule.max_slots`), never above the dense worst case."""
        return min(self.dense_entries(), CompressionSchedule.max_slots(kv, self.prompt, self.max_new_tokens))

    def worst_entries(self, kv: KVPolicyConfig) -> int:
        return self.dense_entries() if kv.algorithm == "none" else self.compressed_entries(kv)


def model_entry_bytes(cfg: Config, model_path: str) -> int:
    """Bytes of one KV entry of `model_path` in `rollout.kv_dtype` (auto: `rollout.dtype`), on one device of the engine."""
    from transformers import AutoConfig

    from sparserl.actor.hf import parse_dtype, resolve_model_path
    from sparserl.engines.native.runner import kv_geometry

    layers, kv_heads, head_dim = kv_geometry(AutoConfig.from_pretrained(resolve_model_path(model_path)))
    if cfg.rollout.engine == "sglang" and cfg.parallel.tp > 1:
        kv_heads = max(1, kv_heads // cfg.parallel.tp)  # each tensor-parallel rank holds its share of the KV heads
    sizes = kv_element_bytes(cfg.rollout.kv_dtype, parse_dtype(cfg.rollout.dtype).itemsize, cfg.rollout.engine)
    return entry_bytes(layers, kv_heads, head_dim, *sizes)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device after the cached blocks are given back; None elsewhere."""
    if device.type != "cuda":
        return None
    gc.collect()
    release_free_memory()
    return torch.cuda.mem_get_info(device)[0]


def memory_slots(cfg: Config, model_path: str, device: torch.device, longest: SequenceSize) -> int | None:
    """`rollout.kv_memory` as pool entries (None when it is unset); a UserError when it holds no sequence of
    `longest`, or when a fraction is asked for off CUDA."""
    key = f"rollout.kv_memory={cfg.rollout.kv_memory}"
    memory = parse_kv_memory(cfg.rollout.kv_memory)
    if not memory.is_set:
        return None
    free = free_device_bytes(device) if memory.fraction else None
    if memory.fraction and free is None:
        raise UserError(f"{key} is a fraction of the free device memory, but the engine runs on {device.type}; give a "
                        "size (e.g. rollout.kv_memory=512MB)")
    nbytes = memory.resolve(free)
    per_entry = model_entry_bytes(cfg, model_path)
    slots = nbytes // per_entry
    kv = cfg.rollout.kv.with_budget()
    need = longest.worst_entries(kv)
    if slots < need:
        form = "compressed (the compression bound)" if kv.algorithm != "none" else "dense"
        raise UserError(f"{key} ({mb(nbytes)}) holds {slots} KV entries of {per_entry} B, but one {form} sequence of "
                        f"the longest prompt ({longest.prompt} tokens) + max_new_tokens {longest.max_new_tokens} "
                        f"needs {need}: raise rollout.kv_memory to at least {at_least(need * per_entry)}, or lower "
                        "max_new_tokens")
    return slots


def pool_line(cfg: Config, pool_slots: int, bytes_per_slot: int, longest: SequenceSize) -> str:
    """What the pool holds: its MB and entries, the dense sequences of `longest` that fit, and with compression on
    the compressed ones (each at the compression bound)."""
    kv = cfg.rollout.kv.with_budget()
    dense = longest.dense_entries()
    line = (f"KV pool {mb(pool_slots * bytes_per_slot)} ({kv_dtype_words(cfg)}) = {pool_slots} entries x {bytes_per_slot} B: "
            f"{pool_slots // dense} dense sequences of {longest.prompt} + {longest.max_new_tokens} tokens "
            f"({dense} entries each)")
    if kv.algorithm != "none":
        bound = longest.compressed_entries(kv)
        line += f", {pool_slots // bound} compressed ones ({kv.algorithm} budget {kv.budget}: at most {bound} entries each)"
    admission = cfg.rollout.admission if cfg.rollout.engine == "native" else "optimistic (SGLang's scheduler)"
    return line + f"; admission {admission}"


def kv_dtype_words(cfg: Config) -> str:
    """What a pool entry is stored as, for the start-up line: `rollout.kv_dtype`, auto named by `rollout.dtype`."""
    kv_dtype = cfg.rollout.kv_dtype
    if kv_dtype == "auto":
        return f"kv_dtype auto: {cfg.rollout.dtype}"
    _, scale = kv_element_bytes(kv_dtype, 4, cfg.rollout.engine)
    return f"kv_dtype {kv_dtype}" + (" + a float32 scale per token and KV head" if scale else "")


def pool_is_sized(cfg: Config) -> bool:
    """Whether the run sets the pool (`rollout.kv_memory` or `rollout.kv_pool_tokens`); the default pool holds every
    sequence of a step at its worst case, so nothing is ever retracted in it."""
    return parse_kv_memory(cfg.rollout.kv_memory).is_set or cfg.rollout.kv_pool_tokens > 0


def kv_policy_lines(cfg: Config, longest: SequenceSize) -> list[str]:
    """What the run's KV policy does, said once at start-up: the policy and its budget, what the console's `kv` figure
    reads, and a budget no sequence can reach (then nothing is compressed)."""
    kv = cfg.rollout.kv
    if kv.algorithm == "none":
        return ["KV cache: dense (rollout.kv.algorithm=none); the console's kv figure stays at 100%"]
    policy = kv.with_budget()
    budget = (f"budget auto ({policy.control.floor}-{policy.control.ceiling}, from {policy.budget})"
              if kv.budget == "auto" else f"budget {kv.budget}")
    prompt = "the prompt compressed too" if kv.compress_prompt else "the prompt kept whole"
    when = (f"every {kv.divide_length} new tokens" if kv.divide_method == "step_length" else "at a newline")
    lines = [f"KV compression: {kv.algorithm}, {budget} entries, {when} once over it, window {kv.window}, {prompt}; "
             f"the console's kv figure is the share of a dense cache the sequences kept (kv/retained_frac: 100% = "
             f"nothing evicted)"]
    most = longest.dense_entries()  # what the longest sequence holds at most, uncompressed
    floor = keep_floor(policy, longest.prompt)  # a compression keeps at least this many
    if most <= floor:
        lines.append(f"rollout.kv.budget={kv.budget} is never reached: the longest sequence holds at most {most} "
                     f"entries ({longest.prompt} prompt + {longest.max_new_tokens} new tokens), and a compression "
                     f"keeps at least {floor}, so nothing is compressed; a budget below {most} compresses")
    elif (kv.divide_method == "step_length" and longest.max_new_tokens <= kv.divide_length
          and most < floor + kv.divide_length):
        lines.append(f"rollout.kv.divide_length={kv.divide_length} is not below rollout.max_new_tokens="
                     f"{longest.max_new_tokens}: a response ends before its first compression, so nothing is "
                     f"compressed; a smaller divide_length compresses")
    return lines
