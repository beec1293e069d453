"""A checkpoint folder with another checkpoint's architecture and tokenizer and random weights, for speed and
plumbing checks where the real weights cannot travel (scripts/gpu_check.sh on a machine with no model copy).

    python scripts/random_checkpoint.py SOURCE DEST [--seed 0]

SOURCE is a folder holding config.json and the tokenizer files (the weights, if there, are not read) or a
`model.path` the project resolves (the offline alias `smollm2-135m-instruct`). Throughput does not depend on the
weights when EOS is ignored; rewards, mismatch and accuracy do, so numbers from such a model are only speeds.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparserl.actor.hf import resolve_model_path  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("dest")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    src = Path(args.source) if (Path(args.source) / "config.json").exists() else Path(resolve_model_path(args.source))
    dest = Path(args.dest)
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{dest}: {config.model_type}, {params / 1e6:.1f}M parameters, random weights (seed {args.seed})")


if __name__ == "__main__":
    main()
