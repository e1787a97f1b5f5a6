"""``p2pfl cost``: the analytic communication cost of methods × topologies (docs/cost.md).

For each method and topology the method's analytic plan (``transfers``, :mod:`p2pfl.network.plan`)
lists every message with its real size; this module sums it into one row: messages,
bytes by kind, bytes sent and received per peer and by the server, bytes per link, total
bytes, rounds, and the communication time under the experiment's links:

    phases run one after another; in a phase every sender sends its messages back to back
    on its uplink (FIFO, 8·bytes/bandwidth each) and a message arrives its link's latency
    after its transfer ends; a phase lasts until its last message arrives. Compute is free.

A method that cannot run on a topology gets an ``n/a`` row with the reason, and so does a
topology whose messages this host could not hold while they are listed (a mesh of 10⁵
peers: 5 × 10⁹ links), decided before that graph is built.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.core.seeding import derive_seed
from p2pfl.core.yaml_io import typed_value, yaml_problem
from p2pfl.methods import METHODS
from p2pfl.methods.base import Method
from p2pfl.methods.cost_only import COST_ONLY
from p2pfl.network.message import KINDS
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import LINK_BYTES, Topology, build_topology, dense_links
from p2pfl.runtime.setup import Setup

COLUMNS = [
    "method", "topology", "status", "note", "rounds", "messages", "total_bytes",
    *(f"{k}_bytes" for k in KINDS), "peer_up_mean", "peer_up_max", "peer_down_mean",
    "peer_down_max", "server_up", "server_down", "link_max", "link_mean", "comm_time_s",
]  # fmt: skip


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets and braces (YAML flow values keep theirs)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse_methods(text: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``--methods``: ``NAME[:KEY=VALUE...]`` items separated by commas, values read as YAML
    (``fedavg,dfedavgm:rounds=1,regmean:offdiag=[0.1,0.5]``); returns (item, name, keys)."""
    out = []
    for item in filter(None, (s.strip() for s in _split(text, ","))):
        name, *pairs = _split(item, ":")
        keys = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ConfigError("--methods", f"expected NAME:KEY=VALUE, got {item!r}")
            try:
                keys[key] = typed_value(value)
            except yaml.constructor.ConstructorError as e:
                raise ConfigError("--methods", f"{pair!r}: {yaml_problem(e)}") from None
        out.append((item, name, keys))
    if not out:
        raise ConfigError("--methods", "names no method")
    return out


def make_method(name: str, keys: dict[str, Any], algorithm: dict[str, Any]) -> Method:
    """A method (runnable or cost-only) from its name and keys; the experiment's own method
    starts from the experiment's ``algorithm`` keys."""
    if name == algorithm["name"]:
        keys = {k: v for k, v in algorithm.items() if k != "name"} | keys
    if name in METHODS:
        cls = METHODS.get(name)
    elif name in COST_ONLY:
        cls = COST_ONLY.get(name)
    else:
        known = ", ".join(sorted([*METHODS.names(), *COST_ONLY.names()]))
        raise ConfigError("--methods", f"unknown method {name!r}; choose from {known}")
    if cls.transfers is Method.transfers:
        key = "algorithm.name" if name == algorithm["name"] else "--methods"
        raise ConfigError(key, f"{name} has no analytic cost plan (it defines no transfers())")
    try:
        return cls(**bind(cls, keys))
    except ConfigError as e:
        raise e.within(f"--methods {name}") from None


def topology_for(setup: Setup, kind: str) -> Topology:
    """The experiment's own topology for its kind, else ``{kind: KIND}`` with the peers'
    default links."""
    if kind == setup.topology.kind:
        return setup.topology
    seed = derive_seed(setup.seed, "topology")
    try:
        return build_topology(
            {"kind": kind}, setup.topology.num_peers, seed, setup.population.link,
            setup.population.rates,
        )  # fmt: skip
    except ConfigError as e:
        raise e.within("--topologies") from None


def make_plan(setup: Setup, topology: Topology, model_bytes: int | None) -> Plan:
    """The plan inputs of an experiment: its initial model, data sizes and compression."""
    peers = setup.data.peers
    return Plan(
        topology=topology,
        seed=setup.seed,
        state=setup.contexts()[0].init_state(),
        module=setup.trainer.module(torch.device("cpu")),
        num_train=[p.num_train for p in peers],
        num_val=[len(p.val_y) for p in peers],
        compression=setup.compression,
        model_bytes=model_bytes,
    )


def sizes_line(setup: Setup, model_bytes: int | None) -> str:
    """What the table's bytes mean: M and whether headers count."""
    if model_bytes is not None:
        return f"M = {model_bytes:,} bytes (given): tensor bytes only, headers excluded"
    plan = make_plan(setup, setup.topology, None)
    return f"M = {plan.size('model', plan.state):,} bytes: one model message, header included"


def transfers(method: Method, plan: Plan) -> list[Transfer]:
    """The method's analytic plan: every message it would send, with its size."""
    return list(method.transfers(plan))


def comm_time(plan: Iterable[Transfer], topology: Topology) -> float:
    """Seconds the plan takes on the topology's links (the phase model above)."""
    phases: dict[int, dict[int, list[Transfer]]] = defaultdict(lambda: defaultdict(list))
    for t in plan:
        phases[t.phase][t.src].append(t)
    total = 0.0
    for phase in sorted(phases):
        end = 0.0
        for src, sent in phases[phase].items():
            busy = 0.0
            for t in sent:
                link = topology.link(src, t.dst)
                busy += link.transfer_s(t.bytes)
                end = max(end, busy + link.latency_s)
        total += end
    return total


