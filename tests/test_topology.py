"""Topologies (shapes, seeding, link attributes, validation) and peer profiles."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from conftest import ROOT
from p2pfl.core.errors import ConfigError
from p2pfl.core.yaml_io import read_yaml
from p2pfl.network.peers import build_population
from p2pfl.network.topology import DEFAULT_LINK, Link, build_topology, s_out


def test_ring_mesh_star_shapes():
    ring = build_topology({"kind": "ring"}, 6, 0)
    assert all(ring.graph.degree[i] == 2 for i in range(6)) and ring.graph.has_edge(5, 0)
    mesh = build_topology({"kind": "mesh"}, 5, 0)
    assert mesh.graph.number_of_edges() == 10
    star = build_topology({"kind": "star"}, 4, 0)
    assert star.server == 4 and star.neighbours(4) == [0, 1, 2, 3]
    assert all(star.neighbours(i) == [4] for i in range(4)) and star.name(4) == "server"
    assert ring.server is None and mesh.server is None


@pytest.mark.parametrize("options", [{"kind": "erdos_renyi", "p": 0.2}, {"kind": "watts_strogatz"}])
def test_random_graphs_are_seeded_and_connected(options):
    a, b = (build_topology(options, 20, 7).graph for _ in range(2))
    c = build_topology(options, 20, 8).graph
    assert nx.is_connected(a) and sorted(a.edges) == sorted(b.edges)
    assert sorted(a.edges) != sorted(c.edges)


def test_sparse_erdos_renyi_that_never_connects_is_an_error():
    with pytest.raises(ConfigError, match="no connected graph") as e:
        build_topology({"kind": "erdos_renyi", "p": 0.01}, 30, 0)
    assert e.value.key == "p"


def test_link_attributes_defaults_and_overrides():
    profile = Link(latency_s=0.2, bandwidth_bps=1e6)
    topo = build_topology(
        {"kind": "star", "links": [{"between": ["server", 1], "bandwidth_bps": 5e5}]}, 3, 0, profile
    )
    assert topo.link(0, 3) == profile
    assert topo.link(3, 1) == Link(latency_s=0.2, bandwidth_bps=5e5)
    topo = build_topology({"kind": "ring", "link": {"latency_s": 0}}, 3, 0)
    assert topo.link(0, 1) == Link(0.0, DEFAULT_LINK.bandwidth_bps)
    assert Link(0.0, 8e6).transfer_s(1_000_000) == 1.0


@pytest.mark.parametrize(
    "options,key",
    [
        ({"kind": "ring", "link": {"bandwidth_bps": 0}}, "link.bandwidth_bps"),
        ({"kind": "ring", "link": {"latency_s": -1}}, "link.latency_s"),
        ({"kind": "ring", "links": [{"between": [0, 2]}]}, "links.0.between"),
        ({"kind": "edges", "edges": [[0, 1], [2, 3]]}, "kind"),
        ({"kind": "edges", "edges": [[0, 9]]}, "edges"),
        ({}, "kind"),
    ],
)
def test_bad_topologies(options, key):
    with pytest.raises(ConfigError) as e:
        build_topology(options, 4, 0)
    assert e.value.key == key


def test_every_shipped_topology_and_profile_builds():
    for path in sorted((ROOT / "topologies").glob("*.yaml")):
        topo = build_topology(read_yaml(path), 10, 0)
        assert nx.is_connected(topo.graph)
    for path in sorted((ROOT / "peers").glob("*.yaml")):
        assert len(build_population(0, **read_yaml(path) | {"count": 10}).profiles) == 10


def test_peer_speed_spread_is_seeded_and_slow_fraction_exact():
    options = {"count": 50, "speed_sigma": 0.5, "slow_fraction": 0.2, "slow_factor": 0.01}
    a, b, c = (build_population(seed, **options) for seed in (1, 1, 2))
    speeds = [p.speed for p in a.profiles]
    assert speeds == [p.speed for p in b.profiles] != [p.speed for p in c.profiles]
    assert sum(s < 0.05 for s in speeds) == 10
    uniform = build_population(0, count=3)
    assert [p.speed for p in uniform.profiles] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("n,s", [(5, 4), (40, 3), (10_002, 3)])  # 10⁴+: numpy draws otherwise
def test_s_out_draws_numpys_choice_among_the_other_peers(n, s):
    """Each peer, in turn, sends to numpy's choice of ``s`` among the other peers (one
    generator for the graph): the graph the list of the others gives, without the list."""
    rng = np.random.default_rng(7)
    others = np.arange(n)
    want = [
        (i, int(j)) for i in range(n) for j in rng.choice(np.delete(others, i), s, replace=False)
    ]
    assert list(s_out(n, 7, s=s).edges) == want
