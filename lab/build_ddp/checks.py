"""What the tests watch while your code runs, and how a failure is explained. You need not read this file.

- ``AllReduceLog`` records every ``dist.all_reduce`` call (its bytes, its op, async_op, whether backward() was
  running, and how many gradients autograd had produced by then), and hands back a work object (and future) that
  notes whether, and when, it was waited for: an all-reduce started but never waited for, or waited for at once
  inside backward(), is reported as such, not guessed from its numbers.
- ``Arrivals`` notes the order in which backward() produces the gradients (a hook registered before yours).
- ``explain_gradients`` compares each ``.grad`` after ``finish_gradient_sync()`` with the right one (one
  process's, on the whole batch) and says how it differs: summed rather than averaged (a ratio equal to the
  world size), this rank's own gradient (never all-reduced), a gradient that should not exist, ...
- ``RingLog`` records what ``ring_all_reduce`` says to whom (every point-to-point message, every collective, the
  tensor at the start of each step) and ``explain_ring`` proves it a ring, or names the step and the chunk where
  it went wrong.
- ``AgreedCollectives``, ``explain_sharded_step``: part (f)'s collectives compared between the ranks before they
  run (owners that differ would hang), and a wrong step explained (a parameter never sent by its owner, a
  learning rate that did not reach the optimizer that steps).
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d

SUMS = ("SUM", "AVG", "PREMUL_SUM")   # the ops whose result is the sum (or the mean) over the ranks


def op_name(op) -> str:
    """``ReduceOp.MAX`` -> ``"MAX"``."""
    return getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]


@contextlib.contextmanager
def _patched(wrappers: dict, module=None, c10d: bool = False):
    """Each ``torch.distributed.<name>`` replaced by ``wrappers[name]`` while inside, and so is any name the file
    under test (``module``) gave the real function; ``c10d``: in distributed_c10d too (where batch_isend_irecv
    calls the ops its P2POps name, and P2POp checks them)."""
    saved = []
    for name, wrapper in wrappers.items():
        real = getattr(dist, name)
        places = [(dist, name)] + ([(distributed_c10d, name)] if c10d else [])
        if module is not None:
            places += [(module, attr) for attr, value in vars(module).items() if value is real]
        for place, attr in places:
            saved.append((place, attr, getattr(place, attr)))
            setattr(place, attr, wrapper)
    try:
        yield
    finally:
        for place, attr, value in reversed(saved):
            setattr(place, attr, value)


@dataclass(frozen=True)
class AllReduce:
    """One ``dist.all_reduce`` call: its tensor's bytes, its async_op, whether backward() was running, how many
    gradients backward() had produced when it started, the micro-batch it belongs to, and its op."""
    bytes: int
    async_op: bool
    in_backward: bool
    arrived: int
    micro_batch: int = 0
    op: str = "SUM"

    def __repr__(self):
        when = f"during backward, after {self.arrived} gradient(s)" if self.in_backward else "after backward"
        op = "" if self.op == "SUM" else f", op={self.op}"
        return f"all_reduce({self.bytes} bytes{op}, async_op={self.async_op}, {when})"


class TrackedWork:
    """The work ``dist.all_reduce(..., async_op=True)`` returned, noting whether, and when, anyone waited for it:
    by ``wait()``, or by waiting for its future (``get_future()``, and any future chained to it by ``then()``)."""

    def __init__(self, work, log: AllReduceLog, call: AllReduce):
        self._work, self._log, self.call = work, log, call
        self.index = len(log.calls) - 1    # this all-reduce's place among the step's calls
        self.waited = False
        self.waited_at_once = False        # inside backward(), before any other all-reduce started

    def note_wait(self) -> None:
        if not self.waited and self._log.in_backward and self.index == len(self._log.calls) - 1:
            self.waited_at_once = True
        self.waited = True

    def wait(self, *args, **kwargs):
        self.note_wait()
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        return TrackedFuture(self._work.get_future(), [self])   # taking the future is not waiting for it

    def __getattr__(self, name):
        return getattr(self._work, name)


class TrackedFuture:
    """A ``torch.futures.Future`` of tracked works: waiting for it (``wait()``, ``value()``, ``wait_all``) waits for
    them; ``then()`` gives another, whose wait waits for them too."""

    def __init__(self, future, works: list[TrackedWork]):
        self._future, self._works = future, works

    def _note(self) -> None:
        for work in self._works:
            work.note_wait()

    def wait(self):
        self._note()
        return self._future.wait()

    def value(self):
        if self._future.done():   # value() of a future not done raises; done and read: it was waited for
            self._note()
        return self._future.value()

    def then(self, callback):
        return TrackedFuture(self._future.then(callback), self._works)

    def __getattr__(self, name):
        return getattr(self._future, name)


def _real_futures(futures) -> tuple[list, list[TrackedWork]]:
    real, works = [], []
    for future in futures:
        if isinstance(future, TrackedFuture):
            real.append(future._future)
            works += future._works
        else:
            real.append(future)
    return real, works


class AllReduceLog:
    """Records every ``dist.all_reduce`` made inside ``with log.recording(module):`` in ``log.calls``."""

    def __init__(self, arrivals: Arrivals | None = None):
        self.calls: list[AllReduce] = []
        self.works: list[TrackedWork] = []
        self.in_backward = False
        self.micro_batch = 0
        self.arrivals = arrivals

    @contextlib.contextmanager
    def recording(self, module=None):
        real = dist.all_reduce
        real_wait_all, real_collect_all = torch.futures.wait_all, torch.futures.collect_all

        def all_reduce(tensor, *args, **kwargs):
            async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            op = op_name(kwargs.get("op", args[0] if args else dist.ReduceOp.SUM))
            arrived = len(self.arrivals.order) if self.arrivals is not None else 0
            call = AllReduce(tensor.numel() * tensor.element_size(), async_op, self.in_backward, arrived,
                             self.micro_batch, op)
            self.calls.append(call)
            work = real(tensor, *args, **kwargs)
            if async_op and work is not None:
                work = TrackedWork(work, self, call)
                self.works.append(work)
            return work

        def wait_all(futures):
            real_ones, works = _real_futures(futures)
            for work in works:
                work.note_wait()
            return real_wait_all(real_ones)

        def collect_all(futures):
            real_ones, works = _real_futures(futures)
            return TrackedFuture(real_collect_all(real_ones), works)

        torch.futures.wait_all, torch.futures.collect_all = wait_all, collect_all
        try:
            with _patched({"all_reduce": all_reduce}, module):   # and under another name in the file under test
                yield self
        finally:
            torch.futures.wait_all, torch.futures.collect_all = real_wait_all, real_collect_all

    def take(self) -> tuple[list[AllReduce], list[TrackedWork]]:
        """This step's calls and works; the log starts empty again."""
        out = (self.calls, self.works)
        self.calls, self.works, self.micro_batch = [], [], 0
        return out


