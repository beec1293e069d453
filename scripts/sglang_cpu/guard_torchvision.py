"""CPU test harness only: let the PyPI torchvision wheel import next to a CPU build of torch.

SGLang imports torchvision at start-up. The only torchvision wheel on PyPI for this torch is a CUDA build;
its `_C` extension does not load with CPU torch, which torchvision tolerates everywhere except two
`torch.library.register_fake("torchvision::nms" / "torchvision::qnms")` decorators in
`torchvision/_meta_registrations.py`: they fail with "operator torchvision::nms does not exist". This script
makes those two registrations conditional on the extension having loaded (as torchvision already does for
its other ops via `register_meta`). It edits the installed file in the venv it runs in, is idempotent, and
is never used on a GPU install (there the CUDA torchvision loads its `_C`).

    python scripts/sglang_cpu/guard_torchvision.py
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARK = "# sparserl CPU harness: registered only when torchvision's _C loaded"
OPS = ("torchvision::nms", "torchvision::qnms")


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("error: torchvision is not installed in this environment", file=sys.stderr)
        return 1
    path = Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        print(f"{path}: already guarded")
        return 0
    for op in OPS:
        line = f'@torch.library.register_fake("{op}")\n'
        if text.count(line) != 1:
            print(f"error: {path} does not hold exactly one `{line.strip()}`; this torchvision version is not the "
                  "one the guard was written for", file=sys.stderr)
            return 1
        guarded = (f"{MARK}\n@(torch.library.register_fake(\"{op}\") if torchvision.extension._has_ops() "
                   "else (lambda fn: fn))\n")
        text = text.replace(line, guarded)
    path.write_text(text)
    print(f"{path}: guarded {', '.join(OPS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
