"""Who talks to whom: network graphs with per-link latency and bandwidth.

Peers are nodes ``0..N-1``. A star adds one data-less centre, the server, as node ``N``.
Every edge carries a :class:`Link`; an edge attribute set in the topology file wins over
the peer profile's link defaults, which win over :data:`DEFAULT_LINK`. With per-peer
bandwidths (``peers.up_bps`` / ``down_bps``) a message from i to j moves at
min(up_i, down_j) instead (:meth:`Topology.rated`), except on an edge whose bandwidth a
``links:`` entry sets.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import networkx as nx
import numpy as np

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry, bind, bind_with_common


@dataclass(frozen=True)
class Link:
    """A link's propagation delay (seconds) and its capacity (bits per second)."""

    latency_s: float = 0.01
    bandwidth_bps: float = 1e8

    def transfer_s(self, nbytes: int) -> float:
        """Seconds a message of ``nbytes`` occupies the sender's uplink."""
        return 8.0 * nbytes / self.bandwidth_bps


DEFAULT_LINK = Link()


def make_link(options: dict[str, Any], base: Link = DEFAULT_LINK) -> Link:
    """A link from a ``{latency_s, bandwidth_bps}`` mapping, missing keys from ``base``."""
    kwargs = bind(
        Link, {"latency_s": base.latency_s, "bandwidth_bps": base.bandwidth_bps} | options
    )
    if kwargs["latency_s"] < 0:
        raise ConfigError("latency_s", "must be >= 0")
    if kwargs["bandwidth_bps"] <= 0:
        raise ConfigError("bandwidth_bps", "must be > 0")
    return Link(**kwargs)


@dataclass
class Topology:
    """A connected graph of peers (and a server for a star) with a link on every edge."""

    kind: str
    graph: nx.Graph
    num_peers: int
    server: int | None = None
    default_link: Link = DEFAULT_LINK  # for edges a changing graph adds (p2pfl.network.dynamics)
    up_bps: tuple[float, ...] = ()  # each peer's uplink (peers.up_bps); empty: not set
    down_bps: tuple[float, ...] = ()  # each peer's downlink (peers.down_bps); empty: not set
    pinned: frozenset[frozenset[int]] = frozenset()  # edges whose bandwidth a links: entry sets

    @functools.cached_property
    def peers(self) -> list[int]:
        """The peers' ids, 0..N−1: one list made once (a method asks for it on every
        message; rebuilding it made a period of gossip O(N²)). Read it, never change it."""
        return list(range(self.num_peers))

    @property
    def hub(self) -> int:
        """The server, for a method that runs on a star only (its ``check`` made sure)."""
        if self.server is None:
            raise ValueError(f"a {self.kind} topology has no server")
        return self.server

    def neighbours(self, node: int) -> list[int]:
        return sorted(self.graph.neighbors(node))

    def link(self, src: int, dst: int) -> Link:
        if not self.graph.has_edge(src, dst):
            raise KeyError(f"no link between {self.name(src)} and {self.name(dst)}")
        link: Link = self.graph.edges[src, dst]["link"]
        if (self.up_bps or self.down_bps) and frozenset((src, dst)) not in self.pinned:
            return self.rated(src, dst, link)
        return link

    def rated(self, src: int, dst: int, link: Link) -> Link:
        """``link`` at min(uplink of ``src``, downlink of ``dst``): the per-peer bandwidths.
        A side without one (the server, or a direction not set) does not limit; with neither,
        ``link`` as it is. Downlink contention (several senders into one peer) is not
        modelled: each message gets the receiver's whole downlink."""
        up = self.up_bps[src] if src < len(self.up_bps) else math.inf
        down = self.down_bps[dst] if dst < len(self.down_bps) else math.inf
        rate = min(up, down)
        return link if rate == math.inf else Link(link.latency_s, rate)

    def name(self, node: int) -> str:
        return "server" if node == self.server else str(node)


GraphFn = Callable[..., nx.Graph]
"""``fn(num_peers, seed, *, <keys>) -> nx.Graph`` over peers 0..N-1; its keys are YAML keys."""
GRAPHS: Registry[GraphFn] = Registry("topology kind")


