"""Low-rank adapters (LoRA) on the actor, built with the peft library (`actor.lora.rank > 0`; docs/lora.md).

The adapters are injected into the Hugging Face model in place (`peft.inject_adapter_in_model`), so the model keeps
its class, its config and its module paths: a target `model.layers.0.self_attn.q_proj` becomes a `lora.Linear`
holding the frozen `base_layer` and the trainable `lora_A.default` (r, in) and `lora_B.default` (out, r). Only the
adapters require gradients; the optimizer, gradient clipping and the checkpoint see only them.

What leaves the actor:
  - the rollout engines get merged weights, `W + scaling * B @ A` under the original parameter names
    (`merged_state`), so they run the plain model and never import peft;
  - the final export writes peft's adapter folder (`save_adapter`), and, with `actor.lora.export_merged`, the
    merged model beside it (actor/export.py);
  - the KL reference is the same model with its adapters switched off (`adapters_off`), not a second copy.

Tensor parallelism: `tp_targets` turns a plan entry on an adapted module into entries on its parts, sharded so that
`B @ A` is split exactly like the base weight: colwise (q/k/v, gate/up) keeps A replicated and splits B's rows;
rowwise (o, down) splits A's columns (input features, all-reduced like the base output) and keeps B replicated.

Left out on purpose: adapters on embeddings or the LM head (linear layers inside the decoder only), DoRA and the
other peft variants, several adapters at once, dropout with tensor parallelism (the replicated colwise adapter
input would draw a different mask on each TP rank), and merging shard by shard (the merge runs on gathered
tensors: simple and exact, at the cost of gathering the adapted weights in the actor's dtype).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

from sparserl.utils.errors import UserError

ADAPTER = "default"  # peft's adapter name inside the model; peft's saved files leave it out
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # how peft's PeftModel names the wrapped model's tensors in a saved adapter


def enabled(lora) -> bool:
    return lora is not None and lora.rank > 0


def peft_config(lora, base_model: str | None = None):
    """peft's LoraConfig for `actor.lora` (a sparserl LoRAConfig)."""
    from peft import LoraConfig

    targets = list(lora.target_modules)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      base_model_name_or_path=base_model)


def is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if is_lora_layer(m)}


def has_adapters(model: torch.nn.Module) -> bool:
    return any(is_lora_layer(m) for m in model.modules())


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def inject(model: torch.nn.Module, lora, seed: int = 0) -> None:
    """Add adapters to `model` in place; only they require gradients afterwards.

    B starts at zero (the adapted model is the base model) and A from a generator seeded with `seed`, so every rank
    that builds the model gets the same adapters (the meta-device model of `hf.load_model_rank0` too)."""
    from peft import inject_adapter_in_model

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    except ValueError as e:  # peft's own: no module matches
        raise UserError(f"actor.lora.target_modules={list(lora.target_modules)}: {str(e).splitlines()[0]}") from None
    from peft.tuners.lora import Linear

    head = model.get_output_embeddings()
    for name, module in lora_layers(model).items():
        if module is head:
            raise UserError(f"actor.lora.target_modules={list(lora.target_modules)}: the LM head ({name}) cannot take "
                            "an adapter; target the decoder's linear layers")
        if type(module) is not Linear:
            raise UserError(f"actor.lora.target_modules={list(lora.target_modules)}: {name} is a "
                            f"{type(module.base_layer).__name__}; adapters go on linear layers only")


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model inside the block: every adapter layer computes its base layer alone.

    Sets peft's per-layer flag directly: its `enable_adapters(False)` also flips `requires_grad`, which the sharded
    parameters and the optimizer must keep."""
    layers = list(lora_layers(model).values())
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


# ---------------------------------------------------------------------------------------------- tensor parallel
# plan style of the adapted module -> styles of (base_layer, lora_A, lora_B)
_TP_STYLES = {"colwise": ("colwise", "replicate", "colwise"), "rowwise": ("rowwise", "rowwise", "replicate")}


def tp_targets(name: str, module: torch.nn.Module, style: str) -> list[tuple[str, torch.nn.Module, str]]:
    """(path, module, style) to parallelize for one plan entry: the module itself, or an adapted module's parts."""
    if not is_lora_layer(module):
        return [(name, module, style)]
    if style not in _TP_STYLES:
        raise ValueError(f"parallel.tp > 1: {name} has a LoRA adapter but its tensor-parallel style is {style!r}; "
                         f"adapters are split only on {' / '.join(_TP_STYLES)} layers (set actor.lora.target_modules)")
    base, a, b = _TP_STYLES[style]
    return [(f"{name}.base_layer", module.base_layer, base),
            *[(f"{name}.lora_A.{k}", m, a) for k, m in module.lora_A.items()],
            *[(f"{name}.lora_B.{k}", m, b) for k, m in module.lora_B.items()]]


