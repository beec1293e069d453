"""An SGLang engine in a subprocess that the tests drive over a socket, and observe.

If one of SGLang's own subprocesses fails at start-up, SGLang SIGKILLs that subprocess's parent: the engine
therefore never lives in the pytest process. `EngineHost` starts `python -m tests.sglang.host MODEL ...`,
which builds a real `SGLangEngine` and serves commands (generate, update_weights, sleep, ...) until closed;
a host that dies fails the waiting test with the tail of its log instead of hanging it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Client, Listener
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_REASON = "sglang is not installed (bash scripts/install_sglang_cpu.sh, then run tests/sglang in .venv-sglang)"


class HostError(RuntimeError):
    """An exception raised inside the host; `kind` is its type name."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class EngineHost:
    """The host process starts at construction; the first command (or `wait_ready`) waits for its engine. Hosts made
    one after another thus start side by side (an SGLang start is mostly single-threaded imports, ~30-60 s on the
    CI machine's two cores)."""

    def __init__(self, model_dir: Path, options, seed: int = 0, start_timeout: float = 480.0):
        self.workdir = Path(tempfile.mkdtemp(prefix="sglang-host-"))
        self.log_path = self.workdir / "host.log"
        address = str(self.workdir / "sock")
        authkey = secrets.token_bytes(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang.host", address, authkey.hex(), str(model_dir),
             json.dumps(asdict(options)), str(seed)],
            cwd=ROOT, env=env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
        )
        self._box: list = []
        self._accepter = threading.Thread(target=lambda: self._box.append(self._listener.accept()), daemon=True)
        self._accepter.start()
        self.start_timeout = start_timeout
        self.conn = None
        self.start_s: float | None = None  # the engine's own start time, once ready

    def wait_ready(self) -> "EngineHost":
        """Block until the host's engine has started (a no-op after the first time)."""
        if self.conn is None:
            self._wait(lambda: not self._accepter.is_alive(), self.start_timeout, "connect")
            self.conn = self._box[0]
            self._listener.close()
            self.start_s = self._call("ready", timeout=self.start_timeout)
        return self

    def _wait(self, done, timeout: float, what: str) -> None:
        t0 = time.monotonic()
        while not done():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang host exited with {self.proc.returncode} during {what}:\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the SGLang host did not answer {what} in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def _call(self, cmd: str, *args, timeout: float = 480.0):
        if cmd != "ready":
            self.wait_ready()
            self.conn.send((cmd, args))
        self._wait(lambda: self.conn.poll(0), timeout, cmd)
        status, payload = self.conn.recv()
        if status == "error":
            raise HostError(*payload)
        return payload

    def generate(self, requests, cutoff=None):
        """The engine's generate (a `Cutoff` as partial rollouts give it; no progress callback across processes)."""
        return self._call("generate", requests, None, cutoff)

    def update_weights(self, named_tensors, bucket_mb: float | None = None):
        # As numpy arrays: a tensor pickled over a multiprocessing connection is shared by file descriptor, which
        # the host (not a multiprocessing child of pytest) cannot authenticate to fetch.
        return self._call("update_weights", [(n, t.detach().numpy()) for n, t in named_tensors], bucket_mb)

    def sleep(self):
        return self._call("sleep")

    def wake(self):
        return self._call("wake")

    def stats(self):
        return self._call("stats")

    def reset_stats(self):
        return self._call("reset_stats")

    def set_seed(self, seed: int):
        return self._call("set_seed", seed)

    def kv_trace(self):
        """Kept logical positions of every compaction of the last generate (engines started with kv_trace)."""
        return self._call("kv_trace")

    def draw_trace(self):
        """The position each token's noise was keyed by, per (request id, sample index), for the last generate."""
        return self._call("draw_trace")

    def kv_counters(self):
        """The sparserl_kv scheduler's counters since the last read (KV-compressing engines)."""
        return self._call("kv_counters")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._call("close", timeout=120)
            finally:
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()


def _serve(address: str, authkey_hex: str, model_dir: str, options_json: str, seed: int) -> None:
    from transformers import AutoTokenizer

    from sparserl.engines.sglang.engine import SGLangEngine, SGLangOptions
    from sparserl.engines.weight_sync import sync_weights

    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(authkey_hex))
    t0 = time.perf_counter()
    engine = SGLangEngine(model_dir, SGLangOptions(**json.loads(options_json)), AutoTokenizer.from_pretrained(model_dir), seed)
    conn.send(("ok", time.perf_counter() - t0))

    def update(named, bucket_mb):
        import torch

        named = [(n, torch.from_numpy(a)) for n, a in named]
        # The trainer's path: sync_weights cuts the tensors into buckets and calls engine.update_weights per bucket.
        return sync_weights(named, engine, bucket_mb) if bucket_mb else engine.update_weights(named)

    commands = {
        "generate": engine.generate, "update_weights": update, "sleep": engine.sleep, "wake": engine.wake,
        "stats": engine.stats, "reset_stats": engine.reset_stats, "set_seed": lambda s: setattr(engine, "seed", s),
        "kv_trace": lambda: engine.kv_trace, "draw_trace": lambda: engine.draw_trace,
        "kv_counters": lambda: engine.kv_counters(),
    }
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            engine.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            traceback.print_exc()
            conn.send(("error", (type(e).__name__, str(e))))


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
