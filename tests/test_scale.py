"""Many peers in one process: idle peers hold only their model state, on the CPU."""

from __future__ import annotations

import gc
import tempfile
import warnings
from pathlib import Path

import pytest
from torch import nn

from conftest import experiment
from p2pfl.app.experiment import _simulate, build
from p2pfl.learning.state import state_bytes
from p2pfl.reporting.reporters import open_reporters


def live_modules() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        return sum(isinstance(m, nn.Module) for m in gc.get_objects())


@pytest.mark.parametrize("batched", [False, True])
def test_idle_peers_hold_one_cpu_state_each_and_no_module(batched):
    setup = build(
        experiment(
            peers={"count": 200, "batched": batched},
            algorithm={"name": "fedavg", "rounds": 2, "participation": 0.05},
            eval={"every": 2, "per_peer": False},
        )
    )
    for device in setup.devices:  # the trainer's one template per device (pytest --device)
        setup.trainer.module(device)
    before = live_modules()
    with tempfile.TemporaryDirectory() as out:
        reporters = open_reporters(Path(out))
        finals, *_ = _simulate(setup, Path(out), False, reporters)
        reporters.close()
    assert live_modules() - before < 5  # the templates are all there is: none per peer
    states = [finals[p].state for p in setup.topology.peers]
    assert all(t.device.type == "cpu" for s in states for t in s.values())
    size = state_bytes(states[0])
    assert sum(state_bytes(s) for s in states) == 200 * size
