"""A fork server for the suite's rank processes: torch, torchvision and the kit imported once, forked per command.

Why: on the 2-core CI machine a rank process spends ~8 CPU-s importing torch, torchvision (which pulls in
torch._dynamo) and the kit before it trains for one; the suite starts hundreds of them. ``procs.run_all`` starts
``python -m ddp_utils ...`` and ``python tests/<script>.py ...`` through this server when it can:

    argv = zygote.wrap([sys.executable, "-m", "ddp_utils", "train", ...], env)   # -> a tiny client process

The client (this file run with ``python -S``, no torch) hands the server its stdin/stdout/stderr, working folder,
environment and argv; the server forks a child that becomes that command (its own session, the fds, the folder,
the environment, ``sys.argv``, ``__main__``) and reports its pid and exit status. The client forwards the signals
it gets (SIGINT, SIGTERM, ...) to the child and exits as the child did (the same code, or killed by the same
signal); if the client is killed (SIGKILL at a test's time bound), the server kills the child's process group.

A forked child takes its environment whole, but what the interpreter and the native libraries read at start-up
(PYTHON*, LD_*, OMP_* threads, CUDA_VISIBLE_DEVICES, TORCHINDUCTOR_*, ...) it has from its server. So servers are
keyed on every variable but an allow-list of those read later (TAKEN_AFTER_START: the ranks' MASTER_*/RANK/...,
pytest's, W&B's, NCCL's): each distinct set gets a server of its own (up to MAX_SERVERS; beyond, the command runs
as a real process), and the session's summary names the variables that split them. Commands with interpreter
options (``-c``, ``-X``) run as real processes, and every command does when ``DDP_KIT_ZYGOTE=0``. A command on a
namespace host (``ip netns exec NAME python ...``) is forked into that host's network namespace (setns).

torchrun's workers (the torchrun and ``launch`` tests) fork too: ``procs.base_env`` sets torchrun's documented
``PYTHON_EXEC`` to a shim (``python_exec()``) that runs this file's client in ``exec`` mode. It finds the server
whose startup variables match its own, up to the ones torchrun and ``launch`` add and a forked child can take
(``ADDED_BY_LAUNCHERS``), and joins the client's network namespace whatever it is (the client passes it as a file
descriptor); without such a server it execs python itself. The shim's pid is the worker's to torchrun and to the
tests, which find it by its command line and kill it: its command dies with it, once the server sees the client
gone (a test that needs the rank's own process dead first, as the out-of-memory killer leaves it, kills the client's
``command_of``). A forked worker shows the server's command line in /proc, so a test that looks for leftovers by
command line sees the clients, not their commands.
Notebook kernels (run_cells.py, run_notebook.py) start through the same shim (``kernel_from_fork_server``); such a
client ends when the process that started it does, as ipykernel's parent poller ends a real kernel.
The frozen-peer (SIGSTOP), SLURM and JupyterLab tests keep real processes, as does every test that starts its
processes without ``procs.run_all`` / ``procs.popen`` / ``base_env``. Two differences stay, both asserted by
tests/test_zygote.py (which compares a probe run real and forked: argv, paths, folder, environment, streams, signal
handlers, exit codes and signals, tracebacks, atexit, unflushed output): forked commands share the server's
string-hash seed (fresh processes each draw one; a test that sets PYTHONHASHSEED gets a server of its own), and a
signal sent to the client's process group reaches the command only, not what the command started (a terminal's
Ctrl-C reaches a real command's DataLoader workers too).
"""
from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The variables a forked child takes as it is given them: read from os.environ after start-up (by the kit, torch's
# distributed code, torchrun, pytest, a test's own script), and the child gets the client's environment whole
# (_become). Every other variable keys a server of its own, so that whatever the interpreter or a native library
# reads at start-up (PYTHON*, LD_*, OMP_*, MALLOC_*, TORCHINDUCTOR_*, ... named or not) never comes from a server
# started with another value.
TAKEN_AFTER_START = {"PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "PYTHON_EXEC", "MASTER_ADDR", "MASTER_PORT",
                     "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                     "GLOO_SOCKET_IFNAME", "BUILD_DDP", "DEVICES", "BACKEND", "AMP", "PORT", "PROBE_VAR",
                     "DDP_UTILS_LAUNCHER_PID"}
TAKEN_AFTER_START_PREFIXES = ("PYTEST_", "TORCHELASTIC_", "NCCL_", "WANDB_", "DDP_KIT_", "KIT_", "JUPYTER_",
                              "SLURM_")
# What torchrun (its agent) and ``launch`` add to a worker's environment that a forked child takes as well:
# -u / PYTHONUNBUFFERED (_become's streams), PYTHONPATH (_become puts its entries on sys.path) and
# TORCH_NCCL_ASYNC_ERROR_HANDLING (read when an NCCL group is made, not at start-up).
ADDED_BY_LAUNCHERS = ("PYTHONUNBUFFERED", "PYTHONPATH", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
PRELOAD = ("torch", "torch.distributed", "torchvision", "numpy", "PIL.Image", "torch.utils.tensorboard",
           "ddp_utils.tools.cli", "ddp_utils.job", "ddp_utils.train", "ddp_utils.data", "ddp_utils.summary",
           "ddp_utils.speed.memdata")

_servers: dict = {}   # the startup variables -> (Popen, socket path) or None (failed), in the pytest process
_starting = threading.Lock()   # tests that start scenarios from threads (test_faults.py): one server per key
_exec_dir: list = []  # the folder of python_exec()'s shim and the servers' names for it, once made
MAX_SERVERS = 4       # environments beyond these (a leaked variable each) run as real processes
stats = {"forked": 0, "real": 0}   # for the session's summary line (conftest.py); "keys": variables that split servers


# -- the pytest side -----------------------------------------------------------------------------------------
def enabled() -> bool:
    return os.environ.get("DDP_KIT_ZYGOTE", "1") != "0"


def wrap(argv: list, env: dict) -> list:
    """``argv`` as a client of the fork server if the server can run it, else ``argv`` unchanged. A command on a
    namespace host (``ip netns exec NAME python ...``) is forked too: the child enters that network namespace."""
    argv = [str(a) for a in argv]
    prefix = argv[:4] if argv[:3] == ["ip", "netns", "exec"] else []
    command = argv[len(prefix):]
    server = None
    if enabled() and len(command) >= 2 and command[0] == sys.executable and (command[1] == "-m"
                                                                              or command[1].endswith(".py")):
        server = _server_for(env)
    if server is None:
        stats["real"] += 1
        return argv
    stats["forked"] += 1
    netns = ["--netns", prefix[3]] if prefix else []
    return [sys.executable, "-S", os.path.abspath(__file__), "client", server[1], *netns, *command[1:]]


def _startup(env: dict) -> frozenset:
    """What a server is keyed on: every variable but those a forked child takes from its own environment."""
    return frozenset((k, v) for k, v in env.items()
                     if k not in TAKEN_AFTER_START and not k.startswith(TAKEN_AFTER_START_PREFIXES))


def _exec_name(env: dict) -> str:
    """The name under which a server is found by python_exec()'s shim: its startup variables but the added ones."""
    import hashlib
    key = sorted((k, v) for k, v in _startup(env) if k not in ADDED_BY_LAUNCHERS)
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16]


def python_exec() -> str:
    """The shim for torchrun's ``PYTHON_EXEC``: a worker it starts becomes a client of a fork server (``exec``)."""
    import tempfile
    if not _exec_dir:
        _exec_dir.append(tempfile.mkdtemp(prefix="ddp-kit-zygote-exec-"))
    shim = os.path.join(_exec_dir[0], "python")
    if not os.path.exists(shim):
        import shlex
        with open(shim + ".tmp", "w") as f:
            f.write(f"#!/bin/sh\n# torchrun's workers from the suite's fork server (tests/helpers/zygote.py)\n"
                    f"exec {shlex.quote(sys.executable)} -S {shlex.quote(os.path.abspath(__file__))} exec "
                    f"{shlex.quote(_exec_dir[0])} \"$@\"\n")
        os.chmod(shim + ".tmp", 0o755)
        os.rename(shim + ".tmp", shim)
        for env_key, server in _servers.items():   # servers started before the shim was asked for
            if server is not None:
                _publish(dict(env_key), server[1])
    return shim


def _publish(env: dict, path: str) -> None:
    """Give the server at ``path`` its name in the shim's folder (the first server of a name keeps it)."""
    with contextlib.suppress(FileExistsError):
        os.symlink(path, os.path.join(_exec_dir[0], _exec_name(env)))


def _server_for(env: dict):
    """The server started with these startup variables (one per distinct set: a test or an in-process call may
    leave, say, OMP_NUM_THREADS set in pytest's environment, which every later command inherits)."""
    key = _startup(env)
    with _starting:
        if key not in _servers:
            _servers[key] = _start(env) if len(_servers) < MAX_SERVERS else None
            # for the session's summary: what made this server (or real process) differ from the first
            stats["keys"] = sorted(set(stats.get("keys", [])) | {k for k, _ in key ^ next(iter(_servers))})
        server = _servers[key]
    return server if server is not None and server[0].poll() is None else None


def _start(env: dict):
    """Start a server (it imports for ~10 s; the command that asked waits for it once)."""
    import atexit
    import subprocess
    import tempfile
    import time
    from tests.helpers.procs import REPO
    if not _servers:
        atexit.register(stop_servers)
    path = os.path.join(tempfile.mkdtemp(prefix="ddp-kit-zygote-"), "sock")
    with open(path + ".log", "wb") as log:   # not pytest's capture of whichever test starts it
        proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote", "serve", path], env=env, cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not os.path.exists(path):   # it failed to start: these commands run as real processes
        _end(proc)
        return None
    if _exec_dir:   # python_exec()'s shim finds it under its name
        _publish(env, path)
    return proc, path


def command_of(client_pid: int) -> int | None:
    """The pid of the command a client runs (forked by a server), or None: ``client_pid`` is no client of ours, or
    its command has ended."""
    for server in filter(None, _servers.values()):
        try:
            with open(f"{server[1]}.{client_pid}.child") as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def kill(client_pid: int) -> None:
    """SIGKILL the command a client runs (and what it started), and wait until it is gone: stop() must leave
    nothing that still writes to a run folder (the client alone would end first, its command ~0.05 s later)."""
    import time
    child = command_of(client_pid)
    if child is None:
        return
    try:
        os.killpg(child, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:   # gone once the server reaped it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def stop_servers() -> None:
    import shutil
    for server in filter(None, _servers.values()):
        _end(server[0])
        shutil.rmtree(os.path.dirname(server[1]), ignore_errors=True)
    _servers.clear()
    for folder in _exec_dir:
        shutil.rmtree(folder, ignore_errors=True)
    _exec_dir.clear()


def _end(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


# -- the server ------------------------------------------------------------------------------------------------
def serve(path: str) -> None:
    import importlib
    import selectors
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:   # an optional one (tensorboard): the command imports it if it needs it
            pass
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)   # the pytest side waits for this name: ready
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}   # pid -> its client's connection
    while os.getppid() == parent:   # pytest gone: stop
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _fork_child(conn, listener, children)
                if pid:
                    children[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
                    _note(path, conn, pid)
                else:
                    conn.close()
                continue
            pid, conn = key.data, key.fileobj   # the client forwards a signal, or it is gone (killed)
            try:
                data = conn.recv(64)
            except OSError:
                data = b""
            for sig in data.split():
                _signal(pid, int(sig), group=False)
            if not data:   # the client was killed: so is its command, with whatever it started
                _signal(pid, signal.SIGKILL, group=True)
                sel.unregister(conn)
        for pid, status in _reap(children):
            conn = children.pop(pid)
            _note(path, conn, None)
            try:
                conn.sendall(f"exit {status}\n".encode())
            except OSError:
                pass
            with contextlib.suppress(KeyError):   # not registered any more if its client was killed
                sel.unregister(conn)
            conn.close()
    for pid in children:
        _signal(pid, signal.SIGKILL, group=True)


def _note(path: str, conn: socket.socket, child: int | None) -> None:
    """Write (or remove) ``<client pid>.child``: the test's stop() kills a client's command with it, at once."""
    try:
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        note = f"{path}.{struct.unpack('3i', cred)[0]}.child"
        if child is None:
            os.unlink(note)
        else:
            with open(note + ".tmp", "w") as f:
                f.write(str(child))
            os.rename(note + ".tmp", note)
    except OSError:
        pass


def _reap(children: dict) -> list:
    ended = []
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if not pid:
            break
        if pid in children:
            ended.append((pid, status))
    return ended


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _fork_child(conn: socket.socket, listener: socket.socket, children: dict) -> int:
    """Read one request and fork its child; return the child's pid (0 if the request was unreadable)."""
    fds = array.array("i")
    head, ancillary, _, _ = conn.recvmsg(8, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(head) < 8 or len(fds) not in (3, 4):   # stdin, stdout, stderr [, the client's network namespace]
        for fd in fds:
            os.close(fd)
        return 0
    size = struct.unpack("!Q", head)[0]
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            return 0
        body += chunk
    request = json.loads(body)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        return pid
    # the child: become the command (and never return to the server's loop)
    code = 1
    try:
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        code = _become(request, list(fds))
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:   # as python does: the traceback, then die of SIGINT
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:   # noqa: BLE001 - print it as Python would, then exit 1
        import traceback
        traceback.print_exc()
        code = 1
    _exit(code)


def _become(request: dict, fds: list) -> int:
    import io
    import random
    import runpy
    os.setsid()
    if request.get("netns"):
        _enter_netns(request["netns"])
    if len(fds) == 4:   # the client's own network namespace (a worker torchrun started inside a namespace host)
        netns = fds.pop()
        if os.fstat(netns).st_ino != os.stat("/proc/self/ns/net").st_ino:
            _setns(netns, "the client's")
        os.close(netns)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in range(1, signal.NSIG):
        try:
            if sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            elif signal.getsignal(sig) not in (None, signal.SIG_DFL) and sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):   # as python puts them, after [0]
        if entry and os.path.abspath(entry) not in map(os.path.abspath, sys.path):
            sys.path.insert(1, entry)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False)) if _open(0) else None
    sys.stdout = _text(1, unbuffered, line=False)
    sys.stderr = _text(2, True, line=True, errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()   # a fresh process seeds numpy's global generator from the OS
    args = request["argv"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        sys.argv = [args[0], *args[1:]]   # as typed; __file__ and sys.path[0] absolute, as python makes them
        sys.path[0] = os.path.dirname(script)
        if hasattr(runpy, "_run_code"):   # run_path would set sys.argv[0] to the absolute path while it runs
            import types
            with io.open_code(script) as f:
                code = compile(f.read(), script, "exec")
            main = sys.modules["__main__"] = types.ModuleType("__main__")   # this child never returns to the server
            runpy._run_code(code, main.__dict__, None, "__main__", None, None, script)
        else:
            runpy.run_path(script, run_name="__main__")
    return 0


def _enter_netns(name: str) -> None:
    """Join the network namespace ``ip netns exec NAME`` would run the command in (setns(2); os.setns is 3.12+).
    What ``ip`` does besides (a /sys of that namespace, /etc/netns/NAME files) the kit does not read."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd, name)
    finally:
        os.close(fd)


def _setns(fd: int, name: str) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:   # CLONE_NEWNET
        err = ctypes.get_errno()
        raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _text(fd: int, unbuffered: bool, line: bool, errors: str = "strict"):
    import io
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line or raw.isatty(),
                            write_through=unbuffered)


def _exit(code) -> None:
    """Exit as ``python`` would after the command: atexit handlers, threads, flushed streams."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        import threading
        threading._shutdown()   # non-daemon threads first, as at interpreter exit
    except Exception:   # noqa: BLE001
        pass
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001
            pass
    os._exit(code)


# -- the client (python -S: no site, no torch; starts in milliseconds) ------------------------------------------
def client(path: str, args: list) -> None:
    netns = None
    if args[:1] == ["--netns"]:
        netns, args = args[1], args[2:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:   # no server: be the command itself
        command = [sys.executable, *args]
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        os.execvp(command[0], command)
    body = json.dumps({"argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "netns": netns}).encode()
    fds = [0, 1, 2, os.open("/proc/self/ns/net", os.O_RDONLY)]   # the namespace the command runs in (unless --netns)
    if netns:
        os.close(fds.pop())
    sock.sendmsg([struct.pack("!Q", len(body))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    sock.sendall(body)
    reader = sock.makefile("rb")
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: sock.sendall(f"{signum} ".encode()))
    status = None
    while status is None:
        line = reader.readline()
        if not line:   # the server died: nothing to report but a failure
            sys.exit(1)
        word, value = line.decode().split()
        if word == "exit":
            status = int(value)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:   # its handler cannot be set (nor be anything but the default)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 1)


def kernel_from_fork_server(km) -> None:
    """Start ``km``'s ipykernel through python_exec()'s shim (run_cells.py, run_notebook.py): the kernel forks
    from the server with torch and the kit imported (a real kernel imports them in its first cell)."""
    shim = os.environ.get("PYTHON_EXEC")
    if shim and km.kernel_spec.argv[:3] == ["python", "-m", "ipykernel_launcher"]:
        km.kernel_spec.argv[0] = shim


def _end_with_parent() -> None:
    """What ipykernel's parent poller does for a real kernel: exit once the process that started it is gone (the
    client's exit kills its command). A forked kernel's parent is the server, so its own poller cannot tell."""
    import threading
    import time
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def exec_(folder: str, args: list) -> None:
    """python_exec()'s shim: ``ARGS`` as torchrun gives them (``-u -m ddp_utils train ...``), run by the server
    whose startup variables match this environment's, else by python itself."""
    command = args[1:] if args[:1] == ["-u"] else args
    if command is not args:
        os.environ["PYTHONUNBUFFERED"] = "1"   # -u
    path = os.path.join(folder, _exec_name(dict(os.environ)))
    if len(command) >= 2 and (command[0] == "-m" or command[0].endswith(".py")) and os.path.exists(path):
        if os.environ.get("JPY_PARENT_PID"):   # a notebook kernel: it must end with its notebook runner
            _end_with_parent()
        client(os.path.realpath(path), command)
    os.execv(sys.executable, [sys.executable, *args])


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "exec":
        exec_(sys.argv[2], sys.argv[3:])
    else:
        client(sys.argv[2], sys.argv[3:])
