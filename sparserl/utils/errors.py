"""User-facing errors and the entry-point wrapper that reports them.

A `UserError` is a mistake the user can fix (a misspelled key, a missing file, a bad row); the entry point
prints it as one line `error: <message>` on stderr and exits with code 2, without a traceback. A `RunStopped`
(the run ended itself on purpose) is one line `stopped: <message>`, with its own exit code (3, or 75 when
preempted). Anything else is a bug and keeps its traceback.

Left out on purpose: error codes, exception hierarchies per subsystem, and gathering errors across ranks.
Every rank that fails prints its own line, since an error local to one rank (a file missing on one node)
must not be hidden by rank filtering.
"""
from __future__ import annotations

import sys
from typing import Callable, NoReturn

USER_ERROR_EXIT_CODE = 2
RUN_STOPPED_EXIT_CODE = 3


class UserError(Exception):
    """A problem with the user's config, data or files; the message names the offending key, file or row."""


class RunStopped(Exception):
    """The run stopped itself on purpose: one line on stderr and `exit_code` (3: too many non-finite steps in
    a row; 75: preempted after saving, sparserl/trainer/faults.py)."""

    def __init__(self, message: str, exit_code: int = RUN_STOPPED_EXIT_CODE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [UserError, FileNotFoundError]
    try:  # hydra and omegaconf are core dependencies, but the wrapper must work without them.
        from hydra.errors import ConfigCompositionException

        types.append(ConfigCompositionException)
    except ImportError:
        pass
    try:
        from omegaconf.errors import ConfigKeyError

        types.append(ConfigKeyError)
    except ImportError:
        pass
    return tuple(types)


def one_line(exc: BaseException) -> str:
    """The exception's message on a single line (hydra's messages span several)."""
    text = str(exc).strip() or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _teardown_distributed() -> None:
    if "torch.distributed" not in sys.modules:  # never initialized; do not pay for importing torch
        return
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a failed teardown must not hide the message being reported
        pass


def _exit_with_user_error(exc: BaseException) -> NoReturn:
    print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
    _teardown_distributed()
    sys.exit(USER_ERROR_EXIT_CODE)


def run_main(fn: Callable[[], None]) -> None:
    """Run an entry point: user errors become one stderr line and exit code 2; other exceptions re-raise.

    The process group is destroyed on a clean return and on a user error. On an unexpected exception it is
    left to torchrun: peers may be blocked in a collective, a graceful destroy can then hang, and the
    traceback matters more. glibc's allocator is tuned first (utils/memory.py `tune_malloc`).
    """
    from sparserl.utils.memory import tune_malloc

    tune_malloc()
    try:
        fn()
    except _user_error_types() as exc:
        _exit_with_user_error(exc)
    except RunStopped as exc:
        print(f"stopped: {one_line(exc)}", file=sys.stderr, flush=True)
        _teardown_distributed()
        sys.exit(exc.exit_code)
    _teardown_distributed()
