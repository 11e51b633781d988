"""C++ noise held back from fd 2 without losing what anything else wrote meanwhile (robust/stderr.py)."""
from __future__ import annotations

import os
import threading

from ddp_utils.robust.stderr import HeldStderr, profiler_noise, store_noise

KINETO = "USDT:2026-11-28 20:05:21 20305:20305 SyncActivityProfilerHandler.cpp:39] profiler_start\n"
STORE = ("[W1128 20:05:21.123456 12345 TCPStore.cpp:123] [c10d] recvValue failed\n"
         "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:670\n"
         "frame #0: c10::Error::Error() + 0x98\n"
         "<omitting python frames>\n"
         "  <omitting python frames>\n")


def test_while_fd_2_is_held_another_threads_lines_are_kept_and_the_noise_dropped(capfd):
    """Issue 43, finding 8: fd 2 went to /dev/null for the whole process around the profiler and the setup watch,
    so what another thread wrote then (a warning, the watch's own line) was lost."""
    held = HeldStderr(store_noise)
    held.hold()   # from the watch's thread, released from the main thread (as SetupWatch does)
    writer = threading.Thread(target=lambda: os.write(2, ("rank 1: waiting for rank 0\n" + STORE).encode()))
    writer.start()
    writer.join()
    assert capfd.readouterr().err == ""   # held, not yet shown
    held.release()
    assert capfd.readouterr().err == "rank 1: waiting for rank 0\n"
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"   # fd 2 is the real one again


def test_the_profilers_lines_are_noise_and_a_students_are_not(capfd):
    with HeldStderr(profiler_noise):
        os.write(2, (KINETO + "ERROR:2026-11-28 20:05:21 1:1 CuptiActivityApi.cpp:1] gpuGetDeviceCount failed\n"
                     + "UserWarning: something the student should see\n").encode())
    assert capfd.readouterr().err == "UserWarning: something the student should see\n"


def test_a_process_forked_during_a_hold_writes_to_the_real_stderr_after_the_hold_ends(capfd):
    """A DataLoader worker forked while the watch's thread held fd 2 (every 2 s, around a store request) kept the
    temporary file as its fd 2 for its whole life: a warning or crash message it wrote after the parent's release
    was lost."""
    held = HeldStderr(store_noise)
    held.hold()   # as the watch's thread holds it
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the worker: waits until the parent released its hold, then writes
        try:
            os.read(go_r, 1)
            os.write(2, b"worker: a warning\n")
        finally:
            os._exit(0)
    held.release()
    os.write(go_w, b"x")
    assert os.waitpid(pid, 0)[1] == 0
    os.close(go_r)
    os.close(go_w)
    assert capfd.readouterr().err == "worker: a warning\n"
