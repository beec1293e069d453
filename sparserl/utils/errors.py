"""User-facing errors and the entry-point wrapper that reports them.

A `UserError` is a mistake the user can fix (a misspelled key, a missing file, a bad row); the entry point
prints it as one line `error: <message>` on stderr and exits with code 2, without a traceback. A `RunStopped`
(the run ended itself on purpose) is one line `stopped: <message>`, with its own exit code (3, or 75 when
preempted). Anything else is a bug and keeps its traceback.

Under torchrun (or any launcher that sets LOCAL_RANK), the line is printed once: by local rank 0 of each
node. Every rank computes the same config and reads the same files, so the others would repeat it word for word;
they stay silent and wait a few seconds before exiting, so that the launcher, seeing the first rank exit, stops them
(SIGTERM) rather than them stopping the rank that prints. The printing rank records the message in torch's elastic
error file (`TORCHELASTIC_ERROR_FILE`, the file torchrun's `@record` decorator writes; a silent rank that was not
stopped records its own), so torchrun's closing summary names the error under "Root Cause" in place of "To enable
traceback see ...". An unexpected
exception keeps its traceback on every rank and is recorded there with it. torchrun itself still exits 1 with its
own summary; the ranks exit 2 (a user error) or 3 / 75 (`RunStopped`).

Left out on purpose: error codes, exception hierarchies per subsystem, and gathering errors across ranks. An error
that only a rank other than local rank 0 meets (a file missing on one node is met by that node's local rank 0) is
printed by no one, but names the root cause in torchrun's summary.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Callable, NoReturn

USER_ERROR_EXIT_CODE = 2
RUN_STOPPED_EXIT_CODE = 3
QUIET_RANK_WAIT_S = 5.0  # a silent rank's wait before exiting: the launcher stops it first when the printing rank failed too


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


def prints_errors() -> bool:
    """Whether this process prints the one-line errors: local rank 0 (or the only process)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


def record_for_launcher(message: str, callstack: str | None = None) -> None:
    """Write torchrun's elastic error file (`TORCHELASTIC_ERROR_FILE`, the format of torch's `ErrorHandler`), so its
    summary names `message` (or `callstack`, a traceback) as the root cause. Without torchrun: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": callstack or message,
                                                          "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the summary falls back to torchrun's own text
        pass


def _wait_to_be_stopped() -> None:
    """A silent rank's pause before it exits, ended early by the launcher's SIGTERM (a preemption handler that caught
    it before is set aside)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(QUIET_RANK_WAIT_S)


def _exit_with_line(prefix: str, exc: BaseException, code: int) -> NoReturn:
    message = one_line(exc)
    if prints_errors():
        record_for_launcher(f"{prefix} {message} (exit code {code})")
        print(f"{prefix} {message}", file=sys.stderr, flush=True)
    else:  # recorded only if the launcher did not stop this rank first: then it alone met the error
        _wait_to_be_stopped()
        record_for_launcher(f"{prefix} {message} (exit code {code})")
    _teardown_distributed()
    sys.exit(code)


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
        _exit_with_line("error:", exc, USER_ERROR_EXIT_CODE)
    except RunStopped as exc:
        _exit_with_line("stopped:", exc, exc.exit_code)
    except Exception as exc:
        record_for_launcher(f"{type(exc).__name__}: {exc}", traceback.format_exc())
        raise
    _teardown_distributed()
