"""The final policy as a Hugging Face checkpoint (trainer.export_hf): output_dir/hf."""
from __future__ import annotations

from pathlib import Path


def export_final(cfg, actor, tokenizer, rank: int) -> None:
    """Write the actor's weights as a Hugging Face checkpoint under output_dir/hf. Every rank joins the gathers,
    one tensor at a time; only global rank 0 keeps the full tensors (in host memory) and writes them."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sparserl.actor.hf import export_hf
    from sparserl.utils.logging import log0

    # cpu_offload=True: rank 0 moves each gathered tensor to host memory, the other ranks drop theirs at once.
    state = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(actor.config)
        shell.config.dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        path = export_hf(shell, tokenizer, Path(cfg.trainer.output_dir) / "hf", state_dict=state)
        log0(f"exported the final policy to {path}")
