"""Serve OpenReward `Environment` classes from a Python file on this machine (`env.openreward.serve`).

The file's environments are the classes listed in its `ENVIRONMENTS`, or else every `Environment` subclass
it defines itself. They are served with the SDK's own `Server` (the same HTTP protocol as the hosted
platform), so the trainer's client code does not know the difference:

- `ServerProcess.start(path)`: a child process (`python -m sparserl.rollout.openreward.serve PATH`), what the
  trainer's rank 0 runs. The env code cannot stall training, and the child ends with its parent: its stdin is a
  pipe whose other end only the parent holds, and it stops when that closes (the parent exits, however it dies,
  or calls `stop()`). Not the Linux parent-death signal: that follows the parent *thread* that started the child,
  so a server started from a worker thread would die with the thread. Its log goes to a file.
- `ThreadServer(classes)`: uvicorn in a daemon thread of this process, for tests and notebooks.

Both bind 127.0.0.1 and a free port unless told otherwise, and are ready (answering `/health`) when they
return. The SDK's update check and its per-request INFO logs are off unless the environment sets
`OPENREWARD_DISABLE_UPDATE_CHECK` / `OPENREWARD_LOG_LEVEL`.

Left out on purpose: TLS, authentication (the local server accepts any key) and serving other hosts
(`--host 0.0.0.0` works, but then the machine's network is the only guard).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("OPENREWARD_LOG_LEVEL", "WARNING")


def resolve_path(path: str) -> Path:
    """`path` as given, or relative to the project root (so `envs/...` works from any folder), or to the package
    (an installed wheel has envs/ as sparserl/envs)."""
    given = Path(os.path.expanduser(path))
    if not given.is_absolute() and not given.is_file():
        for root in Path(__file__).resolve().parents[3:1:-1]:
            if (root / given).is_file():
                return root / given
    return given.absolute()


def environment_classes(path: str) -> list[type]:
    """The Environment classes that the file at `path` serves (see the module docstring)."""
    from openreward.environments import Environment

    file = resolve_path(path)
    if not file.is_file():
        raise FileNotFoundError(f"env.openreward.serve={path}: no such file")
    mod_name = "sparserl_openreward_env_" + "".join(c if c.isalnum() else "_" for c in str(file))
    spec = importlib.util.spec_from_file_location(mod_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"env.openreward.serve={path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    listed = getattr(module, "ENVIRONMENTS", None)
    if listed is not None:
        classes = list(listed)
    else:
        classes = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Environment)
                   and c.__module__ == mod_name and not inspect.isabstract(c)]
    bad = [c for c in classes if not (inspect.isclass(c) and issubclass(c, Environment))]
    if bad or not classes:
        raise TypeError(f"env.openreward.serve={path}: " + (f"ENVIRONMENTS holds {bad[0]!r}, not an Environment class" if bad
                        else "defines no openreward.environments.Environment subclass"))
    return classes


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if not alive():
            raise RuntimeError(f"the OpenReward env server for {url} exited before it answered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the OpenReward env server at {url} did not answer /health within {timeout_s:g} s")
        time.sleep(0.1)


def _sse_exit_event_per_loop() -> None:
    """sse-starlette 2.3.6 (the version the SDK pins) keeps ONE process-wide `anyio.Event` for "the server is
    shutting down", created by the first SSE stream in whatever event loop it runs. A second server in this
    process (another thread, another loop: two `ThreadServer`s, or one started after another stopped) then
    fails every SSE request with "bound to a different event loop". Give each running loop its own event;
    uvicorn's exit signal still sets them all."""
    import asyncio
    import weakref

    import anyio
    from sse_starlette import sse

    if getattr(sse.EventSourceResponse, "_exit_event_per_loop", False) or not hasattr(sse.AppStatus,
                                                                                       "should_exit_event"):
        return
    events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    lock = threading.Lock()

    async def listen_for_exit_signal() -> None:
        if sse.AppStatus.should_exit:
            return
        loop = asyncio.get_running_loop()
        with lock:
            event = events.get(loop)
            if event is None:
                event = events[loop] = anyio.Event()
        if not sse.AppStatus.should_exit:
            await event.wait()

    original_exit = sse.AppStatus.handle_exit

    def handle_exit(*args, **kwargs):
        with lock:
            pending = list(events.items())
        for loop, event in pending:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)
        original_exit(*args, **kwargs)

    sse.AppStatus.handle_exit = staticmethod(handle_exit)
    try:
        from uvicorn.main import Server as UvicornServer

        if UvicornServer.handle_exit is original_exit:  # sse-starlette hooked uvicorn's exit at import
            UvicornServer.handle_exit = handle_exit
    except ImportError:
        pass
    sse.EventSourceResponse._listen_for_exit_signal = staticmethod(listen_for_exit_signal)
    sse.EventSourceResponse._exit_event_per_loop = True


class ThreadServer:
    """`classes` served by uvicorn in a daemon thread; `url` once constructed, `stop()` to end it."""

    def __init__(self, classes: list[type], host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> None:
        import uvicorn
        from openreward.environments import Server

        _sse_exit_event_per_loop()

        sock = _bind(host, port)
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.env_server = Server(list(classes))  # the SDK's server object (tests read its open sessions)
        self._server = uvicorn.Server(uvicorn.Config(self.env_server.app, log_level="warning", access_log=False,
                                                     timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="openreward-env-server")
        self._thread.start()
        wait_healthy(self.url, timeout_s, self._thread.is_alive)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)


def _follow_stdin() -> None:
    """Stop this process (SIGTERM, which uvicorn answers with a graceful shutdown) when stdin ends: the parent that
    holds the pipe's other end has exited or closed it."""
    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


class ServerProcess:
    """A child process serving the environments of one file (what the trainer's rank 0 runs)."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path | None) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    @classmethod
    def start(cls, path: str, host: str = "127.0.0.1", port: int = 0, log_path: str | Path | None = None,
              timeout_s: float = 120.0) -> "ServerProcess":
        sock = _bind(host, port)
        url = f"http://{host}:{sock.getsockname()[1]}"
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:  # stdin: the lifeline (module docstring); its write end stays in `proc.stdin` until stop()
            proc = subprocess.Popen([sys.executable, "-m", "sparserl.rollout.openreward.serve", str(resolve_path(path)),
                                     "--fd", str(sock.fileno()), "--exit-with-stdin"], stdin=subprocess.PIPE,
                                    stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(sock.fileno(),))
        finally:
            sock.close()  # the child holds its own copy
            if log_path:
                log.close()
        server = cls(proc, url, Path(log_path) if log_path else None)
        try:
            wait_healthy(url, timeout_s, lambda: proc.poll() is None)
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparserl.rollout.openreward.serve",
                                 description="Serve the OpenReward environments of a Python file.")
    ap.add_argument("path", help="Python file defining Environment classes (or ENVIRONMENTS = [...])")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--fd", type=int, default=None, help="serve on this inherited, bound socket instead")
    ap.add_argument("--exit-with-stdin", action="store_true", help="stop when stdin ends (the parent's lifeline)")
    args = ap.parse_args(argv)
    if args.exit_with_stdin:
        _follow_stdin()
    import uvicorn
    from openreward.environments import Server

    classes = environment_classes(args.path)
    sock = socket.socket(fileno=args.fd) if args.fd is not None else _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"serving {', '.join(c.__name__ for c in classes)} from {args.path} on http://{host}:{port}", flush=True)
    uvicorn.Server(uvicorn.Config(Server(classes).app, log_level="warning", access_log=False,
                                  timeout_graceful_shutdown=1)).run(sockets=[sock])


if __name__ == "__main__":
    main()
