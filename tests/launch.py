"""How the tests start their trainer and worker processes: forked from a process that has imported torch and
transformers once, instead of a fresh interpreter (and torchrun) per run.

    python tests/launch.py --nproc=N script.py [args ...]
    python tests/launch.py --nproc=N -m package.module [args ...]

Tests build the command with `command(nproc, *target)`. The first call in a test session starts a fork server
(`--serve=SOCKET`, one per session, gone with it) that imports torch and transformers and waits. Each command is then
a small client (`--via=SOCKET`, no torch) that hands the server its stdin/stdout/stderr, environment, working
directory and target; the server forks a launcher for it, which forks one process per rank and returns the first
failing rank's exit code to the client. So a test's `subprocess.run(command(...), capture_output=True, timeout=...)`
behaves as with `python ...` or `torchrun ...`: the output is the ranks', the exit code theirs, and a client that is
killed (a timeout) takes its ranks with it. With `SPARSERL_TEST_FORK_SERVER=0`, or where a server cannot start,
`--nproc=N` forks the ranks itself after importing, and one process runs as plain `python ...`.

With N > 1 every rank gets the variables `torchrun --standalone` sets and that the code reads (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), then runs the script or module as `__main__`.
The process group is real (gloo over TCP), as under torchrun; what is saved is the import of torch and transformers
in every process (~8 s of CPU each on the 2-core CI machine) and torchrun's own start. Nothing computes before a
fork, so no thread pool is forked. A rank that fails makes the others stop (SIGTERM, then SIGKILL). Every forked
process dies with its parent (PR_SET_PDEATHSIG, armed only in processes whose parent has one thread: the launchers and
the ranks). The server itself follows the test session through a pipe on its stdin, not PR_SET_PDEATHSIG: Linux sends
that signal when the parent *thread* exits, so a server first asked for from a worker thread (a thread pool running
two trainers side by side) would die with that thread. The pipe's other end is the session's; it closes when the
session's process exits, whichever thread started the server.

Tests of the launch itself (elastic restarts, signals, several nodes) and the SGLang tests run the real torchrun.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import runpy
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

PR_SET_PDEATHSIG = 1
# What the tests' processes import and take seconds to: imported once, before any fork.
PRELOAD = ("torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2", "omegaconf", "hydra")
LAUNCH = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(LAUNCH))
_server: Server | None = None
_server_lock = threading.Lock()


def command(nproc: int, *target: str) -> list[str]:
    """The command line that runs `target` (a script and its arguments, or "-m", a module and its arguments) on
    `nproc` ranks."""
    target = tuple(map(str, target))
    server = _session_server()
    if server is not None:
        return server.command(nproc, *target)
    return [sys.executable, *target] if nproc == 1 else [sys.executable, LAUNCH, f"--nproc={nproc}", *target]


def driver(folder, script: str) -> list[str]:
    """The command line that runs `script` (a driver such as benchmarks/replicate_gain.py, followed by its arguments)
    as `python script`, except that the Python processes it starts itself (`[sys.executable, "-m", module, ...]` or
    `[sys.executable, other_script, ...]`) run through this session's fork server: its `sys.executable` is an
    executable file written in `folder` that hands its arguments to the server as one process. Without a server
    (`SPARSERL_TEST_FORK_SERVER=0`) that file runs Python itself."""
    shim = os.path.join(str(folder), "python")
    with open(shim, "w") as f:
        f.write("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in command(1)) + ' "$@"\n')
    os.chmod(shim, 0o755)
    boot = ("import os, runpy, sys; sys.executable = sys.argv.pop(1); sys.argv.pop(0); "
            "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')")
    return [sys.executable, "-c", boot, shim, str(script)]


class Server:
    """A fork server: `command(...)` runs a target through it, `stop()` ends it (closing its stdin)."""

    def __init__(self, proc: subprocess.Popen, path: str) -> None:
        self.proc, self.path = proc, path

    def command(self, nproc: int, *target: str) -> list[str]:
        return [sys.executable, LAUNCH, f"--via={self.path}", f"--server-pid={self.proc.pid}", f"--nproc={nproc}",
                *map(str, target)]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the server exits at the end of its stdin
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server() -> Server:
    """A new fork server, from any thread: it lives until `stop()` or until this process exits. It imports with the
    hub offline (huggingface_hub reads HF_HUB_OFFLINE at import): no test reaches a model hub."""
    folder = tempfile.mkdtemp(prefix="sparserl-fork-")
    path = os.path.join(folder, "socket")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    with open(os.path.join(folder, "server.log"), "w") as log:
        # stdin: a pipe whose write end only this process holds (non-inheritable), closed when it exits.
        proc = subprocess.Popen([sys.executable, LAUNCH, f"--serve={path}"], env=env, stdin=subprocess.PIPE,
                                stdout=log, stderr=log, cwd=ROOT)
    server = Server(proc, path)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    atexit.register(server.stop)  # runs first
    return server


def _session_server() -> Server | None:
    """This session's fork server, started on first use and again if it has died; None when switched off."""
    global _server
    if os.environ.get("SPARSERL_TEST_FORK_SERVER", "1") == "0" or not hasattr(socket, "send_fds"):
        return None
    with _server_lock:  # side-by-side runs ask from several threads at once
        if _server is None or not _server.alive():
            _server = start_server()
        return _server


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the prctl
        os._exit(1)


