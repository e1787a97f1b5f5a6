"""The ``p2pfl`` command line: ``run`` an experiment (``cost`` and ``plot`` come with their issues).

Exit codes: 0 success; 2 bad config or arguments (one line ``error: FILE: key: reason``);
1 a run that started and failed (its outputs so far stay on disk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from p2pfl.errors import ConfigError, RunError


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one ``error:`` line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="p2pfl", description="Peer-to-peer federated-learning simulator.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run an experiment file")
    r.add_argument("experiment", help="experiment YAML file")
    r.add_argument("--out", help="output directory (default runs/NAME-seedN)")
    r.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override any key, e.g. --set partition.alpha=0.1 (repeatable)",
    )
    r.add_argument("--seed", type=int, help="override the experiment's seed")
    r.add_argument("--transport", choices=["sim"], default="sim", help="how peers talk")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def cmd_run(args: argparse.Namespace) -> int:
    from p2pfl.config import load_experiment
    from p2pfl.experiment import build, run

    config = load_experiment(args.experiment, args.sets, args.seed)
    try:
        setup = build(config)
    except ConfigError as e:
        e.file = e.file or args.experiment
        raise
    out = Path(args.out or f"runs/{config['name']}-seed{config['seed']}")
    summary = run(setup, out, progress=not args.quiet)
    comm = summary["comm"]
    print(
        f"{config['name']}: {summary['algorithm']} on {summary['num_peers']} peers "
        f"({summary['topology']}), final accuracy {summary['final']['accuracy']:.4f}, "
        f"{comm['total_bytes']:,} bytes in {comm['messages']} messages, "
        f"simulated {summary['sim_time_s']:.2f} s, wall {summary['wall_time_s']:.1f} s -> {out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already reported in one line
        return int(e.code or 0)
    try:
        return {"run": cmd_run}[args.command](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
