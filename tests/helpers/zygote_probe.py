"""What a process sees of how it was started, as one JSON line on stdout; then it ends as the first argument asks.
tests/test_zygote.py runs it as a real process and forked from the fork server (tests/helpers/zygote.py) and compares."""
import atexit
import json
import os
import signal
import subprocess
import sys
import time


def facts() -> dict:
    return {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
            "file": os.path.abspath(__file__), "env": os.environ.get("PROBE_VAR"),
            "unbuffered": os.environ.get("PYTHONUNBUFFERED"), "own_session": os.getsid(0) == os.getpid(),
            "stdin_open": sys.stdin is not None and not sys.stdin.closed, "hash": hash("ddp-kit"),
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}


def main() -> None:
    how = sys.argv[1]
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps(facts()), flush=True)
    if how == "exit":
        sys.exit(int(sys.argv[2]))
    if how == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)
    if how == "killed":   # the out-of-memory killer: no handler can run
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
    if how == "raise":
        raise ValueError("the probe's own error")
    if how == "unflushed":
        sys.stdout.write("the last words, no newline, not flushed")
    if how == "wait":   # for a signal to the process group: a grandchild in the group says whether it got it too
        child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                  "signal.signal(signal.SIGINT, lambda *a: (print('grandchild got SIGINT', "
                                  "flush=True), sys.exit(0)))\nprint('grandchild ready', flush=True)\n"
                                  "time.sleep(20)\nprint('grandchild timed out', flush=True)"])
        time.sleep(1.5)
        print("ready", flush=True)
        try:
            time.sleep(20)
        finally:
            child.wait(timeout=25)


if __name__ == "__main__":
    main()
