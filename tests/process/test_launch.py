"""tests/launch.py, what the other tests start their processes with: through the session's fork server and without it,
a run gets its ranks' output, environment, working directory and exit code, a real gloo group over the torchrun
variables, and a failing rank or a killed client stops every rank."""
import os
import subprocess
import time

import pytest

from tests.launch import command

WORKER = '''
import os, sys, time
import torch
import torch.distributed as dist
rank = os.environ.get("RANK")
print(f"rank={rank} world={os.environ.get('WORLD_SIZE')} cwd={os.getcwd()} x={os.environ.get('LAUNCH_TEST_X')} "
      f"threads={torch.get_num_threads()} pid={os.getpid()}", flush=True)
if rank is not None:
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"sum={t.item():g}", flush=True)
    dist.destroy_process_group()
mode = sys.argv[1]
if mode == "fail" and rank in (None, "1"):
    print("rank 1 fails", file=sys.stderr, flush=True)
    sys.exit(7)
if mode in ("fail", "sleep"):
    time.sleep(300)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(params=["server", "direct"])
def launch_env(request, monkeypatch):
    monkeypatch.setenv("SPARSERL_TEST_FORK_SERVER", "1" if request.param == "server" else "0")
    return {**os.environ, "LAUNCH_TEST_X": "hello", "OMP_NUM_THREADS": "1"}


def test_two_ranks_share_a_gloo_group_and_see_the_callers_environment(tmp_path, launch_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = subprocess.run(command(2, script, "ok"), env=launch_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("rank="))
    assert [line.split()[:2] for line in lines] == [["rank=0", "world=2"], ["rank=1", "world=2"]]
    assert all(f"cwd={tmp_path}" in line and "x=hello" in line and "threads=1" in line for line in lines)
    assert res.stdout.count("sum=3") == 2


def test_one_process_runs_without_the_torchrun_variables(tmp_path, launch_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = subprocess.run(command(1, script, "fail"), env=launch_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 7 and "rank 1 fails" in res.stderr
    assert "rank=None world=None" in res.stdout


def test_a_module_runs_as_main(tmp_path, launch_env):
    res = subprocess.run(command(2, "-m", "json.tool", "--help"), env=launch_env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.count("usage: python -m json.tool") == 2, res.stderr[-2000:]


def test_a_failing_rank_stops_the_other_and_gives_its_exit_code(tmp_path, launch_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    start = time.monotonic()
    res = subprocess.run(command(2, script, "fail"), env=launch_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 7, (res.returncode, res.stderr[-2000:])
    assert time.monotonic() - start < 120  # rank 0 sleeps 300 s unless it is stopped
    pids = [int(line.split("pid=")[1]) for line in res.stdout.splitlines() if "pid=" in line]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_a_killed_caller_takes_its_ranks_with_it(tmp_path, launch_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(command(2, script, "sleep"), env=launch_env, cwd=tmp_path, stdout=f,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while out.read_text().count("sum=3") < 2:
        assert time.monotonic() < deadline and proc.poll() is None, out.read_text()[-2000:]
        time.sleep(0.1)
    pids = [int(line.split("pid=")[1]) for line in out.read_text().splitlines() if "pid=" in line]
    proc.kill()  # what subprocess.run does on a timeout
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "ranks outlived the killed caller"
        time.sleep(0.1)


def test_a_caller_with_stdin_closed_gives_its_ranks_an_empty_one(tmp_path, monkeypatch):
    """Through the server, a closed stdin must not be replaced by the client's socket (the first free number)."""
    monkeypatch.setenv("SPARSERL_TEST_FORK_SERVER", "1")
    script = tmp_path / "reader.py"
    # One write per rank (atomic on a pipe): the two ranks share the caller's stdout, and a print() of two arguments
    # may reach it in two writes that the other rank's interleave.
    script.write_text("import os, sys\nos.write(1, f'read {sys.stdin.read()!r}\\n'.encode())\n")
    cmd = " ".join(command(2, script))
    res = subprocess.run(f"exec 0<&-; {cmd}", shell=True, executable="/bin/bash", capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.count("read ''") == 2, (res.stdout, res.stderr[-2000:])


def test_a_server_first_used_from_a_thread_that_exits_serves_the_next_run(tmp_path):
    """A fresh fork server, started and first used from a worker thread (as a thread pool running two trainers side
    by side does), outlives that thread: a 2-rank run after the thread has exited goes through it."""
    import threading

    from tests.launch import start_server

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "LAUNCH_TEST_X": "hello", "OMP_NUM_THREADS": "1"}
    first = {}

    def start_and_use():
        server = first["server"] = start_server()  # a new server, not the session's
        first["run"] = subprocess.run(server.command(1, script, "ok"), env=env, cwd=tmp_path, capture_output=True,
                                      text=True, timeout=300)

    worker = threading.Thread(target=start_and_use)
    worker.start()
    worker.join()
    server = first["server"]
    try:
        assert first["run"].returncode == 0, first["run"].stderr[-2000:]
        time.sleep(0.5)  # time for a signal sent at the thread's exit to arrive
        assert server.alive()
        res = subprocess.run(server.command(2, script, "ok"), env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.count("sum=3") == 2
    finally:
        server.stop()
    assert not server.alive()


def test_a_client_whose_server_is_gone_says_so_in_one_line(tmp_path):
    from tests.launch import start_server

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    server = start_server()
    server.proc.kill()
    server.proc.wait()
    res = subprocess.run(server.command(2, script, "ok"), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().count("\n") == 0 and "fork server" in res.stderr and "is gone" in res.stderr, res.stderr
    assert "rank=" not in res.stdout
