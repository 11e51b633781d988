"""Before ``init_process_group``: can every rank open a TCP connection to every other rank, on a port other than
master_port?

The store on master_port only introduces the ranks. Gloo and NCCL then connect every rank to the others on
random ports. A firewall that opens only master_port (the classic security-group mistake) lets the store work and
blocks those connections; gloo then retries them for minutes, whatever init_timeout says. So, once every rank has
joined the rendezvous, each one listens on a random port of the address it will use, writes that address into the
generation's keys, and connects to every other rank's within ``CONNECT_S``. Every rank then reads every rank's
result, so all of them stop with the same paragraph: who could not reach whom, on which port, and the rule to add.
"""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from .preflight import DistSetupError

CONNECT_S = 5.0   # a connection a firewall drops never answers: this long, then it counts as blocked
RESULTS_S = 20.0  # how long a rank waits for the others' results (they all connect at once)


class Blocked(DistSetupError):
    """Some rank could not reach another on a random port: the same paragraph on every rank."""


def probe(keys, rank: int, world_size: int, addr: str | None, master_port: int, wait_s: float = RESULTS_S) -> float:
    """Listen on ``addr`` (this rank's address on the interface that routes to the master), publish it, connect to
    every other rank's listener, publish what failed, and read everyone's. Returns the seconds it took; raises
    :class:`Blocked` on every rank when some connection failed. Ranks that publish nothing within ``wait_s`` (gone,
    stopped; at most RESULTS_S, at most init_timeout) are left to init_process_group's own bounded wait: one wait
    for them in all, not one for their address and another for their result."""
    if world_size < 2 or not addr:
        return 0.0
    start = time.monotonic()
    wait_s = min(wait_s, RESULTS_S)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.create_server((addr, 0), family=family, backlog=max(16, world_size)) as server:
        keys.set(f"mesh/addr/{rank}", json.dumps([addr, server.getsockname()[1]]))
        others = [r for r in range(world_size) if r != rank]
        peers = _read_all(keys, "mesh/addr", others, start + wait_s)
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(peers)))) as pool:
            failed = [f for f in pool.map(lambda item: _connect(*item), peers.items()) if f]
        keys.set(f"mesh/result/{rank}", json.dumps(failed))
        # keep listening until the others are done connecting to this rank: reading their results waits for that
        try:
            results = _read_all(keys, "mesh/result", list(peers), time.monotonic() + wait_s)   # those that came
        except Exception:   # noqa: BLE001 - the store's rank 0 read every result and left first (its check ended)
            if not failed:
                raise
            results = {}    # this rank's own failed connections are reason enough, and the same paragraph
    problems = sorted([{**f, "from": rank} for f in failed] +
                      [{**f, "from": r} for r, theirs in results.items() for f in theirs],
                      key=lambda f: (f["from"], f["to"]))
    if problems:
        raise Blocked(blocked_text(rank, problems, master_port))
    return time.monotonic() - start


def _read_all(keys, prefix: str, ranks: list[int], deadline: float) -> dict[int, object]:
    """Rank -> the JSON under ``prefix/<rank>``, for the ranks that wrote it before ``deadline`` (one store request
    per look while waiting, whatever the number of ranks)."""
    names = [f"{prefix}/{r}" for r in ranks]
    while not keys.check(names) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {r: json.loads(keys.get(name)) for r, name in zip(ranks, names) if keys.check([name])}


def _connect(rank: int, where) -> dict | None:
    """None when a TCP connection to ``where`` ((address, port) of ``rank``'s listener) opens within CONNECT_S;
    else what failed."""
    addr, port = where
    try:
        with socket.create_connection((addr, port), timeout=CONNECT_S):
            return None
    except OSError as e:
        said = "no answer within {:g} s (packets dropped)".format(CONNECT_S) if isinstance(e, TimeoutError) \
            else (e.strerror or type(e).__name__)
        return {"to": rank, "addr": addr, "port": port, "error": said}


def blocked_text(rank: int, problems: list[dict], master_port: int) -> str:
    """The paragraph every rank prints: the failed connections (a few), why it matters, the rule to add."""
    shown = "; ".join(f"rank {p['from']} -> rank {p['to']} at {p['addr']}:{p['port']} ({p['error']})"
                      for p in problems[:4])
    more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
    return (f"rank {rank}: the ranks reach the master's port {master_port}, but not each other on other ports: "
            f"{shown}{more}. Gloo and NCCL connect every rank to the others on further random ports once the store "
            f"on master_port has introduced them, so a firewall that opens only master_port lets setup start and "
            f"then blocks training. Allow all TCP (ports 0-65535) between the nodes: on AWS an inbound rule 'All "
            f"TCP' whose source is the nodes' own security group; on GCP a VPC firewall rule allowing tcp:0-65535 "
            f"between the nodes; on Azure the default AllowVnetInBound rule (check that no rule above it denies); "
            f"elsewhere the nodes' firewalls (ufw, iptables). A container needs --net=host. Then run setup (or "
            f"`python -m ddp_utils check`) again on every node.")
