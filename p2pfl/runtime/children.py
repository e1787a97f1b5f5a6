"""Child processes that never outlive the process that started them (peers of a ZeroMQ
run, ranks of ``--workers``, the figure a run draws meanwhile, a :class:`Standby` that
prepares it), whatever kills it.

Peers and ranks are :class:`Forked` from a process that has already imported torch and
loaded the data: they share those pages copy-on-write, so a peer costs tens of megabytes and
milliseconds instead of a fresh interpreter's hundreds and seconds."""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import functools
import gc
import math
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from p2pfl.core.errors import ConfigError, RankFailed, RunError

LAUNCHER_PID = "P2PFL_LAUNCHER_PID"
"""The environment variable that tells a child the launcher's process id."""


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


def name_process(name: str) -> None:
    """Show ``name`` (at most 15 bytes) for this process in ``ps``, ``top`` and ``pgrep``."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


class Forked:
    """A child process forked from this one to call ``main`` (its return value is the
    child's exit code), with the part of :class:`subprocess.Popen`'s interface a launcher
    uses. The child shares this process's memory copy-on-write: every object made so far
    is frozen out of the cyclic collector (whose scans would write to, and so copy, every
    page), the child ends with ``os._exit`` (no buffers or destructors of this process run
    twice) and its standard output goes to ``/dev/null``."""

    def __init__(self, main: Callable[[], int], name: str) -> None:
        self.returncode: int | None = None
        # reaping and signalling under one lock: a pid is never signalled once reaped (the
        # system may have given it to another process by then)
        self._reaping = threading.RLock()
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()
        self.pid = os.fork()
        if self.pid == 0:
            _child(main, name)
        gc.unfreeze()

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to end (``subprocess.TimeoutExpired`` after ``timeout``);
        without a timeout, in the kernel (other threads keep the interpreter), leaving the
        child to be reaped under the lock."""
        while timeout is None and self.returncode is None:
            with contextlib.suppress(ChildProcessError):  # reaped meanwhile by another thread
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            self.poll()
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        with self._reaping:
            if self.poll() is None:
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Standby(Forked):
    """A child forked before its work is known (before this process imports torch, say), so
    that it imports what that work needs, ``prepare()``, on another core meanwhile; it then
    waits for :meth:`give`. It does the work at nice 19, taking only the cycles this process
    leaves idle (preparing, it competes as this process would: it must be ready by the
    time the work comes). A standby that is given nothing is :meth:`dismiss`-ed (killed,
    never reaped late)."""

    def __init__(self, prepare: Callable[[], object], name: str) -> None:
        self.owner = os.getpid()  # a process forked from the owner holds a copy: not its own
        self._job, write = os.pipe()
        super().__init__(functools.partial(_standby, prepare, self._job, write), name)
        os.close(self._job)
        self._write: int | None = write

    def give(self, job: Callable[..., object], *args: Any) -> Standby:
        """Have the child call ``job(*args)`` (both pickled: ``job`` by its name, which the
        child imports) and exit 0, or 1 with its traceback on stderr if it raises."""
        assert self._write is not None, "a standby takes one job"
        message = pickle.dumps((job, args), protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(self._write, "wb") as pipe:  # a child that died: BrokenPipeError
            self._write = None
            with contextlib.suppress(BrokenPipeError):  # then its exit status tells
                pipe.write(len(message).to_bytes(8, "little") + message)
        return self

    def dismiss(self) -> None:
        """End a standby that was given nothing (and reap it)."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
            self.kill()
            self.wait()


STANDBY: dict[str, Standby] = {}
"""Standby children by the job they wait for (``figure``: a run's partition figure, forked
by ``p2pfl run`` as it starts)."""


def take_standby(job: str) -> Standby | None:
    """The standby waiting for ``job``, now this process's to :meth:`Standby.give` (None if
    there is none, or it is another process's: this one was forked from its owner)."""
    ahead = STANDBY.get(job)
    if ahead is None or ahead.owner != os.getpid():
        return None
    return STANDBY.pop(job)


def _standby(prepare: Callable[[], object], job: int, write: int) -> int:
    """A :class:`Standby`'s life: read its job on a thread (the pipe drains at once, the
    giver never blocks) while ``prepare()`` runs; then run it. End of input before a
    whole job (the giver is gone): exit 0, doing nothing."""
    os.close(write)
    received: list[bytes] = []

    def read() -> None:
        with os.fdopen(job, "rb") as pipe:
            size = int.from_bytes(pipe.read(8) or b"\0", "little")
            message = pipe.read(size) if size else b""
            if size and len(message) == size:
                received.append(message)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    prepare()
    reader.join()
    if not received:
        return 0
    os.nice(19)
    call, args = pickle.loads(received[0])
    call(*args)
    return 0


def stop(children: Iterable[Forked], grace_s: float) -> None:
    """Terminate every child still running: SIGTERM (each ends as on Ctrl-C, writing what it
    must), then SIGKILL for any not gone ``grace_s`` seconds later (a hung one gets no
    longer)."""
    live = [c for c in children if c.poll() is None]
    for c in live:
        c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in live:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


def _child(main: Callable[[], int], name: str) -> None:
    """The forked child's whole life: run ``main``, leave with its code, never return."""
    code = 1
    try:
        name_process(name)
        os.environ[LAUNCHER_PID] = str(os.getppid())
        die_with_launcher()
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) not in (signal.SIG_IGN, None):
                signal.signal(sig, _interrupted)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        with interrupts_kept():
            code = main()
    except KeyboardInterrupt:  # Ctrl-C or the launcher's SIGTERM: the launcher reports it
        code = 130
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _interrupted(signum: int, frame: object) -> None:
    """A child's first Ctrl-C or SIGTERM ends it as Ctrl-C does; the next ones (a terminal's
    SIGINT is followed by the launcher's SIGTERM) are ignored, so that they do not break
    the cleanup the first one started (tracebacks from sockets' destructors)."""
    signal.signal(signal.SIGINT, _ignored)  # a handler, not SIG_IGN: one already pending
    signal.signal(signal.SIGTERM, _ignored)  # would then raise "ignored due to race condition"
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _ignored(signum: int, frame: object) -> None:
    """A signal after the first: the child is already ending."""


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """Within it, an interrupt that a signal handler raised where no exception can go on is
    raised again, not printed and lost. Python runs a handler wherever C code checks for
    signals, destructors included: pyzmq checks in ``Frame.__dealloc__``, and a Ctrl-C or
    SIGTERM that came then was printed as a traceback ("Exception ignored in ...") and never
    stopped the process. Here it is raised at the next call or return of the code that the
    destructor interrupted (a profile hook, removed once it has raised), and not reported."""
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def again(u: Any) -> None:
        if not isinstance(u.exc_value, KeyboardInterrupt):
            return unraisable(u)
        lost, profiler = u.exc_value, sys.getprofile()

        def raise_it(frame: Any, event: str, arg: Any) -> None:
            if frame.f_code is not again.__code__:  # not this hook's own return
                sys.setprofile(profiler)
                raise lost

        sys.setprofile(raise_it)

    def quiet(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        # Cython reports an exception in a destructor twice, through this hook and then the
        # unraisable one; an interrupt comes here only that way (callers catch the others)
        if not issubclass(kind, KeyboardInterrupt):
            excepthook(kind, value, tb)

    sys.unraisablehook, sys.excepthook = again, quiet
    try:
        yield
    finally:
        sys.unraisablehook, sys.excepthook = unraisable, excepthook


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


JOIN_ENV = "P2PFL_JOIN_TIMEOUT_S"
"""The environment variable that bounds how long a rank waits for the others to join."""
JOIN_S = 300.0
"""Its default: time to start the same command on every host by hand."""
MAX_JOIN_S = 86_400.0  # a day: longer is a typo (milliseconds)


def join_timeout() -> float:
    """How long a rank waits for the others to join (``P2PFL_JOIN_TIMEOUT_S`` seconds, or
    :data:`JOIN_S`): a rank whose others never start ends then, with one line."""
    text = os.environ.get(JOIN_ENV, "")
    if not text:
        return JOIN_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_JOIN_S:  # NaN too
        raise ConfigError(JOIN_ENV, f"must be seconds in (0, {MAX_JOIN_S:g}], got {text[:40]!r}")
    return seconds


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


CGROUP_MEMORY = [
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
]
"""A container's memory limit and use, as cgroups v2 and v1 show them to the processes in it."""


def available_memory() -> int | None:
    """Bytes of memory that new processes can still take: the system's ``MemAvailable``, or
    less where a container's limit allows less; ``None`` where none of it can be read."""
    found = []
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as f:
        found.append(int(next(x for x in f if x.startswith("MemAvailable:")).split()[1]) << 10)
    for limit, used in CGROUP_MEMORY:
        with contextlib.suppress(OSError, ValueError), open(limit) as a, open(used) as b:
            found.append(int(a.read()) - int(b.read()))  # ValueError: "max", no limit
    return min(found) if found else None


def rank_threads(n: int) -> int:
    """Each of ``n`` local ranks' torch threads: ``OMP_NUM_THREADS`` if set, else its share
    of the cores."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) >= 1:
        return int(threads)
    return max(1, (os.cpu_count() or 1) // n)


def _rank_life(main: Callable[[int, Path], int], r: int, scratch: Path, told: int) -> int:
    """Rank ``r``'s life in its forked child: a :class:`RunError` (it could not join the
    others, say) is told to rank 0, whose error line it becomes, rather than printed here
    as a second line for one failure."""
    try:
        return main(r, scratch)
    except RunError as e:
        os.write(told, str(e).encode()[: select.PIPE_BUF])
        return 1


DEATH_SEEN_S = 10.0
"""How long rank 0, its exchange failed, waits to learn which rank died: a dead rank's
connections close before its exit can be seen, by more than 2 s on a lent H200 running the
suite on CUDA (likely its driver tearing the rank's CUDA context down first)."""

DEATH_GRACE_S = 30.0
"""How long a rank's death waits for rank 0 to end its run itself (writing its summary)
before rank 0 is ended from outside: it may be stuck in a call that cannot be interrupted."""


class Workers:
    """``--workers N``: this process is rank 0 of N; ranks 1..N-1 are forked from it once
    it has built the run, each calling ``main(rank)`` as ``p2pfl rank R`` in ``ps``, each
    dying with this process. A rank that dies ends the run with a :class:`RankFailed` naming
    it (or telling the rank's own RunError, where one ended it), raised in this process's main
    thread (which must create the workers and :meth:`stop` them); ranks that this process
    stops are not reported.

    ``main(rank, scratch)`` writes what the rank throws away (rank 0 writes what is kept)
    to ``scratch``, a directory inside :attr:`scratch`, which this process removes once the
    ranks have ended, however they ended: a rank that is killed cannot remove its own."""

    def __init__(self, n: int, main: Callable[[int, Path], int]) -> None:
        self.death: str | None = None  # the first rank's death, in one line
        self._died = threading.Event()
        self._stopped = threading.Event()
        self._handler = signal.signal(signal.SIGUSR1, self._raise)
        self.scratch = Path(tempfile.mkdtemp(prefix="p2pfl-ranks-"))
        self.children: list[Forked] = []
        try:
            for r in range(1, n):
                why, told = os.pipe()  # a rank's RunError, told to rank 0 to report
                rank = functools.partial(_rank_life, main, r, self.scratch / f"rank{r}", told)
                child = Forked(rank, f"p2pfl rank {r}")
                os.close(told)
                self.children.append(child)
                threading.Thread(target=self._watch, args=(r, child, why), daemon=True).start()
        except BaseException:  # a fork that failed: no one else will stop those forked
            self.stop()
            raise

    def _watch(self, r: int, child: Forked, why: int) -> None:
        code = child.wait()
        with os.fdopen(why, "rb") as pipe:  # the child has exited: what it told is all there
            told = pipe.read().decode(errors="replace")
        if code == 0 or self._stopped.is_set() or self._died.is_set():
            return
        self.death = told or f"worker rank {r} exited with code {code}"
        self._died.set()
        _thread.interrupt_main(signal.SIGUSR1)
        if not self._stopped.wait(DEATH_GRACE_S):
            sys.stderr.write(f"error: {self.death}\n")
            sys.stderr.flush()
            self._kill()
            os._exit(1)

    def _raise(self, signum: int, frame: object) -> None:
        if sys.exc_info()[1] is not None:
            # the run is ending already (the dead rank failed its exchange first), maybe in
            # the ``finally`` that writes summary.json: the death becomes its error after
            return
        raise RankFailed(self.death or "a worker rank exited")  # as a failed exchange tells it

    def died(self, within: float) -> str | None:
        """The rank whose death ended the run, if one did, waiting up to ``within`` seconds
        for it: a dying rank's connections close (failing the others' exchange) a moment
        before its exit can be seen."""
        self._died.wait(within)
        return self.death

    def stop(self) -> None:
        """Kill the ranks still running and wait for them."""
        self._stopped.set()
        signal.signal(signal.SIGUSR1, self._handler)
        self._kill()

    def _kill(self) -> None:
        """Kill the ranks still running, wait for them, and remove what they wrote."""
        for child in self.children:
            child.kill()
        for child in self.children:
            child.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def join(self) -> None:
        for child in self.children:
            child.wait()
