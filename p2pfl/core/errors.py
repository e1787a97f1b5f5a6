"""Errors that reach the user as one line: ``error: FILE: key.path: what is wrong``."""

from __future__ import annotations


class ConfigError(Exception):
    """A bad configuration value, named by its dotted key path.

    Components raise it with the key relative to their own section (``"alpha"``); the
    config layer adds the section prefix (``"partition.alpha"``) and the file name.
    """

    def __init__(self, key: str, message: str, file: str | None = None) -> None:
        super().__init__(message)
        self.key = str(key)  # a YAML key may be a number
        self.message = message
        self.file = file

    def within(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` in front of its key."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        return type(self)(key, self.message, self.file)

    def __str__(self) -> str:
        parts = [p for p in (self.file, self.key) if p]
        return " ".join(": ".join([*parts, self.message]).splitlines())  # always one line


class TopologyMisfit(ConfigError):
    """A method that cannot run on the topology it was given (``Method.check``): a bad
    config for one run; in a sweep, the one kind of cell that is skipped, with this reason."""


class RunError(Exception):
    """A run that started and then failed (a dead peer, a timeout, a diverged model)."""


class RankFailed(RunError):
    """Another rank of a spread run failed (it died, or its run raised), which ended this
    one: its message, already whole, is the run's error, not wrapped again."""
