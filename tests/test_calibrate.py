"""The network model against real links (``benchmarks/calibrate.py``): network namespaces
joined by veth pairs, egress shaped by ``tc tbf``; the tests that need namespaces are skipped,
with the reason, where they cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import calibrate  # noqa: E402


def can_make_namespaces() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    probe = f"{calibrate.PREFIX}probe{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    except FileNotFoundError:
        return "no ip command (iproute2)"
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        shaped = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
             "burst", "3000", "limit", "10000"],
            capture_output=True, text=True,
        )  # fmt: skip
    except FileNotFoundError:
        return "no tc command (iproute2)"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if shaped.returncode:
        return f"cannot shape a link with tc tbf: {shaped.stderr.strip()}"
    return None


needs_namespaces = pytest.mark.skipif(
    (why := can_make_namespaces()) is not None, reason=why or "namespaces work"
)


def ours(pid: int) -> list[str]:
    return calibrate.namespaces(f"{calibrate.PREFIX}{pid}-")


@needs_namespaces
def test_shaped_links_agree_with_the_shared_uplink_model(tmp_path):
    """A 3-peer star at 10 Mbit/s, 1 MB messages, the uplinks' queues fair among flows: with
    a shared uplink every message's measured send-to-arrival time is within 15% of the
    simulated one; with FIFO the server's back-to-back broadcast is off by more than 100%;
    nothing is left behind."""
    case = calibrate.Case("star", 3, 10, 1)
    real = calibrate.measure(case, tmp_path, queue="fair")
    assert ours(os.getpid()) == []
    took = {k: b - a for k, (a, b) in real.items()}
    assert len(took) == 6 and min(took.values()) > 0.8  # 1 MB at 10 Mbit/s: 0.8 s alone
    errors = {}
    for uplink in ("shared", "fifo"):
        sim = calibrate.simulate(case, uplink, tmp_path)
        errors[uplink] = [took[k] / (sim[k][1] - sim[k][0]) - 1 for k in took]
    assert max(map(abs, errors["shared"])) < 0.15, errors
    assert max(errors["fifo"]) > 1.0, errors  # the first broadcast message takes 3 transfers


@needs_namespaces
def test_an_interrupted_calibration_leaves_no_namespace_or_process(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "calibrate.py"), "--quick", "--figure",
         str(tmp_path / "f.png")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(ours(proc.pid)) < 3:  # the bridge and the first nodes are up
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(2.0)  # the node processes are starting
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "interrupted" in err, err
    assert ours(proc.pid) == []
    script = str(ROOT / "benchmarks" / "calibrate.py")
    nodes = subprocess.run(["pgrep", "-f", f"{script} --node"], capture_output=True, text=True)
    assert nodes.stdout.strip() == ""
    assert not (tmp_path / "f.png").exists()


def test_links_that_cannot_be_made_are_one_line_and_exit_status_2(tmp_path):
    """An ``ip`` that fails (as ``ip netns add`` does without the right privileges) ends the
    run with one ``error:`` line naming the command, status 2; so does a user who is not root."""
    (tmp_path / "ip").write_text(
        "#!/bin/sh\necho 'mount /run/netns: Permission denied' >&2\nexit 1\n"
    )
    (tmp_path / "ip").chmod(0o755)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "calibrate.py"), "--quick"],
        capture_output=True, text=True, timeout=120,
        env=os.environ | {"PATH": f"{tmp_path}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert ("ip netns add" in lines[0]) == (os.geteuid() == 0), lines
