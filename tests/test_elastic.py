"""`shard launch`: the supervisor that starts, watches and restarts a training job. Local processes with
simulated devices (3 processes x 2 devices, `data=-1,model=2`): a worker killed with kill -9 and then
process 0, a host that leaves the discovery's list and comes back, a loss past the restart budget, a
worker's own error, a rank of an mpiexec job; the curve stays the uninterrupted one. And the pure parts:
which sizes fit, host slots, process sets after a restart."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shard.cluster.hosts import HostSlots, parse_slots
from shard.cluster.sizes import SizePolicy
from shard.errors import ShardError
from shard.observe.metrics import read_events, read_jsonl
from shard.run.checkpoint_files import step_dirs
from shard.sharding.mesh import parse_mesh
from shard.testing import finish, free_ports, subprocess_env

BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
ARGS = ["--model", "tiny", "--mesh", "data=-1,model=2", "--simulate-devices", "2", "--steps", "10", "--batch", "12",
        "--seq", "32", "--log-every", "1", "--checkpoint-every", "2", "--keep", "10", "--failure-timeout", "20"]


def env() -> dict:
    out = subprocess_env()
    out["PATH"] = f"{BIN}{os.pathsep}{out.get('PATH', '')}"
    return out


_SUPERVISORS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_supervisor_outlives_its_test():
    """A test that fails while its job runs must not leave it training beside the rest of the suite: the
    supervisor is killed (its workers die with it)."""
    yield
    while _SUPERVISORS:
        supervisor = _SUPERVISORS.pop()
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def launch(tmp_path: Path, *options: str, args=ARGS, run_dir: str = "r", environ: dict | None = None):
    """`shard launch OPTIONS -- ARGS --run-dir RUN_DIR` in the background, its output in files."""
    with open(tmp_path / "launch.out", "w") as out, open(tmp_path / "launch.err", "w") as err:  # the child keeps them
        _SUPERVISORS.append(subprocess.Popen([sys.executable, "-m", "shard", "launch", *options, "--", *args,
                                              "--run-dir", run_dir], cwd=tmp_path, env=environ or env(), stdout=out,
                                             stderr=err))
    return _SUPERVISORS[-1]


def steps(run_dir: Path) -> list[dict]:
    """The step records, the last of each step (a restart redoes some)."""
    path = run_dir / "metrics.jsonl"
    records = read_jsonl(path) if path.is_file() else []
    return list({r["step"]: r for r in records}.values())


def wait_until(done, timeout: float = 300, what: str = "", supervisor: subprocess.Popen | None = None,
               tmp_path: Path | None = None):
    """Poll `done` until it holds; a supervisor that ended first fails at once, with its output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := done():
            return value
        if supervisor is not None and supervisor.poll() is not None:
            raise AssertionError(f"shard launch ended with {supervisor.returncode} before {what}:\n"
                                 + (output(tmp_path)[-3000:] if tmp_path else ""))
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{output(tmp_path)[-3000:]}" if tmp_path else ""))


def write_hosts(path: Path, text: str) -> None:
    """Replace a hosts file whole (a discovery script never reads it half written)."""
    path.with_name(path.name + ".new").write_text(text)
    os.replace(path.with_name(path.name + ".new"), path)


def pid_of(run_dir: Path, rank: int, after: float = 0.0) -> int:
    """The pid of process `rank` of the start under way (its status file, written after `after`)."""
    path = run_dir / ".launch" / f"process-{rank}.json"
    wait_until(lambda: path.is_file() and path.stat().st_mtime >= after, what=f"process {rank} to start")
    return json.loads(path.read_text())["pid"]


def output(tmp_path: Path) -> str:
    return (tmp_path / "launch.out").read_text() + (tmp_path / "launch.err").read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The job's losses on one process of 8 devices, never interrupted (data=4,model=2), by its --steps."""
    import shard

    losses = {}

    def of(steps: int) -> list[float]:
        if steps not in losses:
            run = tmp_path_factory.mktemp("uninterrupted") / "run"
            settings = {"model": {"name": "tiny"}, "mesh": {"spec": "data=4,model=2"}, "steps": steps, "log_every": 1,
                        "data": {"batch": 12, "seq_len": 32}, "checkpoint": {"every": 0}, "run_dir": str(run)}
            losses[steps] = [r["loss"] for r in shard.run_training(settings).records]
        return losses[steps]

    return of


