"""A torchrun stand-in for the tests: one process per rank on this machine, forked from a parent that has imported
torch and transformers once.

    python tests/launch.py --nproc=N script.py [args ...]
    python tests/launch.py --nproc=N -m package.module [args ...]

Tests build the command with `command(nproc, *target)`: with one process, the target runs alone, as `python ...`.

Every rank gets the variables `torchrun --standalone` sets and that the code reads (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), then runs the script or module as `__main__`. The process
group is real (gloo over TCP, rendezvous through MASTER_ADDR/MASTER_PORT), as under torchrun; what is saved is the
import of torch and transformers in every rank (~8 s of CPU each on the 2-core CI machine) and torchrun's own start.
The parent imports and nothing else: no torch op runs before the fork, so no thread pool is forked. A rank that
fails makes the others stop (SIGTERM, then SIGKILL), and the exit code is the first failing rank's. The ranks die
with the parent (PR_SET_PDEATHSIG), so a test's timeout that kills the parent leaves nothing behind.

Tests of the launch itself (elastic restarts, signals, several nodes) and the SGLang tests run the real torchrun.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
# What every rank of the tests imports and takes seconds to: the parent imports these before it forks.
PRELOAD = ("torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2", "omegaconf", "hydra")


LAUNCH = os.path.abspath(__file__)


def command(nproc: int, *target: str) -> list[str]:
    """The command line that runs `target` (a script and its arguments, or "-m", a module and its arguments) on
    `nproc` ranks."""
    target = tuple(map(str, target))
    return [sys.executable, *target] if nproc == 1 else [sys.executable, LAUNCH, f"--nproc={nproc}", *target]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run_rank(rank: int, nproc: int, port: int, target: list[str]) -> None:
    """In the child: become rank `rank` and run the target as `__main__`; never returns."""
    code = 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the prctl
            os._exit(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - a rank's failure is printed and becomes its exit code
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(pids: dict[int, int], grace: float = 10.0) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                pids.pop(pid)
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].startswith("--nproc="):
        print("usage: python tests/launch.py --nproc=N (script.py | -m module) [args ...]", file=sys.stderr)
        return 2
    nproc = int(argv[0].split("=", 1)[1])
    target = argv[1:]
    for module in PRELOAD:  # imported once here, inherited by every rank
        importlib.import_module(module)

    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, nproc, port, target)
        pids[pid] = rank
    signal.signal(signal.SIGTERM, lambda *_: (_stop(dict(pids)), os._exit(143)))
    first_failure = 0
    while pids:
        pid, status = os.wait()
        pids.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not first_failure:
            first_failure = code if code > 0 else 128 - code
            _stop(pids)
    return first_failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
