"""Which weights `python -m sparserl.eval` evaluates: `model.path` -> a Hugging Face checkpoint, maybe plus DCP or LoRA.

`model.path` may be anything the trainer takes (a Hugging Face folder, a hub id, the offline alias
`smollm2-135m-instruct`), a peft LoRA adapter folder (adapter_config.json + adapter_model.safetensors, such as a
LoRA run's exported `hf/`), a training run's `trainer.output_dir` (its exported `hf/`, or, before the export,
its latest complete checkpoint), or one DCP checkpoint folder `checkpoints/step_N/`. A DCP checkpoint holds
only tensors: the architecture and tokenizer come from the run's own `model.path` (its `config.yaml`), and
the checkpoint's model weights are pushed into the rollout engine through `update_weights`, as after a
training step. An adapter (a folder, or the adapters of a LoRA run's checkpoint with the run's `actor.lora`) is
merged into its base model on the host and pushed the same way; the engine is built from the base model.
Left out on purpose: checkpoints of other trainers, adapters other than LoRA.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from sparserl.actor import checkpoint, lora
from sparserl.actor.hf import resolve_model_path
from sparserl.utils.errors import UserError


@dataclass
class EvalModel:
    path: str  # Hugging Face checkpoint: architecture, tokenizer, and the weights unless `dcp` or `adapter` is set
    dcp: Path | None = None  # a sparserl DCP checkpoint whose model weights replace them
    adapter: Path | None = None  # a peft LoRA adapter folder, merged into `path`
    lora: Any = None  # the run's actor.lora when `dcp` holds LoRA adapters

    def describe(self) -> str:
        return str(self.dcp or self.adapter or self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The tensors to push into an engine built from `path`; None when `path` alone is the model."""
        if self.adapter is not None:
            return lora.merged_adapter_folder(self.adapter, self.path)
        if self.dcp is None:
            return None
        tensors = load_dcp_weights(self.dcp)
        if self.lora is None:
            return tensors
        return lora.merged_from_checkpoint(self.path, self.lora, dict(tensors))


def _run_base_model(run_dir: Path, given: str) -> tuple[str, Any]:
    """The run's base model (resolved) and its actor.lora when it trained adapters (else None)."""
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise UserError(f"model.path={given}: a checkpoint folder, but {cfg_file} (the run's config, which names its "
                        "base model) is missing")
    from omegaconf import OmegaConf

    run_cfg = OmegaConf.load(cfg_file)
    base = run_cfg.get("model", {}).get("path")
    if not base:
        raise UserError(f"model.path={given}: {cfg_file} has no model.path")
    adapters = run_cfg.get("actor", {}).get("lora", None)
    spec = None
    if adapters is not None and int(adapters.get("rank", 0)) > 0:
        from sparserl.config import LoRAConfig

        spec = LoRAConfig(rank=int(adapters.rank), alpha=float(adapters.alpha), dropout=float(adapters.dropout),
                          target_modules=list(adapters.target_modules))
    return resolve_model_path(str(base)), spec


def resolve_eval_model(path: str) -> EvalModel:
    """See the module docstring; raises UserError (or FileNotFoundError) naming model.path."""
    p = Path(path).expanduser()
    if lora.is_adapter_folder(p):
        return _adapter(p)
    if p.is_dir() and not (p / "config.json").exists():
        if (p / "hf" / "config.json").exists():
            return EvalModel(str(p / "hf"))
        if lora.is_adapter_folder(p / "hf"):  # a LoRA run's export
            return _adapter(p / "hf")
        if (p / "COMPLETE").exists():  # checkpoints/step_N/ of a run
            base, spec = _run_base_model(p.parent.parent, path)
            return EvalModel(base, dcp=p, lora=spec)
        latest = checkpoint.latest(p)
        if latest is not None:
            base, spec = _run_base_model(p, path)
            return EvalModel(base, dcp=latest, lora=spec)
        if (p / "checkpoints").exists() or (p / "metrics.jsonl").exists():
            raise UserError(f"model.path={path}: a training run without an exported hf/ or a complete checkpoint")
    return EvalModel(resolve_model_path(path))


def _adapter(folder: Path) -> EvalModel:
    _, base = lora.read_adapter(folder)
    return EvalModel(base, adapter=folder)


def load_dcp_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The model tensors of a sparserl DCP checkpoint as full (unsharded) CPU tensors, by parameter name."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {}
    for key, m in meta.items():
        if key.startswith("model.") and hasattr(m, "size"):
            state[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not state:
        raise UserError(f"model.path={path}: the checkpoint holds no model tensors")
    dcp.load(state, checkpoint_id=str(path))
    for key, tensor in state.items():
        yield key.removeprefix("model."), tensor