@GRAPHS.register("ring")
def ring(n: int, seed: int) -> nx.Graph:
    """Peer i is linked to i-1 and i+1 (mod N)."""
    return nx.cycle_graph(n) if n > 2 else nx.path_graph(n)


@GRAPHS.register("mesh")
def mesh(n: int, seed: int) -> nx.Graph:
    """Every pair of peers is linked (complete graph)."""
    return nx.complete_graph(n)


@GRAPHS.register("star")
def star(n: int, seed: int) -> nx.Graph:
    """Every peer is linked to one data-less centre, the server (node N)."""
    g = nx.Graph()
    g.add_nodes_from(range(n + 1))
    g.add_edges_from((n, i) for i in range(n))
    return g


def _connected(make, n: int, seed: int, what: str) -> nx.Graph:
    """Draw seeded graphs until one is connected (at most 100 tries, then a clear error)."""
    for attempt in range(100):
        g = make(seed + attempt)
        if nx.is_connected(g):
            return g
    raise ConfigError(what, f"100 seeded draws gave no connected graph on {n} peers; raise it")


ER_P = 0.3
"""``erdos_renyi``'s ``p`` where none is given."""

LINK_BYTES = 300
"""Memory one link of a built topology holds (networkx, with the link on the edge: a mesh of
3,000 peers took 292 bytes a link, G(4,000, 0.3) 261)."""


@GRAPHS.register("erdos_renyi")
def erdos_renyi(n: int, seed: int, *, p: float = ER_P) -> nx.Graph:
    """G(n, p): each pair linked with probability p (redrawn until connected).

    Args:
        p: the probability that a pair of peers is linked.
    """
    if not 0 < p <= 1:
        raise ConfigError("p", "must be in (0, 1]")
    return _connected(lambda s: nx.erdos_renyi_graph(n, p, seed=s), n, seed, "p")


@GRAPHS.register("watts_strogatz")
def watts_strogatz(n: int, seed: int, *, k: int = 4, p: float = 0.1) -> nx.Graph:
    """Small world: a ring lattice with k neighbours, each edge rewired with probability p.

    Args:
        k: each peer's neighbours in the ring lattice before rewiring.
        p: the probability that an edge is rewired.
    """
    if not 2 <= k < n:
        raise ConfigError("k", f"must be in [2, {n - 1}] for {n} peers")
    if not 0 <= p <= 1:
        raise ConfigError("p", "must be in [0, 1]")
    return _connected(lambda s: nx.watts_strogatz_graph(n, k, p, seed=s), n, seed, "p")


@GRAPHS.register("random_regular")
def random_regular(n: int, seed: int, *, d: int = 3) -> nx.Graph:
    """Every peer has exactly d neighbours, drawn at random (redrawn until connected).

    Args:
        d: every peer's number of neighbours.
    """
    if not 1 <= d < n or (n * d) % 2:
        raise ConfigError("d", f"must be in [1, {n - 1}] with N·d even ({n} peers)")
    return _connected(lambda s: nx.random_regular_graph(d, n, seed=s), n, seed, "d")


@GRAPHS.register("s_out")
def s_out(n: int, seed: int, *, s: int = 3) -> nx.DiGraph:
    """Directed: each peer sends to s peers drawn at random (Epidemic Learning's EL-Local,
    de Vos et al. 2023, §3); for graphs redrawn during a run (``network.graph``).

    Args:
        s: how many random peers each peer sends to.
    """
    if not 1 <= s < n:
        raise ConfigError("s", f"must be in [1, {n - 1}] for {n} peers")
    rng = np.random.default_rng(seed)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for i in range(n):
        # s of the n - 1 others: index j of the others is peer j, or j + 1 from i on (the
        # draw of a list of them, without its O(n) copy per peer: 5 s a graph at 10⁴ peers)
        drawn = rng.choice(n - 1, s, replace=False)
        g.add_edges_from((i, int(j)) for j in drawn + (drawn >= i))
    return g


@GRAPHS.register("edges")
def edges(n: int, seed: int, *, edges: list[list[int]]) -> nx.Graph:
    """An explicit edge list ``[[0, 1], [1, 2], ...]`` over peers 0..N-1.

    Args:
        edges: the edge list, pairs of peer indices.
    """
    g = nx.Graph()
    g.add_nodes_from(range(n))
    for e in edges:
        if len(e) != 2 or not all(0 <= v < n for v in e) or e[0] == e[1]:
            raise ConfigError("edges", f"edge {e} must join two different peers in 0..{n - 1}")
        g.add_edge(*e)
    return g