def assert_all_waited(works: list[TrackedWork], when: str) -> None:
    """Every async all-reduce was waited for, and none at once inside backward() (a hook that waits for its own)."""
    unwaited = [w for w in works if not w.waited]
    assert not unwaited, (
        f"rank {dist.get_rank()}, {when}: {len(unwaited)} of the {len(works)} all-reduce(s) started with "
        f"async_op=True were never waited for before optimizer.step() (neither the work's wait() nor a wait for "
        f"its future: a callback chained with then() runs when the sum arrives, not before step()): an "
        f"all-reduce started but not waited for may not have finished writing its sum, so the gradient can be "
        f"anything from this rank's own to the mean. finish_gradient_sync() must wait for every one it started "
        f"(README, part (b)).")
    at_once = [w.call for w in works if w.waited_at_once]
    assert not at_once, (
        f"rank {dist.get_rank()}, {when}: {len(at_once)} of the {len(works)} all-reduce(s) were waited for inside "
        f"backward(), in the gradient hook that started them, before any other started: each hook then blocks "
        f"until its sum arrives, so backward() computes nothing while the gradients travel (synchronous in "
        f"effect, async_op=True or not). Start them in the hooks and wait for them all in finish_gradient_sync() "
        f"(README, part (b)). The first: {at_once[0]}")


