"""Two simulated hosts on one Linux machine: network namespaces joined by a veth pair.

    with two_hosts("10.213.1") as net:         # raises NetnsUnavailable without root / iproute2
        net.addrs          # ["10.213.1.1", "10.213.1.2"], each only inside its own namespace
        net.veths          # ["veth<tag>a", "veth<tag>b"], host 1's and host 2's end of the cable
        net.names          # ["ddptest-<pid>-<tag>-h1", "ddptest-<pid>-<tag>-h2"]
        net.exec_prefix(0) # ["ip", "netns", "exec", "ddptest-<tag>-h1"]: run a command on host 1
    open_only_port(net, 29500)  # a firewall between them that lets through only that TCP port

Each namespace has only ``lo`` and its veth end, so traffic can reach nothing but the other
namespace. ``many_hosts(8)``: eight hosts on one switch (a bridge in a namespace of its own). Names are
unique per call; the namespaces (and with them the veths) are always deleted on exit, also after a failure,
together with any process of ours still inside them.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import uuid
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (needs root and iproute2); the text says why."""


def ip(*args: str) -> str:
    """Run ``ip ARGS``; raise CalledProcessError (with ip's message) on failure."""
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20).stdout


@dataclass(frozen=True)
class Hosts:
    names: list[str]
    veths: list[str]
    addrs: list[str]

    def exec_prefix(self, host: int) -> list[str]:
        """The argv prefix that runs a command inside host ``host`` (0 or 1; any of ``many_hosts``)."""
        return ["ip", "netns", "exec", self.names[host]]


@contextlib.contextmanager
def _namespaces():
    """Yield ``add(name)``, which makes a network namespace; every one made is deleted on exit (also after a
    failure), with any process of ours still inside. The first ``add`` raises NetnsUnavailable where none can be
    made, and clears what a run killed hard left behind."""
    made: list[str] = []

    def add(name: str) -> None:
        try:
            ip("netns", "add", name)
        except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired) as e:
            if made:
                raise
            detail = getattr(e, "stderr", None) or e
            raise NetnsUnavailable(f"cannot create a network namespace (needs root and iproute2): "
                                   f"{str(detail).strip()}") from None
        if not made:
            _delete_leftovers()
        made.append(name)
    try:
        yield add
    finally:
        for name in made:
            _kill_inside(name)
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=20)


@contextlib.contextmanager
def two_hosts(subnet: str = "10.213.1"):
    """Yield :class:`Hosts`: ``subnet``.1/24 in the first namespace, ``subnet``.2/24 in the second."""
    tag = uuid.uuid4().hex[:6]
    names = [f"ddptest-{os.getpid()}-{tag}-h1", f"ddptest-{os.getpid()}-{tag}-h2"]
    veths = [f"veth{tag}a", f"veth{tag}b"]  # at most 15 characters
    addrs = [f"{subnet}.1", f"{subnet}.2"]
    with _namespaces() as add:
        for name in names:
            add(name)
        ip("link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name", veths[1],
           "netns", names[1])
        for name, veth, addr in zip(names, veths, addrs):
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")  # kernels and stores talk over loopback too
        yield Hosts(names, veths, addrs)


@contextlib.contextmanager
def many_hosts(count: int, subnet: str = "10.214.0"):
    """Yield :class:`Hosts` for ``count`` hosts on one switch: a namespace holding a bridge, and a veth from each
    host to it; host ``i`` has ``subnet``.(i + 1)/24. ``veths[i]`` is host ``i``'s end (down: that host is cut off)."""
    tag = uuid.uuid4().hex[:6]
    switch = f"ddptest-{os.getpid()}-{tag}-sw"
    names = [f"ddptest-{os.getpid()}-{tag}-h{i + 1}" for i in range(count)]
    veths = [f"v{tag}h{i}" for i in range(count)]   # at most 15 characters
    with _namespaces() as add:
        add(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, (name, veth) in enumerate(zip(names, veths)):
            add(name)
            ip("link", "add", veth, "netns", name, "type", "veth", "peer", "name", f"v{tag}s{i}", "netns", switch)
            ip("-n", switch, "link", "set", f"v{tag}s{i}", "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield Hosts(names, veths, [f"{subnet}.{i + 1}" for i in range(count)])


def open_only_port(hosts: Hosts, port: int) -> None:
    """A firewall between the hosts that lets through TCP to or from ``port`` only (a security group that opens
    only MASTER_PORT): every other TCP packet leaving a host is dropped, so a connection to another port hangs
    until its timeout, as behind a real one. Made with tc on each veth (HTB: a class for the port, and a class
    whose queue holds no packet for all other TCP), the only queueing this machine's kernel offers without modules."""
    for name, veth in zip(hosts.names, hosts.veths):
        tc = ["tc", "-n", name]
        for args in (["qdisc", "add", "dev", veth, "root", "handle", "1:", "htb", "default", "10"],
                     ["class", "add", "dev", veth, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"],
                     ["class", "add", "dev", veth, "parent", "1:", "classid", "1:20", "htb", "rate", "8bit", "ceil",
                      "8bit"],
                     ["qdisc", "add", "dev", veth, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0"],
                     *[["filter", "add", "dev", veth, "parent", "1:", "prio", str(prio), "protocol", "ip", "u32",
                        "match", "ip", "protocol", "6", "0xff", "match", "ip", end, str(port), "0xffff", "flowid",
                        "1:10"] for prio, end in ((1, "dport"), (2, "sport"))],
                     ["filter", "add", "dev", veth, "parent", "1:", "prio", "3", "protocol", "ip", "u32", "match",
                      "ip", "protocol", "6", "0xff", "flowid", "1:20"]):
            subprocess.run([*tc, *args], check=True, capture_output=True, text=True, timeout=20)


def _delete_leftovers() -> None:
    """A test run killed hard cannot clean up; its namespaces carry its pid, so a later run can."""
    try:
        listing = ip("netns", "list")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return
    for line in listing.splitlines():
        match = re.match(r"(ddptest-(\d+)-\w+-(h\d+|sw))\b", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            _kill_inside(match.group(1))
            subprocess.run(["ip", "netns", "del", match.group(1)], check=False, capture_output=True, timeout=20)


def _kill_inside(name: str) -> None:
    """Kill what still runs in namespace ``name``: only our own commands ever entered it."""
    try:
        pids = ip("netns", "pids", name).split()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def two_hosts_or_skip(subnet: str):
    """``two_hosts`` for a pytest fixture: skipped, with the reason printed, where namespaces cannot be made."""
    import pytest
    try:
        with two_hosts(subnet) as hosts:
            yield hosts
    except NetnsUnavailable as e:
        pytest.skip(str(e))