def _free_port() -> int:
    """A port rank 0 can listen on: a free one below Linux's ephemeral range (32768-60999), which outgoing
    connections draw from, so that none of them takes it between this check and rank 0's bind (EADDRINUSE)."""
    import random

    for _ in range(100):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _run_rank(rank: int, nproc: int, port: int, target: list[str]) -> None:
    """In the child: become rank `rank` and run the target as `__main__`; never returns."""
    code = 0
    try:
        _die_with_parent()
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and "torch" in sys.modules:  # OpenMP read the parent's environment when torch was imported
            sys.modules["torch"].set_num_threads(int(threads))
        if nproc > 1:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                              LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
        _flush()
        os._exit(code)


def _stop(pids: set[int], grace: float = 10.0) -> None:
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
                pids.discard(pid)
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _run_ranks(nproc: int, target: list[str], watch: socket.socket | None = None) -> int:
    """Fork the ranks and wait for them: the first failing rank's exit code, 0 when all succeed. With `watch`, a
    client's connection: when it closes, the ranks are stopped."""
    port = _free_port()
    _flush()
    pids: set[int] = set()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            if watch is not None:
                watch.close()
            _run_rank(rank, nproc, port, target)
        pids.add(pid)
    first_failure = 0
    while pids:
        if watch is not None:
            readable, _, _ = select.select([watch], [], [], 0.1)
            if readable and not watch.recv(1):  # the client is gone
                _stop(pids)
                return 1
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                continue
        else:
            pid, status = os.wait()
        pids.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not first_failure:
            first_failure = code if code > 0 else 128 - code
            _stop(pids)
    return first_failure


def _preload() -> None:
    for module in PRELOAD:
        importlib.import_module(module)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return data


def _serve(path: str) -> None:
    """Import, then fork a launcher for every client that connects, until stdin ends; never returns."""
    _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)  # clients connect once the socket is listening
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers are reaped by the kernel
    while True:
        readable, _, _ = select.select([server, 0], [], [])
        if 0 in readable and not os.read(0, 4096):  # the session is gone (or stopped this server)
            os._exit(0)  # its launchers and their ranks follow (PR_SET_PDEATHSIG)
        if server not in readable:
            continue
        conn, _ = server.accept()
        try:
            header, fds, _, _ = socket.recv_fds(conn, 8, 3)
            header += _recv_exactly(conn, 8 - len(header))
            request = json.loads(_recv_exactly(conn, struct.unpack("!Q", header)[0]))
        except (ConnectionError, OSError, ValueError):
            conn.close()
            continue
        _flush()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _launch_for(conn, fds, request)
        conn.close()
        for fd in fds:
            os.close(fd)


def _launch_for(conn: socket.socket, fds: list[int], request: dict) -> None:
    """In a launcher forked by the server: take the client's streams, environment and directory, run its ranks,
    send back the exit code; never returns."""
    code = 1
    try:
        _die_with_parent()
        for fd, std in zip(fds, (0, 1, 2)):
            os.dup2(fd, std)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:
                sys.path.insert(1, entry)
        code = _run_ranks(request["nproc"], request["target"], watch=conn)
    except BaseException:  # noqa: BLE001 - reported to the client as a failed run
        traceback.print_exc()
    try:
        _flush()
        conn.sendall(struct.pack("!i", code))
    finally:
        os._exit(0)


def _gone(pid: int | None) -> bool:
    """Whether the server `pid` has exited (a zombie counts as exited)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _client(path: str, nproc: int, target: list[str], server_pid: int | None = None) -> int:
    """Run `target` on `nproc` ranks through the fork server at `path`; its exit code."""
    streams = []
    for fd in (0, 1, 2):  # a stream the caller closed becomes /dev/null (before the socket could take its number)
        try:
            os.fstat(fd)
            streams.append(fd)
        except OSError:
            streams.append(os.open(os.devnull, os.O_RDWR))
    gone = (f"launch: the fork server at {path} is gone (its log: {os.path.join(os.path.dirname(path), 'server.log')}); "
            "the next command of the test session starts another")
    deadline = time.monotonic() + 300
    while not os.path.exists(path):  # the server is still importing
        if _gone(server_pid):
            print(gone, file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"launch: no fork server at {path} after 300 s", file=sys.stderr)
            return 1
        time.sleep(0.05)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        print(gone, file=sys.stderr)
        return 1
    body = json.dumps({"nproc": nproc, "target": target, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], streams)
    conn.sendall(body)
    try:
        return struct.unpack("!i", _recv_exactly(conn, 4))[0]
    except ConnectionError:
        print("launch: the fork server's launcher died without an exit code" +
              (" (the server is gone)" if _gone(server_pid) else ""), file=sys.stderr)
        return 1


def main(argv: list[str]) -> int:
    if argv and argv[0].startswith("--serve="):
        _serve(argv[0].split("=", 1)[1])
    via = server_pid = None
    if argv and argv[0].startswith("--via="):
        via, argv = argv[0].split("=", 1)[1], argv[1:]
    if argv and argv[0].startswith("--server-pid="):
        server_pid, argv = int(argv[0].split("=", 1)[1]), argv[1:]
    if len(argv) < 2 or not argv[0].startswith("--nproc="):
        print("usage: python tests/launch.py [--via=SOCKET [--server-pid=PID]] --nproc=N (script.py | -m module) [args ...]",
              file=sys.stderr)
        return 2
    nproc, target = int(argv[0].split("=", 1)[1]), argv[1:]
    if via is not None:
        return _client(via, nproc, target, server_pid)
    _preload()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # the ranks follow (PR_SET_PDEATHSIG)
    return _run_ranks(nproc, target)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
