"""Stochastic gradient push (``pushsum``; Assran et al. 2019) on static and redrawn graphs."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from conftest import run_experiment
from p2pfl.methods.base import NodeContext
from p2pfl.methods.effects import Evaluate, Finish, Neighbours, Now, Recv, Send, Train
from p2pfl.methods.pushsum import PushSum, weight_meta
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology
from p2pfl.runtime.sim import SimRuntime

SECTIONS = {
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "topology": {"kind": "ring"},
    "peers": {"count": 6},
}


def final_accuracies(out) -> list[float]:
    with open(out / "metrics.csv") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["metric"] == "accuracy"]


def test_push_sum_equals_dfedavgm_on_a_ring(tmp_path):
    """A ring is regular and undirected: the push shares 1/3 equal the Metropolis weights 1/3
    and every weight stays 1, so SGP and DFedAvgM train the same models."""
    ps = run_experiment(tmp_path / "ps", **SECTIONS, algorithm={"name": "pushsum", "rounds": 3})
    dm = run_experiment(tmp_path / "dm", **SECTIONS, algorithm={"name": "dfedavgm", "rounds": 3})
    assert ps["comm"]["messages"] == dm["comm"]["messages"] == 3 * 6 * 2
    a, b = final_accuracies(tmp_path / "ps"), final_accuracies(tmp_path / "dm")
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-9
    # only the weight's fixed-width text is extra on the wire
    extra = ps["comm"]["total_bytes"] - dm["comm"]["total_bytes"]
    assert extra > 0 and extra % (3 * 12) == 0 and extra // (3 * 12) < 64


def test_push_sum_on_graphs_redrawn_every_round(tmp_path):
    net = {"graph": {"every": "round", "kind": "s_out", "s": 2}}
    runs = [
        run_experiment(
            tmp_path / n, **SECTIONS, algorithm={"name": "pushsum", "rounds": 4}, network=net
        )
        for n in ("a", "b")
    ]
    assert runs[0]["comm"]["messages"] == 4 * 6 * 2  # N·s shares per round
    assert runs[0] == runs[1] | {k: runs[0][k] for k in ("wall_time_s", "compute_wall_s")}
    with open(tmp_path / "a/comm.csv") as f:
        pairs = {(r["round"], r["src"], r["dst"]) for r in csv.DictReader(f)}
    assert {(s, d) for r, s, d in pairs if r == "1"} != {(s, d) for r, s, d in pairs if r == "2"}
    assert runs[0]["final"]["accuracy"] > 0.3  # learns (digits, 10 classes)


def test_weights_travel_as_exact_fixed_width_text():
    for w in (1.0, 1 / 3, 2.0**-30, 0.5):
        text = weight_meta(w)["weight"]
        assert float(text) == w and len(text) == len(weight_meta(1.0)["weight"])


CHURN = {"online": {"mean_s": 1.5}, "offline_fraction": 0.3}


@pytest.mark.parametrize(
    "network",
    [{}, {"links": {"loss": 0.2}}, {"churn": CHURN}],
    ids=["reliable", "loss", "churn"],
)
def test_late_shares_are_added_at_the_next_receive(tmp_path, monkeypatch, network):
    """A share that comes after its round's receive (its sender waited out a lost share,
    or was online when its receiver took it for offline) is added at the receiver's next
    receive, as SGP adds whatever has arrived: the only shares left unread at the end are
    those that came after their receiver's last receive (its last evaluation)."""
    runtimes = []
    init = SimRuntime.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        runtimes.append(self)

    monkeypatch.setattr(SimRuntime, "__init__", spy)
    rounds = 8
    run_experiment(
        tmp_path,
        partition={"name": "iid"},
        topology={"kind": "mesh"},
        peers={"count": 12},
        algorithm={"name": "pushsum", "rounds": rounds, "wait_s": 0.5},
        network={"graph": {"every": "round", "kind": "s_out", "s": 3}} | network,
    )
    with open(tmp_path / "comm.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["fate"] == "delivered"]
    arrival = {(r["src"], r["dst"], int(r["round"])): float(r["arrival"]) for r in rows}
    with open(tmp_path / "metrics.csv") as f:
        last = {r["peer"]: float(r["time"]) for r in csv.DictReader(f) if r["round"] == str(rounds)}
    left = [m for inbox in runtimes[0].inbox.values() for m in inbox]
    came_late = [arrival[str(m.src), str(m.dst), m.round] >= last[str(m.dst)] for m in left]
    assert all(came_late)
    assert bool(left) == bool(network)  # with loss or churn some came after the end


def test_running_sums_recover_lost_shares_with_the_same_messages(tmp_path):
    """``robust: true`` (running sums; Hadjicostis, Vaidya and Domínguez-García 2016): the
    same messages of the same sizes meet the same fates (comm.csv byte for byte), but a lost
    share reaches its receiver with the next message on that link, so push-sum no longer
    collapses at 20 % loss; on links that deliver it equals plain push-sum to float
    rounding."""
    base = {
        "partition": {"name": "iid"},
        "topology": {"kind": "mesh"},
        "peers": {"count": 12},
        "eval": {"every": 1, "per_peer": False},
    }
    algorithm = {"name": "pushsum", "rounds": 20, "wait_s": 0.5}
    runs = {}
    for loss in (0.0, 0.2):
        net = {"graph": {"every": "round", "kind": "s_out", "s": 3}, "links": {"loss": loss}}
        for robust in (False, True):
            out = tmp_path / f"{loss}-{robust}"
            algo = algorithm | {"robust": robust}
            runs[loss, robust] = run_experiment(out, **base, algorithm=algo, network=net)
            runs[loss, robust]["comm.csv"] = (out / "comm.csv").read_bytes()
    for loss in (0.0, 0.2):
        assert runs[loss, True]["comm.csv"] == runs[loss, False]["comm.csv"]
    assert runs[0.2, True]["comm"]["by_fate"]["lost"]["messages"] > 20
    plain, robust = (runs[0.2, r]["final"]["accuracy"] for r in (False, True))
    assert robust > plain + 0.3, (plain, robust)
    a, b = (final_accuracies(tmp_path / f"0.0-{r}") for r in (False, True))
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.01


def test_running_sums_are_sent_and_an_older_one_taken_late_is_dropped():
    """Node 0 of a ring, driven effect by effect (its trainings change nothing): it sends
    the running totals of its shares (τ 0.5, 0.75, 1.375, where plain push-sum sends 0.25
    and 0.3125 after the first); its round-1 message from 1 was lost, the round-2 one
    carries both rounds' mass, and the round-1 one, coming late, is already in it (adding it
    again would leave z = 4/3); round 3 adds only what came since round 2 (the whole total
    would leave z = 6.5 / 2.125)."""
    topology = build_topology({"kind": "ring"}, 3, 0)
    ctx = NodeContext(0, topology, 10, 0, lambda: {"w": torch.zeros(2)}, frozenset({"w"}))
    gen = PushSum(rounds=3, wait_s=1.0, robust=True).behaviour(ctx)

    def share(r: int, value: float, weight: float) -> Message:
        return Message("model", 1, 0, r, {"w": torch.full((2,), value)}, weight_meta(weight))

    # each Recv's messages, in turn: a round's receive, then its late one
    arrivals = [[], [], [share(2, 3.0, 1.0)], [share(1, 1.0, 0.5)], [share(3, 5.0, 1.5)], []]
    sent, scored, reply = [], [], None
    while True:
        eff = gen.send(reply)
        if isinstance(eff, Finish):
            break
        reply = {
            Train: lambda e: SimpleNamespace(state=e.state),
            Neighbours: lambda e: [1],
            Now: lambda e: 0.0,
            Recv: lambda e: arrivals.pop(0),
            Send: lambda e: sent.append((e.round, float(e.meta["weight"]))),
            Evaluate: lambda e: scored.append(e.state["w"].tolist()),
        }[type(eff)](eff)
    assert sent == [(1, 0.5), (2, 0.75), (3, 1.375)]
    assert scored[0] == [0.0, 0.0]
    assert scored[1] == pytest.approx([2.4, 2.4], rel=1e-6)  # x = 0 + 3, w = 0.25 + 1.0
    assert scored[2] == pytest.approx([3.5 / 1.125] * 2, rel=1e-6)  # x = 1.5 + 2, w = 0.625 + 0.5


def test_running_sums_conserve_the_weight_under_loss_jitter_and_churn(tmp_path, monkeypatch):
    """Whatever the network does, every peer's weight plus what is still on the links (each
    link's total pushed, less the last total its receiver took) sums to N: nothing is lost
    for good, and nothing is counted twice (jitter reorders messages, so older totals come
    after newer ones; churn holds senders back)."""
    ends = {}
    behaviour = PushSum.behaviour

    def watched(self, ctx):  # the real behaviour; its state read when it yields Finish
        gen, reply = behaviour(self, ctx), None
        while True:
            eff = gen.send(reply)
            if isinstance(eff, Finish):
                ends[ctx.node] = {k: gen.gi_frame.f_locals[k] for k in ("w", "pushed", "taken")}
            reply = yield eff
            if isinstance(eff, Finish):
                return

    monkeypatch.setattr(PushSum, "behaviour", watched)
    jitter = {"dist": "exponential", "mean_s": 0.3}
    network = {
        "graph": {"every": "round", "kind": "s_out", "s": 3},
        "links": {"loss": 0.2, "jitter": jitter},
        "churn": {"online": {"mean_s": 3.0}, "offline_fraction": 0.25},
    }
    summary = run_experiment(
        tmp_path, partition={"name": "iid"}, topology={"kind": "mesh"}, peers={"count": 12},
        algorithm={"name": "pushsum", "rounds": 10, "wait_s": 0.5, "robust": True},
        network=network,
    )  # fmt: skip
    assert set(summary["comm"]["by_fate"]) >= {"delivered", "lost", "offline"}
    assert len(ends) == 12
    on_links = sum(
        tau - ends[j]["taken"].get(i, (0, None, 0.0))[2]
        for i, end in ends.items()
        for j, (_, tau) in end["pushed"].items()
    )
    assert on_links > 0.5  # much is still on the links at 20 % loss
    assert sum(end["w"] for end in ends.values()) + on_links == pytest.approx(12, abs=1e-9)