class Arrivals:
    """The order in which backward() produces the gradients of ``net``'s trainable parameters (by name).

    Registered before the wrapper under test registers its own hooks, so for each parameter this hook runs
    first: when your hook starts an all-reduce, ``order`` already counts that parameter."""

    def __init__(self, net: nn.Module):
        self.order: list[str] = []
        self.bytes = {name: p.numel() * p.element_size() for name, p in net.named_parameters() if p.requires_grad}
        for name, param in net.named_parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _, name=name: self.order.append(name))

    def take(self) -> list[str]:
        out, self.order = self.order, []
        return out


def gradients(net: nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: a copy of .grad, or None}`` of every trainable parameter."""
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in net.named_parameters() if p.requires_grad}


def explain_gradients(net: nn.Module, want: dict, mine: dict, when: str, sent: str = "",
                      calls: list[AllReduce] = ()) -> None:
    """Assert that every trainable parameter's ``.grad`` of ``net`` equals ``want`` (one process, whole batch),
    within the tests' tolerance; else say, per parameter, how it differs. ``mine``: this rank's own gradient
    (of its shard, before any communication); ``sent``: what the all-reduces carried, for the message;
    ``calls``: the all-reduces, whose op is named when it is not a sum."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    got = gradients(net)
    problems = [f"{name}: {why}" for name in want if (why := _how_it_differs(got[name], want[name], mine[name],
                                                                              world_size))]
    if not problems:
        return
    ops = sorted({c.op for c in calls if c.op not in SUMS})
    assert not ops, (
        f"rank {rank} of {world_size}, {when}: all-reduced with op={', '.join(ops)}, not SUM: each gradient became "
        f"the {'/'.join(o.lower() for o in ops)} of the ranks' values, not their sum, and no division makes that "
        f"the mean. Leave the all-reduce's op at its default (the sum) and divide by the world size (README, part "
        f"(a)). {len(problems)} gradient(s) differ from one process's:\n  " + "\n  ".join(problems[:8]))
    unused = [name for name in want if want[name] is None]
    never = any("never all-reduced" in p for p in problems)
    note = ""
    if never and unused:
        note = (f"\nNot used by this step's forward pass, so without a gradient: {', '.join(unused)}. A bucket that "
                f"waits for their gradients never fills and never starts: finish_gradient_sync() must still send "
                f"the gradients it holds (README, part (c)).")
    raise AssertionError(f"rank {rank} of {world_size}, {when}: after finish_gradient_sync(), before "
                         f"optimizer.step(), {len(problems)} gradient(s) differ from one process's on the whole "
                         f"batch:\n  " + "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more"
                                                                      if len(problems) > 8 else "")
                         + note + (f"\nThis step's all-reduces: {sent}" if sent else ""))


def _how_it_differs(got, want, mine, world_size: int) -> str | None:
    if got is None and want is None:
        return None
    if got is None:
        return "has no gradient (.grad is None), where one process has one"
    if want is None:
        return ("has a gradient, where one process has none (this step did not use it): leave its .grad None, or "
                "the optimizer's momentum and weight decay move it")
    if _close(got, want):
        return None
    if world_size > 1 and _close(got, mine) and not _close(mine, want):
        return "is this rank's own gradient: never all-reduced"
    ratio = float((got * want).sum() / (want * want).sum().clamp_min(1e-30))
    if _close(got, ratio * want):
        if abs(ratio - world_size) < 1e-3 * world_size:
            return (f"is {world_size} times the right one, the world size: summed over the ranks, not averaged "
                    f"(divide by the world size)")
        if abs(ratio - 1 / world_size) < 1e-3:
            return f"is 1/{world_size} of the right one: divided by the world size twice"
        return f"is {ratio:.4g} times the right one"
    return f"differs from the mean over the ranks (largest difference {float((got - want).abs().max()):.3g})"


ATOL, RTOL = 1e-6, 1e-5   # fp32; see test_build_ddp.py's docstring for why not exact


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, atol=ATOL, rtol=RTOL))


# -- (d) the ring: who sends what to whom, and where it went wrong ---------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "barrier",
               "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced")