# ---------------------------------------------------------------------------------------------- merged weights
def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`weight + scaling * b @ a`, computed in at least fp32, returned in `dtype` (default: the weight's)."""
    work = torch.promote_types(weight.dtype, torch.float32)
    out = weight.to(work) + scaling * (b.to(work) @ a.to(work))
    return out.to(dtype or weight.dtype)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def merged_state(model: torch.nn.Module, dtype: torch.dtype | None = None, keep: bool = True
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(original name, full tensor) of the adapted model with its adapters merged: the walk of `Actor.full_state()`.

    A collective every rank must run to the end (each sharded tensor is gathered as the walk reaches it). Tensors of
    unadapted modules are cast to `dtype` before their gather, as without adapters; an adapted weight is gathered
    with its adapters in the actor's dtype, merged, then cast, so the engine gets exactly the cast of the merge.
    keep=False: join the gathers, yield (name, None)."""
    layers = lora_layers(model)
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        prefix, part = _split(name, layers)
        if prefix is None:
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)  # on a DTensor: the local shard, no communication
            full = _full(t)
            yield name, (full if keep else None)
            continue
        parts = held.setdefault(prefix, {})
        parts[part] = _full(t)
        module = layers[prefix]
        want = {"weight", "A", "B"} | ({"bias"} if module.base_layer.bias is not None else set())
        if set(parts) != want:
            continue
        del held[prefix]
        merged = merge(parts["weight"], parts["A"], parts["B"], module.scaling[ADAPTER], dtype) if keep else None
        yield f"{prefix}.weight", merged
        if "bias" in parts:
            bias = parts["bias"]
            if dtype is not None and bias.is_floating_point():
                bias = bias.to(dtype)
            yield f"{prefix}.bias", (bias if keep else None)
        del parts, merged
    assert not held, f"adapted modules with missing parts: {sorted(held)[:3]}"


def _split(name: str, layers: dict[str, torch.nn.Module]) -> tuple[str | None, str]:
    """`...q_proj.base_layer.weight` -> ("...q_proj", "weight"); `...q_proj.lora_A.default.weight` -> (.., "A")."""
    for marker, part in ((".base_layer.weight", "weight"), (".base_layer.bias", "bias"),
                         (f".lora_A.{ADAPTER}.weight", "A"), (f".lora_B.{ADAPTER}.weight", "B")):
        if name.endswith(marker):
            prefix = name[: -len(marker)]
            if prefix in layers:
                return prefix, part
    if any(name.startswith(p + ".") for p in layers):
        raise ValueError(f"{name}: an adapter tensor this version does not merge (DoRA or another peft variant?)")
    return None, ""


# ---------------------------------------------------------------------------------------------- adapter files
def adapter_state(model: torch.nn.Module, keep: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The adapters as full tensors under peft's saved names (`base_model.model.<module>.lora_A.weight`); a
    collective over the model's mesh, like `merged_state`."""
    for name, t in model.state_dict().items():
        if is_adapter_key(name):
            full = _full(t)
            yield _PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."), (full if keep else None)


def save_adapter(folder: Path, lora, base_model: str, tensors: dict[str, torch.Tensor]) -> None:
    """peft's adapter folder: adapter_config.json and adapter_model.safetensors (loadable by PeftModel.from_pretrained)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base_model).save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


def base_model_name(model_path: str) -> str:
    """What adapter_config.json names as the base: a local folder as an absolute path, an alias or hub id as given."""
    p = Path(model_path).expanduser()
    return str(p.resolve()) if p.exists() else model_path


def is_adapter_folder(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return p.is_dir() and (p / CONFIG_FILE).exists() and not (p / "config.json").exists()


def read_adapter(folder: Path, key: str = "model.path") -> tuple[dict, str]:
    """(adapter_config.json, its base model resolved for `from_pretrained`); a UserError naming `key` if the folder
    is not a LoRA adapter this project can merge."""
    from sparserl.actor.hf import resolve_model_path

    where = f"{key}={folder}"
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: {CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        kind = cfg.get("peft_type") if isinstance(cfg, dict) else None
        raise UserError(f"{where}: {CONFIG_FILE} describes a {kind or 'non-LoRA'} adapter; only LoRA adapters load")
    if not (folder / WEIGHTS_FILE).exists():
        others = sorted(p.name for p in folder.glob("adapter_model.*"))
        hint = (f" ({', '.join(others)} is a pickle file, which can run code when loaded: convert it to safetensors)"
                if others else "")
        raise UserError(f"{where}: the adapter folder has no {WEIGHTS_FILE}{hint}")
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise UserError(f"{where}: {CONFIG_FILE} has no base_model_name_or_path (the model the adapter was trained on)")
    try:
        return cfg, resolve_model_path(str(base))
    except FileNotFoundError as e:
        raise UserError(f"{where}: its base model base_model_name_or_path={base} cannot be found: {e}") from None


def merged_adapter_folder(folder: Path, base_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model with a saved peft adapter merged in, as (name, CPU tensor) under the base model's names."""
    from peft import PeftModel

    from sparserl.actor.hf import load_model

    base = load_model(base_path, "float32", "cpu")
    try:
        model = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    except (ValueError, RuntimeError, KeyError) as e:  # shapes or module names that are not this base's
        raise UserError(f"model.path={folder}: the adapter does not fit its base model {base_path}: "
                        f"{str(e).splitlines()[0][:300]}") from None
    yield from model.state_dict().items()


def merged_from_checkpoint(base_path: str, lora, adapters: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model with the adapters of a sparserl checkpoint (names as in the actor) merged in."""
    from sparserl.actor.hf import load_model

    model = load_model(base_path, "float32", "cpu")
    inject(model, lora)
    missing = [k for k in adapters if k not in model.state_dict()]
    if missing:
        raise UserError(f"the checkpoint's adapters {missing[:2]} do not fit {base_path} with actor.lora.target_modules="
                        f"{list(lora.target_modules)}")
    model.load_state_dict(adapters, strict=False)
    yield from merged_state(model)