def summarize(plan: list[Transfer], topology: Topology) -> dict[str, Any]:
    """One table row's numbers (see :data:`COLUMNS`)."""
    up: dict[int, int] = defaultdict(int)
    down: dict[int, int] = defaultdict(int)
    link: dict[frozenset[int], int] = defaultdict(int)
    kinds: dict[str, int] = defaultdict(int)
    for t in plan:
        up[t.src] += t.bytes
        down[t.dst] += t.bytes
        link[frozenset((t.src, t.dst))] += t.bytes
        kinds[t.kind] += t.bytes
    peers, server = topology.peers, topology.server
    edges = [link[frozenset(e)] for e in topology.graph.edges]
    return {
        "messages": len(plan),
        "total_bytes": sum(t.bytes for t in plan),
        **{f"{k}_bytes": kinds[k] for k in KINDS},
        "peer_up_mean": sum(up[p] for p in peers) / len(peers),
        "peer_up_max": max(up[p] for p in peers),
        "peer_down_mean": sum(down[p] for p in peers) / len(peers),
        "peer_down_max": max(down[p] for p in peers),
        "server_up": up[server] if server is not None else None,
        "server_down": down[server] if server is not None else None,
        "link_max": max(edges),
        "link_mean": sum(edges) / len(edges),
        "comm_time_s": comm_time(plan, topology),
    }


PLAN_BYTES = 300
"""Memory one listed message holds while a row is made: DFedAvgM on a mesh of 3,000 peers
(27 million messages) took 7.7 GB, 0.8 of them the process."""


def too_large(peers: int, kind: str, links: int, rounds: int, free: int | None) -> str | None:
    """Why ``kind`` cannot be priced for ``peers`` peers joined by ``links`` links over
    ``rounds`` rounds, if holding the graph and listing its messages (at most about two per
    link and round) would take more than the ``free`` bytes of memory (None: unknown)."""
    need = links * (LINK_BYTES + 2 * max(rounds, 1) * PLAN_BYTES)
    if free is None or need <= free:
        return None
    return (
        f"{peers:,} peers on a {kind} have {links:,} links: the graph and up to {rounds} "
        f"round(s) of messages on each take about {need / 2**30:,.0f} GiB, "
        f"{free / 2**30:.1f} GiB are free; price fewer peers (--peers)"
    )


def analyse(
    setup: Setup,
    methods: list[tuple[str, str, dict[str, Any]]],
    kinds: list[str],
    model_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """One row per method × topology kind for the experiment ``setup``. A mesh or G(n, p)
    other than the experiment's own is counted before it is built (:func:`dense_links`):
    10⁵ peers' would not fit in memory."""
    from p2pfl.runtime.children import available_memory

    peers = setup.topology.num_peers
    counted = {
        kind: links
        for kind in kinds
        if kind != setup.topology.kind and (links := dense_links(kind, peers)) is not None
    }
    topologies = {kind: topology_for(setup, kind) for kind in kinds if kind not in counted}
    made = [
        (item, make_method(name, keys, setup.config["algorithm"]), name)
        for item, name, keys in methods
    ]
    most = max(method.total_rounds(peers) for _, method, _ in made)
    free = available_memory()
    refused: dict[str, str] = {}
    for kind in dict.fromkeys(kinds):
        links = counted[kind] if kind in counted else topologies[kind].graph.number_of_edges()
        why = too_large(peers, kind, links, most, free)
        if why is not None:
            refused[kind] = why
        elif kind not in topologies:
            topologies[kind] = topology_for(setup, kind)
    rows = []
    for item, method, name in made:
        note = "cost only (not runnable)" if name in COST_ONLY else ""
        for kind in kinds:
            row: dict[str, Any] = {"method": item, "topology": kind, "rounds": None}
            if kind in refused:
                rows.append(row | {"status": "n/a", "note": refused[kind]})
                continue
            topology = topologies[kind]
            row["topology"] = topology.kind
            try:
                method.check(topology, setup.seed)
            except ConfigError as e:
                rows.append(row | {"status": "n/a", "note": e.message})
                continue
            plan = transfers(method, make_plan(setup, topology, model_bytes))
            row |= {"status": "ok", "note": note, "rounds": method.total_rounds(topology.num_peers)}
            rows.append(row | summarize(plan, topology))
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def human(n: float | None) -> str:
    """Bytes in decimal units (1 MB = 10⁶ bytes, as the papers count)."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (total bytes exact, the rest in decimal units)."""
    head = [
        "method", "topology", "rounds", "messages", "total bytes", "peer up mean/max",
        "peer down mean/max", "server up/down", "link max/mean", "comm time", "note",
    ]  # fmt: skip
    lines = [head]
    for r in rows:
        if r["status"] != "ok":
            lines.append([r["method"], r["topology"], *["-"] * 8, f"n/a: {r['note']}"])
            continue
        lines.append([
            r["method"], r["topology"], str(r["rounds"]), str(r["messages"]),
            f"{r['total_bytes']:,}",
            f"{human(r['peer_up_mean'])} / {human(r['peer_up_max'])}",
            f"{human(r['peer_down_mean'])} / {human(r['peer_down_max'])}",
            f"{human(r['server_up'])} / {human(r['server_down'])}",
            f"{human(r['link_max'])} / {human(r['link_mean'])}",
            f"{r['comm_time_s']:.4g} s", r["note"],
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
