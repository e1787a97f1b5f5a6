"""SimPy's order of events is the order of their causal keys (``benchmarks/causal_order.py``,
docs/performance.md, "A population sharded across ranks"): what lets a rank that simulates
only its own peers order its events as one process does."""

from __future__ import annotations

import sys

import pytest
import simpy

import p2pfl
from conftest import ROOT
from p2pfl.runtime.sim import SimRuntime

sys.path.insert(0, str(ROOT / "benchmarks"))

import causal_order  # noqa: E402


@pytest.mark.parametrize(
    ("name", "sets", "tied"),
    [("quickstart", {}, 0.15), ("population-dfedavgm", {"peers__count": 300}, 0.99)],
)
def test_every_event_comes_in_the_order_of_its_causal_key(tmp_path, name, sets, tied):
    """Each event's key exceeds the one processed before it, over runs where ties at one
    instant are common (a FedAvg star) and almost universal (DFedAvgM: every peer trains for
    the same modelled time), so it is the key's causal part that orders them."""
    with causal_order.recording() as rec:
        p2pfl.run(ROOT / "experiments" / f"{name}.yaml", out=tmp_path / "run", **sets)
    assert rec.events > 800 and rec.out_of_order == 0
    assert rec.same_instant > tied * rec.events
    count, pending, _ = rec.windows()
    assert 1 <= count < rec.events and max(pending) >= 1


def test_the_recording_leaves_simpy_and_the_runtime_as_they_were():
    patched = (simpy.Environment, "schedule"), (simpy.Environment, "step"), (SimRuntime, "_arrive")
    before = [getattr(owner, name) for owner, name in patched]
    with causal_order.recording():
        assert all(getattr(o, n) is not b for (o, n), b in zip(patched, before, strict=True))
    assert [getattr(owner, name) for owner, name in patched] == before


def test_an_event_scheduled_between_two_steps_follows_those_queued_at_its_instant():
    """As the runtime's wake-up of its listeners at a run's end: SimPy takes it after every
    event already queued for its instant, as the next event of the one processed last."""
    with causal_order.recording() as rec:
        env = simpy.Environment()
        env.timeout(0).callbacks.append(lambda _: env.timeout(1))  # queued for t = 1
        env.step()
        env.timeout(1)  # between two steps, for the same t = 1
        env.step()
        env.step()
    assert rec.events == 3 and rec.out_of_order == 0