@dataclass
class Message:
    """One point-to-point message as one end saw it: the other end (None: any rank), its elements, the chunk of
    the tensor it was (tensor_split's index; None: a buffer of its own) and, at the receiving end, the elements
    the sender sent (None where not known)."""
    peer: int | None
    numel: int
    chunk: int | None
    sent: int | None = None

    def what(self) -> str:
        return "a buffer of its own" if self.chunk is None else f"its chunk {self.chunk}"


@dataclass
class RingRecord:
    """What one rank's ring_all_reduce did (gathered from every rank, so every rank explains alike)."""
    rank: int
    given: torch.Tensor                                          # the tensor before the call, flat, on the CPU
    sends: list[Message] = field(default_factory=list)
    receives: list[Message] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)     # the tensor when each step began, then at the end
    in_place: bool = True                                        # returned the tensor it was given


class _ThenFinish:
    """A receive's work that, once waited for, copies what arrived from the log's buffer into the tensor."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._finish()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class RingLog:
    """Inside ``with log.recording(module):`` records every point-to-point message (``send``, ``recv``, ``isend``,
    ``irecv``, and those of ``batch_isend_irecv``), every collective, and ``tensor`` when each step begins.

    Each receive lands in a buffer of the log's, large enough for any message: with gloo a message larger than
    its receiving tensor aborts the process, and the two ends of a step disagreeing on the chunk (its size) is a
    mistake to name, not a crash. The sender notes each message's size in the process group's store; the
    receiver reads it once the message has arrived, and copies it into the tensor it posted."""

    _calls = 0   # per process, the same on every rank: each call's keys in the store are its own

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.rank, self.world_size = tensor, dist.get_rank(), dist.get_world_size()
        n = tensor.numel()
        sizes = [c.numel() for c in torch.empty(n).tensor_split(self.world_size)]
        starts = [sum(sizes[:i]) for i in range(self.world_size)]
        self.bounds = [(start, start + size) for start, size in zip(starts, sizes)]
        self.record = RingRecord(self.rank, tensor.detach().flatten().cpu().clone())
        self.sent_to: dict[int, int] = {}
        self.received_from: dict[int, int] = {}
        self.buffered = dist.get_backend() == "gloo"   # NCCL: received in place (sizes must match there)
        RingLog._calls += 1
        self.prefix = f"build_ddp/ring/{RingLog._calls}"

    def _chunk_of(self, view: torch.Tensor) -> int | None:
        t = self.tensor
        if view.device != t.device or view.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            return None
        offset = (view.data_ptr() - t.data_ptr()) // max(1, t.element_size())
        return next((i for i, (a, b) in enumerate(self.bounds) if offset == a and view.numel() == b - a), None)

    def _step_begins(self, index: int) -> None:
        if index == len(self.record.states):
            self.record.states.append(self.tensor.detach().flatten().cpu().clone())

    @staticmethod
    def _global(peer, group, group_peer):
        if peer is not None or group_peer is None:
            return peer
        return group_peer if group is None else dist.get_global_rank(group, group_peer)

    def _key(self, source: int, destination: int, counts: dict, peer: int) -> str:
        k = counts.get(peer, 0)
        counts[peer] = k + 1
        return f"{self.prefix}/{source}-{destination}/{k}"

    def _send(self, tensor: torch.Tensor, peer) -> None:
        self._step_begins(len(self.record.sends))
        self.record.sends.append(Message(peer, tensor.numel(), self._chunk_of(tensor)))
        if peer is not None and self.buffered:
            distributed_c10d._get_default_store().set(self._key(self.rank, peer, self.sent_to, peer),
                                                      str(tensor.numel()))

    def _receive(self, tensor: torch.Tensor, peer):
        """``(the tensor to receive into, what to do once it arrived)``."""
        self._step_begins(len(self.record.receives))
        message = Message(peer, tensor.numel(), self._chunk_of(tensor))
        self.record.receives.append(message)
        if peer is None or not self.buffered or not tensor.is_contiguous():
            return tensor, lambda: None
        key = self._key(peer, self.rank, self.received_from, peer)
        buffer = torch.empty(2 * max(tensor.numel(), self.tensor.numel()) + 16, dtype=tensor.dtype,
                             device=tensor.device)
        done = []

        def finish():
            if done:
                return
            done.append(True)
            message.sent = int(distributed_c10d._get_default_store().get(key))   # set before the message left
            n = min(message.sent, tensor.numel())
            tensor.view(-1)[:n].copy_(buffer[:n])
        return buffer, finish

    def _wrappers(self) -> tuple[dict, dict]:
        real = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv")}

        def peer_args(kwargs, name):
            return {key: value for key, value in kwargs.items() if value is not None or key != name}

        def send(tensor, dst=None, group=None, tag=0, group_dst=None):
            self._send(tensor, self._global(dst, group, group_dst))
            return real["send"](tensor, dst, group, tag, **peer_args({"group_dst": group_dst}, "group_dst"))

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            self._send(tensor, self._global(dst, group, group_dst))
            return real["isend"](tensor, dst, group, tag, **peer_args({"group_dst": group_dst}, "group_dst"))

        def recv(tensor, src=None, group=None, tag=0, group_src=None):
            target, finish = self._receive(tensor, self._global(src, group, group_src))
            result = real["recv"](target, src, group, tag, **peer_args({"group_src": group_src}, "group_src"))
            finish()
            return result

        def irecv(tensor, src=None, group=None, tag=0, group_src=None):
            target, finish = self._receive(tensor, self._global(src, group, group_src))
            work = real["irecv"](target, src, group, tag, **peer_args({"group_src": group_src}, "group_src"))
            return _ThenFinish(work, finish) if work is not None else work

        def collective(name):
            function = getattr(dist, name)

            def called(*args, **kwargs):
                self.record.collectives.append(name)
                return function(*args, **kwargs)
            return called

        point_to_point = {"send": send, "isend": isend, "recv": recv, "irecv": irecv}
        return point_to_point, {name: collective(name) for name in COLLECTIVES if hasattr(dist, name)}

    @contextlib.contextmanager
    def recording(self, module=None):
        point_to_point, collectives = self._wrappers()
        with _patched(collectives, module), _patched(point_to_point, module, c10d=True):
            yield self
        self.record.states.append(self.tensor.detach().flatten().cpu().clone())

    def returned(self, result) -> None:
        self.record.in_place = result is self.tensor


def explain_ring(log: RingLog, case: str) -> None:
    """On every rank (a collective): gather every rank's record and raise the same AssertionError everywhere when
    ring_all_reduce was not a ring, or say where the ring went wrong."""
    records = [None] * log.world_size
    dist.all_gather_object(records, log.record)
    problem = ring_problem(records, log.bounds, case)
    assert problem is None, problem


def _phase(k: int, steps: int) -> str:
    return (f"reduce-scatter step {k + 1} of {steps}" if k < steps
            else f"all-gather step {k - steps + 1} of {steps}")


def ring_problem(records: list[RingRecord], bounds: list[tuple[int, int]], case: str) -> str | None:
    """What the ranks' records show is wrong, the first of: a collective used, a message to or from a rank that
    is no neighbour, too many messages, a message larger than a chunk, the two ends of a message disagreeing on
    its size, the result not in place, a wrong chunk (the step where it went wrong). None when it is a ring."""
    n_ranks, n = len(records), bounds[-1][1]
    steps, most = n_ranks - 1, math.ceil(n / n_ranks)
    advice = "(README (d); HINTS.md (d))"
    for rec in records:
        if rec.collectives:
            return (f"{case}: ring_all_reduce called dist.{rec.collectives[0]} (rank {rec.rank}): not a ring. A ring "
                    f"all-reduce uses no collective, only point-to-point messages, each rank sending to the next "
                    f"rank round the ring and receiving from the one before {advice}")
    for rec in records:
        right, left = (rec.rank + 1) % n_ranks, (rec.rank - 1) % n_ranks
        where = (f"not a ring: each rank sends only to its right neighbour (rank {rec.rank}'s is rank {right}) and "
                 f"receives only from its left (rank {left}), never gathering the tensor on one rank {advice}")
        for m in rec.sends:
            if m.peer != right:
                return f"{case}: rank {rec.rank} sent a message to rank {m.peer}: {where}"
        for m in rec.receives:
            if m.peer != left:
                return (f"{case}: rank {rec.rank} received a message from "
                        f"{'any rank' if m.peer is None else f'rank {m.peer}'}: {where}")
    for rec in records:
        count = 2 * steps
        short = n >= n_ranks and (len(rec.sends) != count or len(rec.receives) != count)
        if len(rec.sends) > count or len(rec.receives) > count or short:
            return (f"{case}: rank {rec.rank} sent {len(rec.sends)} and received {len(rec.receives)} message(s) in one "
                    f"call; a ring all-reduce on {n_ranks} ranks takes 2 (N - 1) = {count} steps of one message each "
                    f"way: {steps} of reduce-scatter, then {steps} of all-gather {advice}")
    for rec in records:
        for k, m in enumerate(rec.sends):
            if m.numel > most:
                return (f"{case}: rank {rec.rank}'s message of {_phase(k, steps)} held {m.numel} elements, more "
                        f"than a chunk (at most ceil({n} / {n_ranks}) = {most}): a ring sends the tensor in "
                        f"{n_ranks} chunks, one per message, never the whole tensor {advice}")
    mismatches = [(k, rec.rank, m) for rec in records for k, m in enumerate(rec.receives)
                  if m.sent is not None and m.sent != m.numel]
    if mismatches:
        k, rank, m = min(mismatches, key=lambda x: (x[0], x[1]))
        sent = records[m.peer].sends[k] if k < len(records[m.peer].sends) else Message(m.peer, m.sent, None)
        return (f"{case}: in the {_phase(k, steps)}, rank {m.peer} sent {m.sent} element(s) ({sent.what()}) and "
                f"rank {rank} received them into {m.numel} ({m.what()}): the two ends of a step disagree on the "
                f"chunk that travels (chunks differ in size by one when the world size does not divide the "
                f"tensor, and may be empty). Work out, for 3 ranks, which chunk each rank sends and which it "
                f"receives at each step {advice}")
    for rec in records:
        if not rec.in_place:
            return f"{case}: rank {rec.rank}: sum in place and return the tensor given"
    return _wrong_chunk(records, bounds, case, steps, advice)


def _wrong_chunk(records, bounds, case, steps, advice) -> str | None:
    """The chunk that went wrong first: each chunk of a ring's rank r holds, at every step, the sum of its values
    over ranks r, r - 1, ..., r - j for some j (its own alone first, all of them at the end)."""
    n_ranks, n = len(records), bounds[-1][1]
    given = [rec.given.double() for rec in records]
    total = sum(given)
    found = []   # (step it went wrong at, rank, chunk, how many ranks it sums at the end or None)
    for rec in records:
        r = rec.rank
        for c, (a, b) in enumerate(bounds):
            if _near(rec.states[-1][a:b].double(), total[a:b]):
                continue
            partial = [sum(given[(r - i) % n_ranks][a:b] for i in range(j + 1)) for j in range(n_ranks)]

            def summed(state, partial=partial, a=a, b=b):
                return next((j + 1 for j, p in enumerate(partial) if _near(state[a:b].double(), p)), None)
            sums = [summed(state) for state in rec.states]
            wrong = next((j for j, s in enumerate(sums) if s is None), None)
            found.append((wrong - 1 if wrong is not None else math.inf, r, c, sums[-1]))
    if not found:
        return None
    step, r, c, ranks = min(found)
    a, b = bounds[c]
    chunk = f"rank {r}'s chunk {c} (elements {a}:{b} of {n})"
    if step == math.inf:
        return (f"{case}: {chunk} ends as the sum of {ranks} of the {n_ranks} ranks' values only: it missed a "
                f"step of the ring. Every rank takes {steps} steps of reduce-scatter, then {steps} of all-gather, "
                f"one chunk sent and one received at each {advice}")
    if step < 0:
        return f"{case}: {chunk} changed before ring_all_reduce's first message {advice}"
    lefts = ", ".join(str((r - i) % n_ranks) for i in range(1, n_ranks))
    if step < steps:
        return (f"{case}: {chunk} went wrong in the {_phase(step, steps)}: after it the chunk held neither rank "
                f"{r}'s own values of it nor their sum with its left neighbours' (ranks {lefts}). In the "
                f"reduce-scatter each rank adds the chunk that arrives to its own copy of that same chunk, and "
                f"sends on the chunk it added to one step before {advice}")
    return (f"{case}: {chunk} went wrong in the {_phase(step, steps)}: after it the chunk held neither the "
            f"finished sum of chunk {c} nor a partial sum of it: what arrived was written over another chunk, or "
            f"another chunk was sent. In the all-gather each rank sends on the finished chunk it received one step "
            f"before (at the first step, the one it finished in the reduce-scatter) {advice}")


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-3, rtol=1e-5))


# -- (f) the sharded optimizer: collectives the ranks agree on, and a wrong step explained ----------------------

class AgreedCollectives:
    """Inside ``with agreed.checking(module):`` each collective a rank starts is first compared with the other
    ranks' (one small all_gather of what each is about to call): a broadcast whose source, the parameter's owner,
    differs between the ranks, or collectives in another order, is named on every rank at once, where the real
    calls would wait for each other for ever. ``model``: whose parameters the message names; ``when``: where the
    check is (the case and the step), for the message."""

    def __init__(self, model: nn.Module, when: str = ""):
        self.params = [(name, p) for name, p in model.named_parameters()]
        self.when = when

    def _describe(self, name: str, args, kwargs) -> list[int]:
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
        root = kwargs.get("src", kwargs.get("dst", args[1] if len(args) > 1 and isinstance(args[1], int) else None))
        if root is None:   # broadcast(tensor, src) and reduce(tensor, dst), or their group ranks
            root = kwargs.get("group_src", kwargs.get("group_dst"))
        index = -1
        if isinstance(tensor, torch.Tensor):
            index = next((i for i, (_, p) in enumerate(self.params) if p.data_ptr() == tensor.data_ptr()
                          and p.numel() == tensor.numel()), -1)
        numel = tensor.numel() if isinstance(tensor, torch.Tensor) else -1
        return [COLLECTIVES.index(name), numel, -1 if root is None else int(root), index]

    def _what(self, row: list[int]) -> str:
        code, numel, root, index = row
        tensor = self.params[index][0] if index >= 0 else f"a tensor of {numel} elements"
        source = f" from rank {root}" if root >= 0 else ""
        return f"dist.{COLLECTIVES[code]} of {tensor}{source}"

    @contextlib.contextmanager
    def checking(self, module=None):
        real_gather = dist.all_gather
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None

        def agreed(name):
            function = getattr(dist, name)

            def called(*args, **kwargs):
                mine = torch.tensor(self._describe(name, args, kwargs), device=device)
                rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
                real_gather(rows, mine)
                rows = [row.tolist() for row in rows]
                if any(row != rows[0] for row in rows):
                    raise AssertionError(self._disagreement(rows))
                return function(*args, **kwargs)
            return called

        with _patched({name: agreed(name) for name in COLLECTIVES if hasattr(dist, name)}, module):
            yield self

    def _disagreement(self, rows: list[list[int]]) -> str:
        said = ", ".join(f"rank {rank} {self._what(row)}" for rank, row in enumerate(rows))
        if all(row[:2] == rows[0][:2] and row[3] == rows[0][3] for row in rows) and rows[0][3] >= 0:
            name = self.params[rows[0][3]][0]
            sources = " and ".join(f"rank {rank} from rank {row[2]}" for rank, row in enumerate(rows))
            return (f"{self.when}: the owners differ between ranks: {name} is broadcast by {sources}, so the "
                    f"ranks would wait for ever for each other. Every rank must give each parameter the same "
                    f"owner, from what is the same on every rank (the parameters, their order and sizes), never "
                    f"from its own rank (README (f); HINTS.md (f)).")
        return (f"{self.when}: the ranks' collectives differ: {said}. Every rank must make the same collectives in "
                f"the same order (every parameter sent from its owner, in the same order everywhere), or they wait "
                f"for each other for ever (README (f); HINTS.md (f)).")


class OneOptimizerStep:
    """One process's optimizer just before a step (its parameters, gradients and state), to replay that step
    with other learning rates: what a schedule that never reached the optimizer would have done."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        names = {id(p): name for name, p in model.named_parameters()}
        order = [p for group in optimizer.param_groups for p in group["params"]]
        self.cls, self.names = type(optimizer), [names[id(p)] for p in order]
        self.values = [p.detach().clone() for p in order]
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in order]
        self.state = copy.deepcopy(optimizer.state_dict())
        self.lrs = [group["lr"] for group in optimizer.param_groups]

    def with_lrs(self, lrs: list[float]) -> dict[str, torch.Tensor]:
        """``{name: the parameter}`` after this step taken with ``lrs`` (one per group)."""
        params = [nn.Parameter(value.clone()) for value in self.values]
        for param, grad in zip(params, self.grads):
            param.grad = grad
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [params[i] for i in group["params"]]}
                  for group in self.state["param_groups"]]
        optimizer = self.cls(groups)
        optimizer.load_state_dict(copy.deepcopy(self.state))
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.step()
        return {name: param.detach() for name, param in zip(self.names, params)}