def test_killed_workers_cost_restarts_on_the_processes_left_and_the_curve_stays(tmp_path, uninterrupted):
    """kill -9 of process 2 of 3: the job goes on on 2 processes (data=2,model=2) from its newest
    checkpoint; then the new process 0 (where the coordinator runs) killed: on 1, within --max-restarts 2.
    It finishes with exit 0, its losses are the uninterrupted run's (rtol 1e-5) and, while it ran on 2,
    bitwise those of a manual --resume on 2 processes from the same checkpoint."""
    supervisor = launch(tmp_path, "--processes", "3", "--min-processes", "1", "--max-restarts", "2",
                        args=[*ARGS, "--steps", "14"])
    run = tmp_path / "r"
    # a checkpoint stands before the kill: saves are asynchronous, and on a loaded machine step 2's may
    # still be under way when step 3 is logged (the job would then start again from step 0)
    wait_until(lambda: len(steps(run)) >= 3 and step_dirs(run / "checkpoints"), what="step 3 and a checkpoint",
               supervisor=supervisor, tmp_path=tmp_path)
    os.kill(pid_of(run, 2), signal.SIGKILL)
    wait_until(lambda: "continuing on 2 processes, data=2,model=2" in output(tmp_path), what="the first restart",
               supervisor=supervisor, tmp_path=tmp_path)
    at = int(re.search(r"continuing on 2 processes, data=2,model=2, from step (\d+)", output(tmp_path))[1])
    wait_until(lambda: max(step_dirs(run / "checkpoints"), default=-1) >= at + 2, what="a checkpoint on 2 processes",
               supervisor=supervisor, tmp_path=tmp_path)
    os.kill(pid_of(run, 0), signal.SIGKILL)
    assert supervisor.wait(timeout=400) == 0, output(tmp_path)[-3000:]
    said = output(tmp_path)
    assert "lost process 2 (host localhost): continuing on 2 processes, data=2,model=2, from step " in said, said
    assert "lost process 0 (host localhost): continuing on 1 process, data=1,model=2, from step " in said, said
    first, second = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "resize"]
    assert (first["processes"], first["lost_processes"], first["source"]) == (2, [2], "checkpoint"), first
    assert (second["processes"], second["lost_processes"]) == (1, [0]) and second["step"] > at, second
    losses = [r["loss"] for r in steps(run)]
    np.testing.assert_allclose(losses, uninterrupted(14), rtol=1e-5)
    # a manual --resume from the same checkpoint on 2 processes: bitwise, up to where the job lost process 0
    manual = tmp_path / "manual"
    (manual / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.toml", manual / "config.toml")
    shutil.copytree(run / "checkpoints" / str(at), manual / "checkpoints" / str(at))
    port = free_ports()[0]
    procs = [subprocess.Popen([sys.executable, "-m", "shard", "train", *ARGS, "--steps", "14", "--run-dir", str(manual),
                               "--resume", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                               "--process-id", str(i)],
                              cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    assert [rc for rc, _, _ in finish(procs)] == [0, 0]
    assert [r["loss"] for r in steps(manual)][:second["step"] - at] == losses[at:second["step"]]


def test_a_host_that_leaves_and_comes_back_shrinks_and_grows_the_job(tmp_path, uninterrupted):
    """The discovery script's list loses h2 (its worker is stopped: the job goes on on 2 processes from its
    newest local snapshot), then lists it again (the job saves at its next step and grows
    back to 3); the curve is the uninterrupted one, and each change of size is a line and a record."""
    hosts = tmp_path / "hosts.txt"
    write_hosts(hosts, "h0\nh1\nh2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    supervisor = launch(tmp_path, "--host-discovery", str(script), "--discovery-interval", "0.5", "--min-processes", "2",
                        "--max-processes", "3",
                        args=[*ARGS, "--steps", "30", "--checkpoint-every", "10", "--set", "checkpoint.local_every=2",
                              "--set", f"checkpoint.local_dir={tmp_path / 'snapshots'}"])
    run = tmp_path / "r"
    # a snapshot stands before h2 leaves (it is saved asynchronously, and may lag step 3 on a loaded machine)
    wait_until(lambda: len(steps(run)) >= 3 and step_dirs(tmp_path / "snapshots"), what="step 3 and a snapshot",
               supervisor=supervisor, tmp_path=tmp_path)
    snapshot = max(step_dirs(tmp_path / "snapshots"))
    write_hosts(hosts, "h0\nh1\n")
    wait_until(lambda: "continuing on 2 processes" in output(tmp_path), what="the job to shrink",
               supervisor=supervisor, tmp_path=tmp_path)
    write_hosts(hosts, "h0\nh1\nh2\n")
    assert supervisor.wait(timeout=400) == 0, output(tmp_path)[-3000:]
    said = output(tmp_path)
    assert "lost process 2 (host h2): continuing on 2 processes, data=2,model=2" in said, said
    assert "3 process slots: growing to 3 processes, data=3,model=2" in said, said
    events = read_events(run / "metrics.jsonl")
    assert [e["event"] for e in events] == ["launch_start", "resize", "resize", "launch_end"], events
    assert [e["reason"] for e in events[1:3]] == ["lost", "grow"] and events[-1]["ended"] == "finished"
    # the loss resumed from a local snapshot, the newest one (at least the one that stood when h2 left: the
    # steps redone are those logged while later snapshots were written); the grow from the save it asked for
    assert events[1]["source"] == "local snapshot" and events[1]["step"] >= snapshot, (snapshot, events[1])
    assert events[2]["source"] == "checkpoint" and events[2]["steps_redone"] == 0, events[2]
    np.testing.assert_allclose([r["loss"] for r in steps(run)], uninterrupted(30), rtol=1e-5)


def test_a_loss_past_the_restart_budget_stops_the_job_with_a_line(tmp_path):
    """With --max-restarts 0 the first lost process stops the supervisor: exit 3, a line naming the budget,
    and the launch's end recorded as such."""
    supervisor = launch(tmp_path, "--processes", "2", "--max-restarts", "0")
    run = tmp_path / "r"
    wait_until(lambda: len(steps(run)) >= 2, what="step 2", supervisor=supervisor, tmp_path=tmp_path)
    os.kill(pid_of(run, 0), signal.SIGKILL)
    assert supervisor.wait(timeout=300) == 3, output(tmp_path)[-3000:]
    assert "lost process 0 (host localhost): the restart budget of 0 is spent; stopping" in output(tmp_path)
    assert [e["ended"] for e in read_events(run / "metrics.jsonl") if e["event"] == "launch_end"] == \
        ["restart budget"]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: ./install.sh mpi")
def test_the_mpiexec_engine_restarts_a_killed_rank_with_a_new_mpiexec(tmp_path):
    """--engine mpiexec: a rank killed takes its mpiexec down (MPICH ends the job); the supervisor starts
    a new mpiexec on the slot left, which resumes the run and finishes it."""
    supervisor = launch(tmp_path, "--engine", "mpiexec", "--processes", "2", args=[*ARGS, "--steps", "8"])
    run = tmp_path / "r"
    wait_until(lambda: len(steps(run)) >= 3, what="step 3", supervisor=supervisor, tmp_path=tmp_path)
    os.kill(pid_of(run, 1), signal.SIGKILL)
    assert supervisor.wait(timeout=300) == 0, output(tmp_path)[-3000:]
    assert "continuing on 1 process, data=1,model=2, from step" in output(tmp_path)
    assert max(r["step"] for r in steps(run)) == 8


def test_a_workers_own_error_stops_the_job_without_a_restart(tmp_path):
    """A worker that stops on the user's error (out of memory, exit 2) is never restarted: the job stops
    with exit 2 and that worker's line."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import sys\n"
        "argv = sys.orig_argv\n"
        "if '--process-id' in argv and argv[argv.index('--process-id') + 1] == '1':\n"
        "    from shard.data import batches\n"
        "    def _oom(*a, **k):\n"
        "        raise MemoryError('simulated on process 1')\n"
        "    batches.BatchStream.next = _oom\n")
    environ = env()
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(inject), environ.get("PYTHONPATH")]))
    supervisor = launch(tmp_path, "--processes", "2", environ=environ)
    assert supervisor.wait(timeout=300) == 2, output(tmp_path)[-3000:]
    said = output(tmp_path)
    assert "error: out of memory (simulated on process 1)" in said and "continuing on" not in said, said


# --- the pure parts ---------------------------------------------------------------------------------------


def test_the_largest_size_that_the_mesh_and_the_batch_divide_is_chosen():
    policy = SizePolicy.of(parse_mesh("data=-1,model=2"), {}, 2, batch=8, microbatches=1, min_processes=1,
                           max_processes=4)
    assert policy.largest(4) == 4 and policy.describe(4) == "data=4,model=2"
    assert policy.largest(3) == 2  # data=3 does not divide a batch of 8
    assert "does not divide over the 3 data-parallel devices" in policy.problem(3)
    assert policy.largest(1) == 1  # down to --min-processes
    in_four = SizePolicy.of(parse_mesh("data=-1,model=2"), {}, 2, batch=8, microbatches=4, min_processes=1,
                            max_processes=4)  # 8 rows in 4 microbatches: 2 a microbatch, over at most 2 devices
    assert in_four.largest(4) == 2 and "data-parallel devices of data=4,model=2 in 4 microbatches" in in_four.problem(4)
    with pytest.raises(ShardError, match="fewer than --min-processes 2"):
        SizePolicy.of(parse_mesh("data=-1,model=2"), {}, 2, 8, 1, 2, 4).largest(1)
    with pytest.raises(ShardError, match="needs a mesh with one -1 axis"):
        SizePolicy.of(parse_mesh("data=4,model=2"), {}, 2, 8, 1, 1, 4)


def test_host_slots_from_a_file_or_a_discovery_script(tmp_path):
    assert parse_slots("h0\nh1:2  # two\n\n", "x") == ["h0", "h1", "h1"]
    with pytest.raises(ShardError, match="line 1: 'h0:x' is not HOST or HOST:SLOTS"):
        parse_slots("h0:x\n", "x")
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho h0:2\n")
    script.chmod(0o755)
    slots = HostSlots(discovery=str(script))
    assert slots.current() == ["h0", "h0"]
    script.write_text("#!/bin/sh\nexit 5\n")
    assert slots.current() == ["h0", "h0"] and "exited with 5" in slots.problem  # the last list is kept
    script.write_text("#!/bin/sh\n")  # no host at all: a file caught mid-rewrite, never "every host left"
    assert slots.current() == ["h0", "h0"] and "listed no host" in slots.problem


def test_too_few_slots_after_a_loss_wait_for_discovery_up_to_the_elastic_timeout(tmp_path):
    """With --host-discovery, a loss that leaves fewer slots than any size needs waits for the script to
    list more (Horovod's --elastic-timeout), and says so; past the timeout it stops in one line."""
    import threading
    from dataclasses import replace
    from types import SimpleNamespace

    from shard.run.elastic import LaunchOptions, _Supervisor

    hosts = tmp_path / "hosts.txt"
    write_hosts(hosts, "h0\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    policy = SizePolicy.of(parse_mesh("data=-1,model=2"), {}, 2, batch=8, microbatches=1, min_processes=2,
                           max_processes=4)
    said = []
    supervisor = _Supervisor([], SimpleNamespace(run_dir=str(tmp_path)), policy, HostSlots(discovery=str(script)),
                             LaunchOptions(discover_every_s=0.05, elastic_timeout_s=0.3), said.append, said.append)
    assert supervisor._next_size() is None, said
    assert said[0].startswith("1 process slot(s) left, fewer than --min-processes 2: waiting up to 0.3 s"), said
    assert said[-1].startswith("can't continue: 1 process slot(s) left"), said
    supervisor.options = replace(supervisor.options, elastic_timeout_s=120)
    threading.Timer(0.3, write_hosts, (hosts, "h0\nh1\nh2\n")).start()
    assert supervisor._next_size() == 2  # three slots back; data=3 does not divide 8


def test_a_process_set_over_ranks_a_smaller_job_lacks_is_refused_and_the_world_is_the_new_one():
    """After a restart on fewer processes, a set over the ranks that are gone is one line; world() is the
    job as it is now (here: this one process)."""
    from shard.cluster import process_sets

    with pytest.raises(ShardError, match=r"process set ranks must be in 0\.\.0, got \[0, 3\]"):
        process_sets.process_set([0, 3])
    assert process_sets.world().ranks == (0,)
