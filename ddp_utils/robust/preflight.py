"""Checks that run BEFORE ``init_process_group``, so that a bad address or a busy port fails in seconds.

Without them the usual failure is silence: ``init_process_group`` waits (30 minutes by default)
for a peer that can never arrive. Each check raises :class:`DistSetupError` with one paragraph
saying what was tried, the likely causes and what to do.

What runs where:

* every rank: pick the network interface that routes to the master and tell Gloo/NCCL to use it
  (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``); otherwise Gloo resolves the host name, often
  to 127.0.0.1, and the other node can never reach it;
* rank 0: ``master_addr`` is one of its own addresses, and ``master_port`` is free;
* ranks > 0: the master answers on ``master_addr:master_port`` (retried until ``init_timeout``).
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import time

import torch
import torch.distributed as dist

from .compat import below_floor

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SMALL_SHM = 1 << 30  # below 1 GiB, DataLoader workers in Docker tend to die with "Bus error"

# The interface variables this module set itself, so a later call may replace them (a user's may not).
_we_set: dict[str, str] = {}
_last_said: dict[str, str] = {}


class DistSetupError(RuntimeError):
    """The process group could not be set up. The message says why and what to do."""


# -- backend ----------------------------------------------------------------------------------
def resolve_backend(settings) -> str:
    """``auto`` -> ``nccl`` when this rank has a CUDA GPU, else ``gloo``; explicit ones are checked."""
    has_cuda = torch.cuda.is_available()
    if settings.backend == "auto":
        return "nccl" if has_cuda and dist.is_nccl_available() else "gloo"
    if settings.backend == "nccl" and not has_cuda:
        raise DistSetupError(
            f"rank {settings.rank}: backend='nccl' needs a CUDA GPU, but torch.cuda.is_available() is "
            f"False here. Use backend='gloo' (or 'auto') to run on CPU, or make the GPU visible "
            f"(check `nvidia-smi`; start Docker with --gpus all).")
    if settings.backend == "nccl" and not dist.is_nccl_available():
        raise DistSetupError(f"rank {settings.rank}: backend='nccl' but this PyTorch build has no NCCL. "
                             f"Use backend='gloo', or a CUDA build of PyTorch on Linux.")
    return settings.backend


# -- network interface ------------------------------------------------------------------------
def local_addresses() -> dict[str, str]:
    """Every IP address of this machine (network namespace), mapped to its interface name."""
    try:
        import psutil
        return {a.address.split("%")[0]: name for name, addrs in psutil.net_if_addrs().items()
                for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    except ImportError:  # stdlib fallback (Linux, IPv4, primary address of each interface only)
        import fcntl
        import struct
        found = {}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                    found[socket.inet_ntoa(raw[20:24])] = name
                except OSError:  # interface without an IPv4 address
                    pass
        return found


def _resolve(addr: str) -> str:
    """``addr`` (an IP or a host name) as an IP string."""
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise DistSetupError(
            f"master_addr {addr!r} cannot be resolved ({e.strerror}). Use the master node's IP "
            f"address (on a cloud network its private IP, shown by `hostname -I` on that node).") from e


def choose_interface(master_addr: str) -> tuple[str, str]:
    """``(ifname, local_ip)`` of the interface this host uses to reach ``master_addr``.

    Connecting a UDP socket sends nothing; it only asks the kernel's routing table which
    local address would be used. That address is then looked up among the interfaces.
    """
    ip = _resolve(master_addr) if master_addr else "127.0.0.1"
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # any port: nothing is sent
        except OSError as e:
            raise DistSetupError(
                f"This host has no route to master {ip} ({e.strerror}). Check master_addr: it must be "
                f"an address of the master node that this node can reach (on a cloud network, the "
                f"master's private IP).") from e
        local_ip = s.getsockname()[0].split("%")[0]
    name = local_addresses().get(local_ip)
    if name is None:
        raise DistSetupError(f"The route to master {ip} leaves from {local_ip}, but no interface has "
                             f"that address. Set socket_ifname (or GLOO_SOCKET_IFNAME) by hand.")
    return name, local_ip


def use_interface(settings, log=print) -> tuple[str, str]:
    """Choose the interface towards the master and export it for Gloo and NCCL. Returns (ifname, ip).

    Precedence: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME already set by the user, then
    ``settings.socket_ifname``, then the interface that routes to ``master_addr``.
    """
    rank, master = settings.rank, f"{settings.master_addr}:{settings.master_port}"
    if settings.socket_ifname:
        names = [n for _, n in socket.if_nameindex()]
        if settings.socket_ifname not in names:
            raise DistSetupError(f"rank {rank}: socket_ifname={settings.socket_ifname!r} is not an "
                                 f"interface of this host; it has {', '.join(names)}. Leave it empty "
                                 f"to use the one that routes to the master.")
        ifname, how = settings.socket_ifname, "from socket_ifname"
        local_ip = next((ip for ip, n in local_addresses().items() if n == ifname), "no address")
    else:
        (ifname, local_ip), how = choose_interface(settings.master_addr), "routes to the master"
    for var in IFNAME_VARS:
        value = os.environ.get(var)
        if value is not None and value != _we_set.get(var):  # the user's choice: keep it
            log(f"rank {rank}: keeping {var}={value} from the environment (instead of {ifname})")
        else:
            os.environ[var] = _we_set[var] = ifname
    line = f"rank {rank}: using interface {ifname} ({local_ip}) to reach master {master} [{how}]"
    if line != _last_said.get("interface"):  # setup re-runs the pre-flight: say it once
        log(line)
        _last_said["interface"] = line
    return ifname, local_ip


# -- ports ------------------------------------------------------------------------------------
def _listener(port: int) -> tuple[int | None, str] | None:
    """``(pid, command line)`` of the process listening on TCP ``port``; None if nobody listens.

    The pid is None where psutil is missing or may not look (then the text is a hint to run ``ss``).
    """
    hint = (None, f"a process I cannot identify (run `ss -ltnp 'sport = :{port}'` to see which)")
    try:
        import psutil
    except ImportError:
        return hint
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):  # e.g. AccessDenied on macOS without root
        return hint
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN:
            if c.pid is None:
                return hint
            try:
                cmd = " ".join(psutil.Process(c.pid).cmdline()) or psutil.Process(c.pid).name()
            except psutil.Error:
                cmd = "?"
            return c.pid, cmd[:150]
    return None


def port_holder(port: int) -> str | None:
    """Who listens on TCP ``port``: ``"pid 1234 (python -m ipykernel ...)"``, or None if nobody.

    Uses psutil; where it cannot tell (no psutil, no permission), returns a hint to run ``ss``.
    """
    found = _listener(port)
    if found is None:
        return None
    pid, text = found
    return text if pid is None else f"pid {pid} ({text})"


def check_port_free(settings, log=print) -> None:
    """Rank 0: ``master_port`` must be free, or the process group cannot listen there."""
    port = settings.master_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR, like PyTorch's store: a port left in TIME_WAIT by an earlier run is fine.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return
        except PermissionError as e:
            raise DistSetupError(f"rank 0 may not listen on port {port}: ports below 1024 need root. "
                                 f"Use a high port such as 29500, the same on ALL nodes.") from e
        except OSError as e:
            error = e
    found = _listener(port)
    if found and found[0] == os.getpid():  # our own store from an earlier setup: setup reuses it
        log(f"rank 0: port {port} is still held by this process (an earlier process group's store); "
            f"reusing it")
        return
    holder = "another process" if found is None else port_holder(port)
    raise DistSetupError(
        f"rank 0 cannot listen on master_port {port}: it is already in use by {holder}. Usually that is "
        f"an earlier run still alive, e.g. a notebook kernel that was not restarted. Free the port: "
        f"stop that process (kill it, or restart its notebook kernel), or choose another master_port "
        f"on ALL nodes (every rank must use the same one). The port is never switched silently, "
        f"because the other nodes would keep knocking on the old one.") from error


def check_master_is_local(settings) -> None:
    """Rank 0 listens on ``master_addr``; a non-loopback address must belong to this machine."""
    ip = _resolve(settings.master_addr)
    if ipaddress.ip_address(ip).is_loopback:
        return
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))  # only works for our own addresses; sends nothing
            return
        except OSError as e:
            error = e
    mine = ", ".join(f"{a} ({n})" for a, n in sorted(local_addresses().items()))
    raise DistSetupError(
        f"rank 0 runs on this machine, but master_addr {settings.master_addr} ({ip}) is not one of its "
        f"addresses ({mine}). The other ranks would knock on the wrong host. Set master_addr to this "
        f"node's address on every node; on a cloud network use the private IP (`hostname -I`), not the "
        f"public one, which belongs to the provider's NAT.") from error


def _likely_causes(error: OSError | None) -> str:
    """The causes that best match how the connection failed, most likely first."""
    refused = ("nothing listens there: the master has not started its setup cell / command yet, the "
               "port differs, or the master runs in a container without --net=host")
    dropped = ("packets are dropped: a security group / firewall blocks the port, or the address is "
               "wrong (a public IP instead of the private one, a typo)")
    if isinstance(error, ConnectionRefusedError):
        first, second = refused, dropped
    else:
        first, second = dropped, refused
    return (f"Most likely {first}. Otherwise {second}. Remember that NCCL and Gloo also open further "
            f"random ports between the nodes, so allow all TCP traffic between them, not only this "
            f"port.")


def _answer(error: OSError) -> str:
    """What the network answered a connection to the master, in words a student can act on."""
    said = error.strerror or str(error) or type(error).__name__
    if isinstance(error, ConnectionRefusedError):
        return (f"'{said}':\n  a machine has that address, but nothing listens on the port yet (rank 0 has not "
                f"run its setup yet,\n  or the ports differ)")
    if isinstance(error, (TimeoutError, socket.timeout)):
        return (f"nothing ({said}):\n  the packets are dropped, by a firewall or security group, or the address "
                f"belongs to no machine")
    return (f"'{said}':\n  no machine answers at that address (a wrong or public address, or the master node "
            f"is down),\n  or a firewall rejects the connection")


FIRST_NOTE_S = 5.0   # a student learns what the network answered within seconds, not at init_timeout


def wait_for_master(settings, log=print, local: str = "") -> float:
    """Ranks > 0: retry a TCP connection to the master until it answers or ``init_timeout`` passes.

    Returns the seconds waited. Rank 0 may simply not be started yet, hence the retries. Within
    ``FIRST_NOTE_S`` (or at the first answer that is not "refused") it says what it tried, what the
    network answered and what to compare; ``local`` names this node's interface and address.
    """
    addr, port, rank = settings.master_addr, settings.master_port, settings.rank
    start = time.monotonic()
    deadline, next_note, error, said = start + settings.init_timeout, start + FIRST_NOTE_S, None, False
    ends_at = time.strftime("%H:%M:%S", time.localtime(time.time() + settings.init_timeout))
    while True:
        try:
            # a dropped SYN never answers; an address nobody has answers "No route to host" after ~3 s (ARP)
            wait = max(0.1, min(5.0, deadline - time.monotonic()))
            with socket.create_connection((addr, port), timeout=wait):
                return time.monotonic() - start
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            break
        now = time.monotonic()
        if now > next_note or (not said and not isinstance(error, ConnectionRefusedError)):
            if not said:   # the full picture once: what was tried, the answer, what to compare, when it ends
                said = True
                tried = f" (tried from {local})" if local else ""
                # short lines: a notebook wraps lines of 100 characters and more mid-word
                log(f"rank {rank}: no answer yet from the master at {addr}:{port}{tried};\n"
                    f"  the network answered {_answer(error)}.\n"
                    f"  Compare master_addr and master_port with the line rank 0 prints when it starts\n"
                    f"  ('rank 0: listening on ADDRESS:PORT'). This rank keeps trying until init_timeout\n"
                    f"  ({settings.init_timeout:g} s, at {ends_at}), then stops with what to do.")
                next_note = now + 30
            else:   # a sign of life while waiting for a slow master
                log(f"rank {rank}: still waiting for master {addr}:{port} ({error.strerror or error}; "
                    f"{now - start:.0f} s of init_timeout={settings.init_timeout:g} s)")
                next_note += 30
        time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
    raise DistSetupError(
        f"rank {rank} cannot reach the master at {addr}:{port}: TCP connections were tried for "
        f"{settings.init_timeout:g} s (init_timeout) and the last one failed with "
        f"'{error.strerror or error}'. {_likely_causes(error)} To do: check that rank 0 is running "
        f"and that `ss -ltn 'sport = :{port}'` on its node shows a listener, compare master_addr and "
        f"master_port on all nodes, and test from this node with `nc -zv {addr} {port}`.") from error


# -- hardware ---------------------------------------------------------------------------------
def hardware_report() -> dict:
    """GPU names, NCCL version and /dev/shm size of this node (for the report and for warnings)."""
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    report = {"torch": torch.__version__, "cuda": cuda, "gpus": gpus, "nccl_version": None,
              "shm_bytes": None}
    if cuda and dist.is_nccl_available():
        with contextlib.suppress(Exception):  # NCCL in the build but not loadable: left unknown
            report["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    if os.path.isdir("/dev/shm"):
        report["shm_bytes"] = shutil.disk_usage("/dev/shm").total
    return report


# -- all together -----------------------------------------------------------------------------
def preflight(settings, log=print) -> dict:
    """Every check that can run before ``init_process_group``. Returns a report; raises DistSetupError.

    Also exports GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (see :func:`use_interface`).
    """
    problems = settings.problems()
    if problems:
        raise DistSetupError("Invalid settings: " + "; ".join(problems) + ".")
    report = {"rank": settings.rank, "world_size": settings.world_size,
              "backend": resolve_backend(settings), **hardware_report()}
    old_torch = below_floor()
    if old_torch:   # it may still work, but nothing below the floor is tested
        log(f"rank {settings.rank}: warning: {old_torch}")
    if settings.workers > 0 and report["shm_bytes"] is not None and report["shm_bytes"] < SMALL_SHM:
        log(f"rank {settings.rank}: warning: /dev/shm is only {report['shm_bytes'] >> 20} MiB; "
            f"DataLoader workers may die with 'Bus error'. Start Docker with --shm-size=2g or "
            f"--ipc=host.")
    if not settings.distributed:
        return {**report, "port_status": "not used (one process)"}
    if settings.rank == 0:
        check_master_is_local(settings)
    report["interface"], report["local_ip"] = use_interface(settings, log)
    report["master"] = f"{settings.master_addr}:{settings.master_port}"
    if settings.rank > 0:
        local = f"{report['local_ip']} on {report['interface']}"
        report["port_status"] = f"master answered after {wait_for_master(settings, log, local):.1f} s"
    elif settings.init_method == "env":  # torchrun's agent already listens on the port
        report["port_status"] = "held by the torchrun agent (env://)"
    else:
        check_port_free(settings, log)
        report["port_status"] = "free"
    return report
