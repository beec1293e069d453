"""The final policy as a Hugging Face checkpoint (trainer.export_hf): output_dir/hf.

Full fine-tuning writes the model itself. A LoRA actor (actor.lora.rank > 0) writes peft's adapter folder instead
(adapter_config.json naming the base `model.path`, adapter_model.safetensors, and the tokenizer), and with
`actor.lora.export_merged` the merged model (base + adapters, the weights the engines ran) as a normal checkpoint
in output_dir/hf/merged. The folder appears whole or not at all (written beside it, then renamed).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

MERGED_DIR = "merged"


def export_final(cfg, actor, tokenizer, rank: int) -> None:
    """Write the actor's weights as a Hugging Face checkpoint under output_dir/hf. Every rank joins the gathers,
    one tensor at a time; only global rank 0 keeps the full tensors (in host memory) and writes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sparserl.actor.hf import export_hf
    from sparserl.utils.logging import log0

    out = Path(cfg.trainer.output_dir) / "hf"
    if getattr(actor, "lora", None) is not None:
        _export_lora(cfg, actor, tokenizer, rank, out)
        return
    # cpu_offload=True: rank 0 moves each gathered tensor to host memory, the other ranks drop theirs at once.
    state = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        shell = _shell(actor.config, next(iter(state.values())).dtype)
        path = export_hf(shell, tokenizer, out, state_dict=state)
        log0(f"exported the final policy to {path}")


def _shell(config, dtype):
    """The model class on the meta device, to write a state dict with `save_pretrained`."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    shell.config.dtype = str(dtype).removeprefix("torch.")
    return shell


def _export_lora(cfg, actor, tokenizer, rank: int, out: Path) -> None:
    from sparserl.actor import lora
    from sparserl.actor.hf import export_hf
    from sparserl.utils.logging import log0

    keep = rank == 0
    adapters = {name: t.cpu() for name, t in lora.adapter_state(actor.model, keep=keep) if keep}
    merged = None
    if actor.lora.export_merged:
        merged = {name: t.cpu() for name, t in actor.full_state().gather(keep=keep) if keep}
    if rank != 0:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        lora.save_adapter(tmp, actor.lora, lora.base_model_name(cfg.model.path), adapters)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if merged is not None:
            export_hf(_shell(actor.config, next(iter(merged.values())).dtype), tokenizer, tmp / MERGED_DIR, state_dict=merged)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log0(f"exported the LoRA adapter to {out}" + (f" and the merged model to {out / MERGED_DIR}" if merged is not None else ""))