GRAPH_FORMATS = {
    "edgelist": nx.read_edgelist,
    "graphml": nx.read_graphml,
    "gml": nx.read_gml,
}


@GRAPHS.register("graph_file")
def graph_file(
    n: int, seed: int, *, path: str, format: Literal["auto", "edgelist", "graphml", "gml"] = "auto"
) -> nx.Graph:
    """A graph read from a standard file with networkx' readers (edge list, GraphML, GML; by
    the file's suffix with ``auto``), e.g. a measured P2P overlay. It must have exactly N
    nodes; they become peers 0..N-1 in the order of their labels (numbers numerically).
    Directions, parallel edges and self-loops are dropped.

    Args:
        path: the graph file, found like ``topology.file``.
        format: ``edgelist``, ``graphml`` or ``gml``; ``auto`` tells it by the file's suffix.
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    fmt = (
        format if format != "auto" else {"txt": "edgelist", "edges": "edgelist"}.get(suffix, suffix)
    )
    if fmt not in GRAPH_FORMATS:
        raise ConfigError(
            "format", f"cannot tell the format of {path!r}; set edgelist, graphml or gml"
        )
    try:
        read = nx.Graph(GRAPH_FORMATS[fmt](path))
    except FileNotFoundError:
        raise ConfigError("path", f"no such graph file {path!r}") from None
    except Exception as e:  # the readers raise many kinds of error on a malformed file
        raise ConfigError("path", f"cannot read {path} as {fmt}: {e}") from None
    read.remove_edges_from(nx.selfloop_edges(read))
    if read.number_of_nodes() != n:
        raise ConfigError("path", f"{path} has {read.number_of_nodes()} nodes, for {n} peers")
    labels = sorted(
        read.nodes, key=lambda v: (0, int(v), "") if str(v).isdigit() else (1, 0, str(v))
    )
    return nx.relabel_nodes(read, {v: i for i, v in enumerate(labels)})


def _shared_keys(
    *, link: dict[str, Any] | None = None, links: list[dict[str, Any]] | None = None
) -> None:
    """The keys every topology kind takes besides its graph's own (see :func:`build_topology`).

    Args:
        file: a topology file (``topologies/*.yaml``) whose keys this section's inline keys
            override; found from the current directory, then next to the experiment file, then one
            directory above.
        link: ``{latency_s, bandwidth_bps}`` for every edge (null: the peer profile's ``link``).
        links: per-edge overrides, ``[{between: [0, server], bandwidth_bps: 1e6}]``.
    """


def parse_topology(
    options: dict[str, Any], link_defaults: Link = DEFAULT_LINK
) -> tuple[GraphFn, dict[str, Any], Link, list[tuple[list[Any], dict[str, Any]]]]:
    """Check a ``topology:`` mapping as far as it can be without the peer count: its kind,
    every key's name and type, the links. Returns the graph builder, its keys, the default
    link, and each per-edge override as (its two ends, its link keys)."""
    opts = dict(options)
    kind = opts.pop("kind", None)
    if kind is None:
        raise ConfigError("kind", f"missing; choose one of: {', '.join(GRAPHS.names())}")
    try:
        make = GRAPHS.get(kind)
    except ConfigError as e:
        raise ConfigError("kind", e.message) from None
    own, shared = bind_with_common(make, _shared_keys, opts, skip=2, also=("kind", "file"))
    try:
        base = make_link(shared["link"] or {}, link_defaults)
    except ConfigError as e:
        raise e.within("link") from None
    overrides = [_override(ov, f"links.{i}") for i, ov in enumerate(shared["links"] or [])]
    return make, own, base, overrides


def _override(override: Any, key: str) -> tuple[list[Any], dict[str, Any]]:
    """One ``links`` entry as (its two ends, its link keys), both checked."""
    if not isinstance(override, dict) or "between" not in override:
        raise ConfigError(key, "must be a mapping with 'between: [u, v]' and link keys")
    ov = dict(override)
    ends = ov.pop("between")
    if not isinstance(ends, list) or len(ends) != 2:
        raise ConfigError(f"{key}.between", f"must be two nodes [u, v], got {ends!r}")
    try:
        make_link(ov)
    except ConfigError as e:
        raise e.within(key) from None
    return ends, ov


def build_graph(options: dict[str, Any], num_peers: int, seed: int) -> nx.Graph:
    """The graph named by ``options['kind']`` (with its keys; link keys are ignored)."""
    make, own, _, _ = parse_topology(options)
    return make(num_peers, seed, **own)


def dense_links(kind: str, n: int, p: float = ER_P) -> int | None:
    """The links of a graph of ``n`` peers whose links grow as N², known before it is drawn:
    a mesh's, or G(n, p)'s on average; ``None`` for the other kinds (N times a degree)."""
    pairs = n * (n - 1) // 2
    if kind == "mesh":
        return pairs
    if kind == "erdos_renyi":
        return round(p * pairs)
    return None


def _check_size(kind: str, own: dict[str, Any], n: int, free: int | None) -> None:
    """Refuse a graph whose links grow as N² and would not fit in ``free`` bytes, before
    networkx draws it: a mesh of 10⁵ peers has 5·10⁹ links."""
    links = dense_links(kind, n, own.get("p", ER_P))
    if free is None or links is None or links * LINK_BYTES <= free:
        return
    article, about = ("a", "") if kind == "mesh" else ("an", "about ")
    raise ConfigError(
        "kind",
        f"{n:,} peers on {article} {kind} have {about}{links:,} links, "
        f"{links * LINK_BYTES / 2**30:,.1f} GiB as a graph; {free / 2**30:.1f} GiB are free: "
        "use a sparse graph (ring, random_regular, watts_strogatz) or fewer peers",
    )


def build_topology(
    options: dict[str, Any],
    num_peers: int,
    seed: int,
    link_defaults: Link = DEFAULT_LINK,
    rates: tuple[Sequence[float], Sequence[float]] = ((), ()),
    free: int | None = None,
) -> Topology:
    """Build the graph named by ``options['kind']`` with links on every edge.

    Keys: ``kind`` (ring | mesh | star | erdos_renyi | watts_strogatz | random_regular |
    edges | graph_file) and its own keys, ``link`` (defaults for every edge) and ``links`` (per-edge
    overrides, each ``{between: [u, v], latency_s, bandwidth_bps}``; the server of a star is
    ``"server"``). ``rates``: each peer's uplink and downlink (``Population.rates``), empty
    where not set. ``free``: the bytes of memory the graph may take (``None``: unknown); a
    mesh or G(n, p) that would take more is refused before it is drawn.
    """
    make, own, base, overrides = parse_topology(options, link_defaults)
    kind = options["kind"]
    least = 1 if kind == "star" else 2  # one peer and its server: centralized training
    if num_peers < least:
        raise ConfigError("kind", f"a {kind} needs at least {least} peers, got {num_peers}")
    _check_size(kind, own, num_peers, free)
    graph = make(num_peers, seed, **own)
    if graph.is_directed():
        raise ConfigError("kind", f"{kind} is directed: use it in network.graph")
    if not nx.is_connected(graph):
        raise ConfigError("kind", "the graph is not connected")
    nx.set_edge_attributes(graph, base, "link")
    server = num_peers if kind == "star" else None
    topo = Topology(
        kind=kind, graph=graph, num_peers=num_peers, server=server, default_link=base,
        up_bps=tuple(rates[0]), down_bps=tuple(rates[1]),
    )  # fmt: skip
    pinned: set[frozenset[int]] = set()
    for i, (ends, link) in enumerate(overrides):
        key = f"links.{i}"
        nodes = [topo.server if v == "server" else v for v in ends]
        if not all(isinstance(v, int) and v in graph for v in nodes) or not graph.has_edge(*nodes):
            raise ConfigError(f"{key}.between", f"{ends} is not an edge of the graph")
        try:
            topo.graph.edges[nodes]["link"] = make_link(link, topo.graph.edges[nodes]["link"])
        except ConfigError as e:
            raise e.within(key) from None
        if "bandwidth_bps" in link:
            pinned.add(frozenset(int(v) for v in nodes if v is not None))
    topo.pinned = frozenset(pinned)
    return topo
