"""Load a task environment from a Python file (`env.path`).

An env module defines

    async def step(state: str, action: str, extra_info: dict) -> dict
        # {"next_state": str | None, "reward": float, "score": float, "done": bool, "extra_info": dict}

and optionally `max_turns: int`, `async def reset(extra_info: dict) -> str | None` (a string replaces the
prompt text), `make_prompts(num: int, seed: int) -> list[dict]` (a generated prompt set whose rows look
like rows of a data file: "prompt" and "answer") and `extract_answer(response: str) -> str | None` (the
answer that `step` checks, so evaluation can compare samples' answers for maj@n). `state` is the whole conversation text so far, `action`
this turn's response; a multi-turn env returns `next_state = state + action + observation`.

Left out on purpose: Gym-style classes and env pools; an env that needs them builds them inside its own
module. Tool-use envs with sessions and tool schemas are OpenReward envs (`env.openreward.*`,
sparserl/rollout/openreward/), not env modules.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Awaitable, Callable


@dataclass
class EnvModule:
    path: str
    module: ModuleType
    step: Callable[[str, str, dict], Awaitable[dict[str, Any]]]
    reset: Callable[[dict], Awaitable[str | None]] | None = None
    max_turns: int | None = None
    make_prompts: Callable[[int, int], list[dict]] | None = None
    extract_answer: Callable[[str], str | None] | None = None

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def load_env(path: str, key: str = "env.path") -> EnvModule:
    """Import the file at `path` as a module and check that it is an env. `key` names the config entry."""
    given = os.path.expanduser(path)
    # The built-in envs (envs/...) also resolve from the project root, so the defaults work from any folder, and
    # from the package, where an installed wheel has them (setup.py ships envs/ as sparserl/envs).
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isabs(given) and not os.path.isfile(given):
        for root in (os.path.dirname(package), package):
            if os.path.isfile(os.path.join(root, given)):
                given = os.path.join(root, given)
                break
    path = os.path.abspath(given)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}={path}: no such file")
    # A unique module name per path, so two envs with the same file name do not collide in sys.modules.
    mod_name = "sparserl_env_" + "".join(c if c.isalnum() else "_" for c in path)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}={path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise

    step = getattr(module, "step", None)
    if step is None:
        raise AttributeError(f"{key}={path}: an env module must define `async def step(state, action, extra_info)`")
    if not inspect.iscoroutinefunction(step):
        raise TypeError(f"{key}={path}: `step` must be an async function (async def step(state, action, extra_info))")
    reset = getattr(module, "reset", None)
    if reset is not None and not inspect.iscoroutinefunction(reset):
        raise TypeError(f"{key}={path}: `reset` must be an async function (async def reset(extra_info))")
    max_turns = getattr(module, "max_turns", None)
    if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
        raise ValueError(f"{key}={path}: `max_turns` must be a positive int, got {max_turns!r}")
    make_prompts = getattr(module, "make_prompts", None)
    if make_prompts is not None and not callable(make_prompts):
        raise TypeError(f"{key}={path}: `make_prompts` must be a function make_prompts(num, seed)")
    extract_answer = getattr(module, "extract_answer", None)
    if extract_answer is not None and not callable(extract_answer):
        raise TypeError(f"{key}={path}: `extract_answer` must be a function extract_answer(response)")
    return EnvModule(path=path, module=module, step=step, reset=reset, max_turns=max_turns, make_prompts=make_prompts,
                     extract_answer=extract_answer)
