"""Math answer checking with math-verify, under a hard time limit.

`verify_answer(response, answer)` takes the last `\\boxed{}` of the response (boxed-only extraction, so a
number merely mentioned in the reasoning earns nothing) and checks it against the reference with
`math_verify.parse` / `verify`, which know LaTeX, fractions, sets, intervals and symbolic equivalence.

Why a process pool: sympy can take minutes (or forever) on a pathological expression, and math-verify's
own timeout uses `signal.alarm`, which works only in the main thread; env steps run in asyncio tasks and
threads. So checks run in persistent worker processes (`CheckPool`: fresh interpreters, not forks, since the
trainer holds threads and maybe CUDA) with math-verify's timeouts disabled, and the parent waits at most `timeout_s` for
the answer. A worker that misses its deadline is killed and replaced on the next call; the check returns
None ("could not decide"), which envs score as wrong. Spawning costs about a second once per worker; the
deadline starts only after the worker is up.

`default_pool()` is the one process-wide pool `verify_answer` uses unless given another: created on first
use, 2 workers, closed at interpreter exit.

Left out on purpose: the Qwen/simplelr grader (evaluation parity belongs to the eval suite), answer
normalisation beyond math-verify's, and partial credit.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

log = logging.getLogger(__name__)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"(-?)(\d+(?:,\d{3})*(?:\.\d+)?)")
_STARTUP_TIMEOUT_S = 120.0


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`), nested braces kept; None if none."""
    starts = list(_BOXED.finditer(text))
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unbalanced: try an earlier box
        if m.group(0) != m.group(0).rstrip():  # "\boxed 5" form
            bare = re.match(r"[^\s$]+", text[i:])
            if bare:
                return bare.group(0)
    return None


def extract_last_integer(text: str) -> int | None:
    """The last number in `text` if it is integral (`1,234` -> 1234, `12.0` -> 12, `-3` -> -3), else None.

    A minus sign directly after a letter or digit is a hyphen or an operator, not a sign ("10-3" -> 3).
    """
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    value = float(m.group(2).replace(",", "")) if "." in m.group(2) else int(m.group(2).replace(",", ""))
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    negative = m.group(1) == "-" and not (m.start() > 0 and text[m.start() - 1].isalnum())
    return -value if negative else value


# ---------------------------------------------------------------- worker processes


def _serve(read_fd: int, write_fd: int) -> None:
    """Loop of one check process: receive (fn, args), send ("ok", result) or ("err", message)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning is expected here
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        import math_verify  # noqa: F401  (warm the import before saying ready)
    except Exception:  # the parent hears about it on the first check
        pass
    conn_out.send(("ready", None))
    while True:
        try:
            payload = conn_in.recv_bytes()
        except (EOFError, OSError):
            return  # the parent went away
        try:
            fn, args = pickle.loads(payload)
            conn_out.send(("ok", fn(*args)))
        except Exception as e:  # noqa: BLE001 - any failure of a check is reported, never fatal
            conn_out.send(("err", f"{type(e).__name__}: {e}"))


class _Worker:
    """A `python -m sparserl.rewards.math` child talking over two pipes. A plain subprocess rather than
    multiprocessing: spawn/forkserver re-import the parent's `__main__` (the trainer script, or nothing
    importable at all under `python -c` or stdin), fork copies threads and CUDA state."""

    def __init__(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # fn may live in any importable module
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sparserl.rewards.math", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.send_conn, self.recv_conn = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)
        if not self.recv_conn.poll(_STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"answer-check worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        self.recv_conn.recv()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.send_conn.close()
        self.recv_conn.close()


class CheckPool:
    """Persistent worker processes that run picklable functions with a hard deadline per call."""

    def __init__(self, max_workers: int = 2) -> None:
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """`fn(*args)` in a worker. Raises TimeoutError past `timeout_s` (the worker is killed), RuntimeError
        when `fn` raised in the worker."""
        payload = pickle.dumps((fn, args))  # fails here, not halfway into a worker, when fn is not picklable
        with self._slots:
            with self._lock:
                if self._closed:
                    raise RuntimeError("CheckPool is closed")
                worker = self._idle.pop() if self._idle else None
            if worker is None or not worker.alive():
                worker = _Worker()
            try:
                worker.send_conn.send_bytes(payload)
                ready = worker.recv_conn.poll(timeout_s)
                status, value = worker.recv_conn.recv() if ready else ("timeout", None)
            except (EOFError, OSError) as e:
                status, value = "dead", f"worker died: {e}"
            if status in ("timeout", "dead"):
                worker.kill()
            else:
                with self._lock:
                    self._idle.append(worker)
        if status == "timeout":
            raise TimeoutError(f"check took longer than {timeout_s} s")
        if status in ("err", "dead"):
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_default_pool: CheckPool | None = None
_default_lock = threading.Lock()


def default_pool() -> CheckPool:
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = CheckPool()
            atexit.register(_default_pool.close)
        return _default_pool


# ---------------------------------------------------------------- math-verify


def _wrap_gold(answer: str) -> str:
    return answer if ("$" in answer or "\\boxed" in answer) else "\\boxed{" + answer + "}"


def math_verify_check(predicted: str, answer: str) -> bool:
    """math-verify on one boxed prediction; runs inside a worker (timeouts off: the parent enforces them)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(_wrap_gold(answer), extraction_config=configs, parsing_timeout=None)
    if not gold:
        gold = parse(answer, extraction_config=configs, parsing_timeout=None)
    pred = parse("\\boxed{" + predicted + "}", extraction_config=configs, parsing_timeout=None)
    if not gold or not pred:
        return predicted.strip() == answer.strip()
    return bool(verify(gold, pred, timeout_seconds=None))


def verify_answer(response: str, answer: str, timeout_s: float = 5.0, pool: CheckPool | None = None) -> bool | None:
    """True/False: whether the last `\\boxed{}` of `response` equals `answer`; None when the check ran past
    `timeout_s` or crashed (logged). A response without a box is False without starting a worker."""
    predicted = extract_boxed(response)
    if predicted is None or not predicted.strip():
        return False
    try:
        return (pool or default_pool()).call(math_verify_check, (predicted, str(answer)), timeout_s)
    except TimeoutError:
        log.warning("math-verify timed out after %.1f s on answer %.80r vs %.80r", timeout_s, predicted, answer)
        return None
    except RuntimeError as e:
        log.warning("math-verify failed on %.80r vs %.80r: %s", predicted, answer, e)
        return None


async def averify_answer(response: str, answer: str, timeout_s: float = 5.0, pool: CheckPool | None = None) -> bool | None:
    """`verify_answer` without blocking the event loop (for env steps)."""
    return await asyncio.to_thread(verify_answer, response, answer, timeout_s, pool)


if __name__ == "__main__":  # a CheckPool worker: python -m sparserl.rewards.math READ_FD WRITE_FD
    _serve(int(sys.argv[1]), int(sys.argv[2]))
