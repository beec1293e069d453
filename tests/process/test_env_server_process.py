"""`ServerProcess`, the env server child that the trainer's rank 0 starts: it outlives the thread that started it
and ends with the process that did (its stdin is the lifeline), however that process ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

pytest.importorskip("openreward")
pytest.importorskip("uvicorn")

from sparserl.rollout.openreward.serve import ServerProcess  # noqa: E402

ENVS = "envs/tool_use.py"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_a_server_started_from_a_thread_that_exits_keeps_serving(tmp_path):
    started = {}
    worker = threading.Thread(target=lambda: started.update(server=ServerProcess.start(ENVS, log_path=tmp_path / "log")))
    worker.start()
    worker.join()
    server = started["server"]
    try:
        time.sleep(0.5)  # time for a signal sent at the thread's exit to arrive
        assert server.proc.poll() is None and _healthy(server.url)
    finally:
        server.stop()
    assert server.proc.poll() is not None


def test_the_server_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """The parent is killed with SIGKILL (no atexit, no stop()): the server sees its stdin end and exits."""
    parent = textwrap.dedent(f"""
        import sys, time
        from sparserl.rollout.openreward.serve import ServerProcess
        server = ServerProcess.start({ENVS!r})
        print(server.proc.pid, server.url, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        pid, url = proc.stdout.readline().split()
        assert _healthy(url)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _gone_within(int(pid), 30), "the env server outlived the process that started it"
