"""Child processes that never outlive the process that started them (peers of a ZeroMQ
run, ranks of ``--workers``), whatever kills it. No torch here: ``--workers`` starts its
ranks before this process has imported it, so that they import and load alongside."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

LAUNCHER_PID = "P2PFL_LAUNCHER_PID"
"""The environment variable that tells a child the launcher's process id."""

RANK_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` sets for each rank of a spread simulation, and ``--workers`` too."""


def die_with_launcher() -> None:
    """Make this process die with the launcher that started it, whatever kills the launcher
    (SIGKILL included): Linux's parent-death signal, or elsewhere a thread that watches the
    parent; a child whose launcher is already gone exits at once."""
    parent = int(os.environ.get(LAUNCHER_PID, "0"))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if parent and os.getppid() != parent:
        os._exit(1)


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Workers:
    """``--workers N``: this process becomes rank 0 of N, the others are started here (same
    command, ``RANK`` 1..N-1), each with ``cores // N`` threads unless ``OMP_NUM_THREADS``
    says otherwise, and each dies with this process. A rank that dies ends the run."""

    def __init__(self, n: int, argv: list[str]) -> None:
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if not threads.isdigit() or int(threads) < 1:
            threads = str(max(1, (os.cpu_count() or 1) // n))
        env = os.environ | {
            "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": threads, LAUNCHER_PID: str(os.getpid()),
        }  # fmt: skip
        self.children = [
            subprocess.Popen([sys.executable, "-m", "p2pfl", *argv], env=env | {"RANK": str(r)})
            for r in range(1, n)
        ]
        self.env = {k: env[k] for k in RANK_ENV if k != "RANK"} | {"RANK": "0"}  # rank 0's
        self.threads = int(threads)
        self.ready = threading.Event()  # set once rank 0 has built the run: it then joins
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        """End the run, with the rank's name, if a rank exits with an error (once rank 0
        has built the run: a configuration error is rank 0's to report)."""
        for r, child in enumerate(self.children, 1):
            code = child.wait()
            if code != 0:
                self.ready.wait()
                sys.stderr.write(f"error: worker rank {r} exited with code {code}\n")
                sys.stderr.flush()
                self.stop()
                os._exit(1)

    def stop(self) -> None:
        """Kill the ranks still running."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()

    def join(self) -> None:
        for child in self.children:
            child.wait()
