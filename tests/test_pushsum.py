"""Stochastic gradient push (``pushsum``; Assran et al. 2019) on static and redrawn graphs."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from conftest import finals, run_experiment, sim_runtimes
from p2pfl.methods.base import NodeContext
from p2pfl.methods.effects import Evaluate, Finish, Neighbours, Now, Recv, Send, Train
from p2pfl.methods.pushsum import PushSum, weight_meta
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology

SECTIONS = {
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "topology": {"kind": "ring"},
    "peers": {"count": 6},
}


def metric_rows(out) -> list[tuple[str, ...]]:
    with open(out / "metrics.csv") as f:
        return [tuple(r.values()) for r in csv.DictReader(f)]


FLOAT32_ROUNDING = 2.5e-7
"""How far apart two peers' models may be, per coordinate, where two methods compute the same
numbers in a different float32 order: a few units in the last place at these magnitudes
(|w| < 0.5, ulp 3e-8); measured 4.5e-8 (push-sum vs DFedAvgM, 3 rounds) and 8.9e-8 (running
sums vs plain, 20 rounds). Not bit for bit, for reasons in p2pfl's arithmetic, not the methods:
DFedAvgM mixes in float64 and rounds once (``average_states``), push-sum scales each share by
1/(d + 1) and adds the shares in float32 and applies a training as x + (trained - z); running
sums send σ = x + (what was pushed before) and the receiver subtracts the last σ, which rounds
again. A method that mixes wrongly moves coordinates by 1e-3 and more."""


def assert_rounding_apart(a: dict, b: dict, nodes) -> None:
    assert a.keys() == b.keys() == set(nodes)
    for n in nodes:
        assert a[n].keys() == b[n].keys()
        for k in a[n]:
            gap = (a[n][k].double() - b[n][k].double()).abs().max().item()
            assert gap <= FLOAT32_ROUNDING, (n, k, gap)


def assert_same_evaluations(a: list[tuple[str, ...]], b: list[tuple[str, ...]]) -> None:
    """The same metrics.csv rows: accuracies as written (a count of right answers), losses to
    float32 rounding (their last written digit may differ)."""
    assert [r[:-1] for r in a] == [r[:-1] for r in b]
    for x, y in zip(a, b, strict=True):
        if x[-2] == "loss":
            assert float(x[-1]) == pytest.approx(float(y[-1]), rel=1e-6, abs=0), (x, y)
        else:
            assert x == y


@pytest.mark.xfail(strict=True, reason="float32 shares against DFedAvgM's float64 mixing "
                   "(FLOAT32_ROUNDING); strict, so an exact fix shows")  # fmt: skip
def test_push_sum_equals_dfedavgm_on_a_ring_bit_for_bit(tmp_path, monkeypatch):
    algorithm = {"rounds": 3}
    _, ps = finals(
        monkeypatch, tmp_path / "ps", **SECTIONS, algorithm={"name": "pushsum"} | algorithm
    )
    _, dm = finals(
        monkeypatch, tmp_path / "dm", **SECTIONS, algorithm={"name": "dfedavgm"} | algorithm
    )
    assert all(torch.equal(ps[n][k], dm[n][k]) for n in ps for k in ps[n])


def test_push_sum_equals_dfedavgm_on_a_ring(tmp_path, monkeypatch):
    """A ring is regular and undirected: the push shares 1/3 equal the Metropolis weights 1/3
    and every weight stays 1, so SGP and DFedAvgM train the same models: every peer's final
    tensors to float32 rounding, and every evaluation's value as written."""
    ps, ps_models = finals(monkeypatch, tmp_path / "ps", **SECTIONS,
                           algorithm={"name": "pushsum", "rounds": 3})  # fmt: skip
    dm, dm_models = finals(monkeypatch, tmp_path / "dm", **SECTIONS,
                           algorithm={"name": "dfedavgm", "rounds": 3})  # fmt: skip
    assert ps["comm"]["messages"] == dm["comm"]["messages"] == 3 * 6 * 2
    assert_rounding_apart(ps_models, dm_models, range(6))
    # every evaluation: round, peer, metric and value as written (the time differs: a share
    # carries its weight's text, so it takes a few more bytes' time on the link)
    a, b = ([r[1:] for r in metric_rows(tmp_path / d)] for d in ("ps", "dm"))
    assert_same_evaluations(a, b)
    assert len(a) == 2 * 6 * 3 + 2  # accuracy and loss per peer and round, and of the output
    assert ps["final"] == dm["final"] and ps["per_peer"] == dm["per_peer"]
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
    runtimes = sim_runtimes(monkeypatch)
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


def test_running_sums_recover_lost_shares_with_the_same_messages(tmp_path, monkeypatch):
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
    runs, models = {}, {}
    for loss in (0.0, 0.2):
        net = {"graph": {"every": "round", "kind": "s_out", "s": 3}, "links": {"loss": loss}}
        for robust in (False, True):
            out = tmp_path / f"{loss}-{robust}"
            algo = algorithm | {"robust": robust}
            runs[loss, robust], models[loss, robust] = finals(
                monkeypatch, out, **base, algorithm=algo, network=net
            )
            runs[loss, robust]["comm.csv"] = (out / "comm.csv").read_bytes()
    for loss in (0.0, 0.2):
        assert runs[loss, True]["comm.csv"] == runs[loss, False]["comm.csv"]
    assert runs[0.2, True]["comm"]["by_fate"]["lost"]["messages"] > 20
    plain, robust = (runs[0.2, r]["final"]["accuracy"] for r in (False, True))
    assert robust > plain + 0.3, (plain, robust)
    # no loss: every accuracy row (time, round, peer, value) and the final accuracy are the
    # same; the models agree to float32 rounding (see FLOAT32_ROUNDING)
    a, b = (metric_rows(tmp_path / f"0.0-{r}") for r in (False, True))
    assert_same_evaluations(a, b)
    assert len(a) == 2 * 12 * 20 + 2
    assert runs[0.0, False]["final"]["accuracy"] == runs[0.0, True]["final"]["accuracy"]
    assert_rounding_apart(models[0.0, False], models[0.0, True], range(12))


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
