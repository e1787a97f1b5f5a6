"""Stragglers in a round of a server method: systems heterogeneity as FedProx models it.

Li et al. (MLSys 2020, §5.2) simulate devices that cannot finish the round's work: in each
round a fraction of the selected devices are stragglers that do only x local epochs, x drawn
uniformly between 1 and E. FedAvg drops them (the round averages the others); FedProx takes
their partial work. :class:`Stragglers` is FedAvg's (so FedProx's) ``stragglers:`` key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.core.seeding import numpy_rng
from p2pfl.methods.effects import State, Train


@dataclass(frozen=True)
class Stragglers:
    """Which of a round's peers straggle, and how little they do.

    Args:
        fraction: the share of each round's sampled peers that straggle, in [0, 1]
            (rounded half up; seeded per round).
        epochs: a straggler's local epochs instead of ``train.epochs``: a number, or
            ``[low, high]``, drawn uniformly (both included) per straggler and round
            (FedProx §5.2: between 1 and E).
        drop: the server neither sends to nor waits for the stragglers: the round averages
            the others only (FedAvg's handling in FedProx §5.2); false: the stragglers'
            partial work is averaged too (FedProx's).
    """

    fraction: float
    epochs: int | tuple[int, int] = 1
    drop: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ConfigError("fraction", f"must be in [0, 1], got {self.fraction}")
        low, high = self.bounds
        if not 1 <= low <= high:
            raise ConfigError(
                "epochs", f"must be >= 1, or [low, high] with 1 <= low <= high; got {self.epochs}"
            )

    @property
    def bounds(self) -> tuple[int, int]:
        """The smallest and largest straggler epochs."""
        if isinstance(self.epochs, int):
            return self.epochs, self.epochs
        low, high = self.epochs
        return low, high

    def pick(self, chosen: list[int], seed: int, round: int) -> dict[int, int]:
        """The stragglers among ``chosen`` (a round's sampled peers) and each one's epochs:
        ``fraction`` of them rounded half up, drawn from the round's own stream."""
        count = int(self.fraction * len(chosen) + 0.5)
        if not count:
            return {}
        rng = numpy_rng(seed, "stragglers", round)
        slow = sorted(int(p) for p in rng.choice(chosen, count, replace=False))
        low, high = self.bounds
        return {p: int(rng.integers(low, high + 1)) for p in slow}


def parse_stragglers(options: dict | None) -> Stragglers | None:
    """The ``stragglers:`` mapping checked (errors name its keys), or None without one."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ConfigError(
            "stragglers", f"must be a mapping {{fraction, epochs, drop}}, got {options!r}"
        )
    try:
        return Stragglers(**bind(Stragglers, options))
    except ConfigError as e:
        raise e.within("stragglers") from None


def fewer_epochs(
    local_train: Callable[[State, int], Train], epochs: int
) -> Callable[[State, int], Train]:
    """``local_train`` with ``epochs`` local epochs instead of ``train.epochs`` (a straggler's
    round; its other keys, FedProx's proximal term included, unchanged)."""

    def train(state: State, round: int) -> Train:
        step = local_train(state, round)
        return replace(step, overrides={**step.overrides, "epochs": epochs})

    return train
