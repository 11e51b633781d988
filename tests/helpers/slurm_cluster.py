"""A two-node SLURM cluster on one Linux machine, for tests: Debian's slurm-wlm and munge, each node a network
namespace (tests/helpers/netns.py).

    with slurm_cluster(tmp_path) as cluster:      # raises SlurmUnavailable without root, slurm-wlm or munge
        cluster.run("sbatch", "--parsable", "job.sh")   # a SLURM command, inside node 1 (where slurmctld runs)
        cluster.env                                  # SLURM_CONF and PATH for such commands

munged runs with a socket of its own, slurmctld and node 1's slurmd in the first namespace, node 2's slurmd in
the second, entered with ``nsenter --net`` (``ip netns exec`` would mount a /sys without the cgroups slurmd needs).
The node names (``kit<tag>n1``, unique to the cluster) are added to /etc/hosts, as a site's DNS would have them. All
of it is stopped, and the namespaces and the hosts lines removed, on exit, also after a failure.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import netns
from tests.helpers.procs import base_env, stop

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue")


class SlurmUnavailable(RuntimeError):
    """The cluster cannot be made here; the text says why."""


def enter(hosts: netns.Hosts, host: int) -> list[str]:
    """The argv prefix that runs a command in host ``host``'s network namespace, the machine's mounts kept."""
    return ["nsenter", f"--net=/run/netns/{hosts.names[host]}"]


HOSTS = Path("/etc/hosts")


MARK = "  # tests/helpers/slurm_cluster.py"


def _add_hosts(lines: str) -> None:
    """Add ``lines``; drop those a killed test run left (their namespaces are gone)."""
    alive = netns.ip("netns", "list")
    kept = [line for line in HOSTS.read_text().splitlines(keepends=True)
            if not line.rstrip().endswith(MARK.strip()) or f"-{line.split()[1][3:-2]}-h1" in alive]
    HOSTS.write_text("".join(kept) + lines)


def _remove_hosts(lines: str) -> None:
    text = HOSTS.read_text()
    if lines in text:
        HOSTS.write_text(text.replace(lines, ""))


@dataclass
class Cluster:
    hosts: netns.Hosts
    nodes: list[str]
    env: dict
    folder: Path

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM command on node 1."""
        return subprocess.run([*enter(self.hosts, 0), *argv], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def wait_for_job(self, job: str, timeout: float) -> str:
        """Wait until ``job`` has left the queue; its final state (COMPLETED, CANCELLED, FAILED, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-j", job, check=False).stdout.strip():
                break
            time.sleep(0.5)
        else:
            raise TimeoutError(f"job {job} still queued or running after {timeout:g} s")
        out = self.run("scontrol", "show", "job", job, check=False).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "gone")


def _conf(folder: Path, hosts: netns.Hosts, nodes: list[str]) -> str:
    cpus = os.cpu_count() or 1
    return "\n".join([
        "ClusterName=kit",
        f"SlurmctldHost={socket.gethostname()}({hosts.addrs[0]})",   # slurmctld checks the machine's host name
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={folder}/munge.sock",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SwitchType=switch/none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "ReturnToService=2", "KillWait=30", "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0",
        *(f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for name, addr in zip(nodes, hosts.addrs)),
        f"PartitionName=kit Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP", ""])


def _missing() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, and munged/slurmd as root)"
    absent = [name for name in DAEMONS + ("scontrol",) if not shutil.which(name)]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge)"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (apt-get install munge makes one)"
    return ""


@contextlib.contextmanager
def slurm_cluster(folder: Path, subnet: str = "10.213.21"):
    why = _missing()
    if why:
        raise SlurmUnavailable(why)
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    procs, names = [], ""
    try:
        with netns.two_hosts(subnet) as hosts:
            tag = hosts.names[0].rsplit("-", 2)[-2]
            nodes = [f"kit{tag}n1", f"kit{tag}n2"]
            for node in nodes:
                (folder / "spool" / node).mkdir(parents=True, exist_ok=True)
            names = "".join(f"{addr} {node}{MARK}\n" for addr, node in zip(hosts.addrs, nodes))
            _add_hosts(names)
            (folder / "slurm.conf").write_text(_conf(folder, hosts, nodes))
            env = {**base_env(), "SLURM_CONF": str(folder / "slurm.conf"),
                   "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}

            def start(host: int | None, *argv):
                prefix = enter(hosts, host) if host is not None else []
                log = open(folder / f"{argv[0]}-{len(procs)}.out", "w")   # noqa: SIM115 - closed with the process
                procs.append(subprocess.Popen([*prefix, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            start(None, "munged", "-F", "--force", f"--socket={folder}/munge.sock",
                  f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log",
                  f"--seed-file={folder}/munged.seed", "--key-file=/etc/munge/munge.key")
            _wait(lambda: (folder / "munge.sock").exists(), 10, "munged did not start", folder)
            start(0, "slurmctld", "-D", "-i", "-f", str(folder / "slurm.conf"))
            for host, node in enumerate(nodes):
                start(host, "slurmd", "-D", "-N", node, "-f", str(folder / "slurm.conf"))
            cluster = Cluster(hosts, nodes, env, folder)

            def idle() -> bool:
                out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
                return out.count("idle") == 2
            _wait(idle, 60, "the two nodes did not come up idle", folder)
            yield cluster
    finally:
        stop([p for p in procs if p.poll() is None])
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        if names:
            _remove_hosts(names)


def _wait(ready, timeout: float, what: str, folder: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(folder.glob("*.log"))
                     + sorted(folder.glob("*.out")))
    raise SlurmUnavailable(f"{what} within {timeout:g} s\n{logs}")