def lr_text(lrs: list[float]) -> str:
    return f"{lrs[0]:.3g}" if len(set(lrs)) == 1 else "[" + ", ".join(f"{lr:.3g}" for lr in lrs) + "]"


def explain_sharded_step(model: nn.Module, single: nn.Module, before: OneOptimizerStep, history: list[list[float]],
                         when: str) -> None:
    """After step ``len(history)`` of the sharded optimizer (``model``) and of one process's (``single``), on every
    rank (a collective): say why a parameter differs, when the ranks' values show it. A rank still holding the
    value from before the step, where another rank has it right: never sent by its owner. The weights of the
    same step taken with an earlier step's learning rate: the schedule did not reach the optimizer that steps.
    Otherwise nothing is raised here (the caller compares the weights)."""
    step, world_size = len(history), dist.get_world_size()
    params, theirs = dict(model.named_parameters()), dict(single.named_parameters())
    names = before.names
    old = dict(zip(names, before.values))
    flags = torch.tensor([[int(_close(params[n].detach(), theirs[n].detach())),
                           int(torch.equal(params[n].detach(), old[n]))] for n in names])
    if dist.get_backend() == "nccl":
        flags = flags.cuda()
    rows = [torch.empty_like(flags) for _ in range(world_size)]
    dist.all_gather(rows, flags)
    rows = [row.cpu() for row in rows]
    for r, row in enumerate(rows):   # the same verdict on every rank: the lowest rank, its first such parameter
        for i, name in enumerate(names):
            right_on = [q for q in range(world_size) if rows[q][i, 0]]
            if not row[i, 0] and row[i, 1] and right_on:
                owner = (f"its owner, rank {right_on[0]} (the one rank where it is right)" if len(right_on) == 1
                         else f"the rank that stepped it (it is right on ranks {right_on})")
                raise AssertionError(
                    f"{when}: rank {r} still holds its own value of {name} from before this step: never received "
                    f"from {owner}. After the owners step their own parameters, every parameter must be sent from "
                    f"its owner to every rank (README (f); HINTS.md (f)).")
    mine = {n: params[n].detach() for n in names}
    if all(_close(mine[n], theirs[n].detach()) for n in names):
        return
    for earlier in range(step - 1, 0, -1):   # the lr of an earlier step (the one made with first, most often)
        lrs = history[earlier - 1]
        if lrs == history[-1]:
            continue
        replayed = before.with_lrs(lrs)
        if all(_close(mine[n], replayed[n]) for n in names):
            raise AssertionError(
                f"{when}: stepped with lr {lr_text(lrs)}, step {earlier}'s, where step {step}'s lr is "
                f"{lr_text(history[-1])}: the learning-rate schedule writes each step's lr into the param_groups of "
                f"ShardedOptimizer, and it must reach the optimizer that steps this rank's parameters before every "
                f"step (README (f); HINTS.md (f)).")
