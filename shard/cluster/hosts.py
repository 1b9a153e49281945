"""Where an elastic job's processes may run: process slots on hosts, from a hosts file, a discovery script
that prints the hosts there are now (Horovod's `--host-discovery-script`), or this machine alone. A line
is `HOST` (one slot) or `HOST:SLOTS`; blank lines and `#` comments are skipped."""

import subprocess
from pathlib import Path

from shard.errors import ShardError

DISCOVERY_TIMEOUT_S = 30


def parse_slots(text: str, where: str) -> list[str]:
    """One entry per process slot, in the order given: `h1:2` is [h1, h1]."""
    slots = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, count = line.partition(":")
        if not host or any(c.isspace() for c in host) or (count and not count.isdigit()) or count == "0":
            raise ShardError(f"{where} line {n}: {raw.strip()!r} is not HOST or HOST:SLOTS (slots a whole number "
                             "above 0)")
        slots += [host] * (int(count) if count else 1)
    return slots


class HostSlots:
    """The slots a job may use now: a fixed list (a hosts file, or this machine's `local` slots), or what
    the discovery script prints each time it is asked."""

    def __init__(self, *, hosts_file: str | None = None, discovery: str | None = None, local: int = 1,
                 slots: list[str] | None = None):
        if hosts_file and discovery:
            raise ShardError("give --hosts or --host-discovery, not both")
        self.discovery = discovery
        self.fixed = None
        self.problem = ""  # why the discovery script's last answer was not taken
        if slots:  # given whole: a SLURM allocation's nodes (allocation_slots)
            self.fixed = list(slots)
        elif hosts_file:
            path = Path(hosts_file)
            if not path.is_file():
                raise ShardError(f"--hosts {hosts_file} is not a file")
            self.fixed = parse_slots(path.read_text(), f"hosts file {hosts_file}")
            if not self.fixed:
                raise ShardError(f"hosts file {hosts_file} lists no host")
        elif not discovery:
            self.fixed = ["localhost"] * local
        self.last = list(self.fixed) if self.fixed is not None else self._discover()

    def current(self) -> list[str]:
        """The slots there are now. A discovery script that fails, or lists no host, keeps the last list
        it gave (a flaky script must not shrink a healthy job; hosts truly gone lose their workers, which
        is seen as such); `problem` then says why."""
        self.problem = ""
        if self.fixed is not None:
            return list(self.fixed)
        try:
            self.last = self._discover()
        except ShardError as e:
            self.problem = str(e)
        return list(self.last)

    def _discover(self) -> list[str]:
        try:
            done = subprocess.run([self.discovery], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S)
        except OSError as e:
            raise ShardError(f"--host-discovery {self.discovery} can't run: {e.strerror or e}") from None
        except subprocess.TimeoutExpired:
            raise ShardError(f"--host-discovery {self.discovery} did not answer in {DISCOVERY_TIMEOUT_S} s") from None
        if done.returncode:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            raise ShardError(f"--host-discovery {self.discovery} exited with {done.returncode}" +
                             (f": {last}" if last else ""))
        slots = parse_slots(done.stdout, f"--host-discovery {self.discovery}'s output")
        if not slots:  # a script caught mid-rewrite of its file, or a hiccup: never read as every host gone
            raise ShardError(f"--host-discovery {self.discovery} listed no host")
        return slots


def allocation_slots(env) -> list[str]:
    """The slots of the SLURM allocation this runs in (its nodes, SLURM_NTASKS_PER_NODE each, else one):
    where `shard launch --engine srun` starts its steps; [] outside an allocation."""
    nodes = env.get("SLURM_JOB_NODELIST")
    if not nodes:
        return []
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    per_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    per_node = int(per_node) if per_node.isdigit() else 1
    return [host for host in done.stdout.split() for _ in range(per_node)] if done.returncode == 0 else []
