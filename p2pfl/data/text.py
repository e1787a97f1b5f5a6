"""Shakespeare by speaking role: LEAF's next-character task on a text shipped with p2pfl.

LEAF (Caldas et al., 2018, "LEAF: A Benchmark for Federated Settings", §3 and its
``shakespeare`` preprocessing) makes every speaking role of Shakespeare's plays one user:
a role's lines, joined, are cut into windows of 80 characters, each labelled with the
character that follows it, and a model predicts that character. Here the text is
``tinyshakespeare.txt.xz`` beside this module: karpathy/char-rnn's
``data/tinyshakespeare/input.txt`` (1,115,394 bytes, 40,000 lines; sha256 86c4e6aa...c565ed),
from https://github.com/karpathy/char-rnn/blob/master/data/tinyshakespeare/input.txt, a
selection of Shakespeare's plays, which are in the public domain (the char-rnn repository is
MIT-licensed), compressed with xz. Each speech is a speaker heading on its own line
("First Citizen:") followed by the speech's lines and a blank line.

Built as LEAF builds it:

- a role's text is its lines in order, joined by single spaces (LEAF turns newlines into
  spaces and collapses runs of spaces);
- samples are windows of ``seq_len`` (80) characters, the label the next character;
- characters are coded in LEAF's 80-character vocabulary (:data:`VOCABULARY`), so models
  have LEAF's 80 outputs;
- each role's train and test samples are split by position, as LEAF's sample split does
  for Shakespeare: the first ``1 - test_fraction`` of the role's text gives the train
  windows, the rest the test windows, and no window crosses the cut (no character is in
  both). The global test set is every role's test windows; ``natural`` partitions keep
  the test windows of the roles they use.

Where it differs, and why:

- tinyshakespeare has no play titles, so a role is a speaker name over the whole text
  (LEAF's users are (play, character) pairs: "GLOUCESTER" of two plays is one role here);
- windows start every ``stride`` characters (LEAF: every character). At stride 1 the
  1.1 MB text gives about a million 80-token windows, 640 MB as int64; the default 8
  keeps 80 MB and consecutive windows still overlap by 72 characters;
- one character of the text is outside LEAF's vocabulary (a ``$``); it becomes a space
  (LEAF's lookup would give it index -1).
"""

from __future__ import annotations

import functools
import lzma
import re
from pathlib import Path

import numpy as np
import torch

from p2pfl.core.errors import ConfigError
from p2pfl.data.datasets import DATASETS, Dataset

TEXT = Path(__file__).with_name("tinyshakespeare.txt.xz")
"""The shipped text: karpathy/char-rnn's tinyshakespeare ``input.txt``, xz-compressed."""

SOURCE_URL = "https://github.com/karpathy/char-rnn/blob/master/data/tinyshakespeare/input.txt"

VOCABULARY = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's 80 characters (its ``language_utils.ALL_LETTERS``); a token is an index into it."""

_SPACE = VOCABULARY.index(" ")


def parse_roles(text: str) -> dict[str, list[str]]:
    """Every speaking role's lines, in the order the roles first speak.

    A heading is a line ending in ``:`` at the start of the text or after a blank line; the
    lines after it, up to the next blank line, are the role's (a heading with no lines
    adds none). Text before the first heading belongs to no role.
    """
    roles: dict[str, list[str]] = {}
    speaker: str | None = None
    after_blank = True
    for line in text.split("\n"):
        stripped = line.strip()
        if not stripped:
            speaker, after_blank = None, True
            continue
        if after_blank and stripped.endswith(":"):
            speaker = stripped[:-1].strip()
            roles.setdefault(speaker, [])
        elif speaker is not None:
            roles[speaker].append(stripped)
        after_blank = False
    return roles


@functools.cache
def shipped_roles() -> dict[str, list[str]]:
    """:func:`parse_roles` of the shipped text (read once per process)."""
    return parse_roles(lzma.decompress(TEXT.read_bytes()).decode("utf-8"))


def encode(text: str) -> np.ndarray:
    """``text`` as int64 indices into :data:`VOCABULARY` (others become a space)."""
    table = np.full(256, _SPACE, dtype=np.int64)
    for i, ch in enumerate(VOCABULARY):
        table[ord(ch)] = i
    codes = np.frombuffer(text.encode("ascii", "replace"), dtype=np.uint8)
    return table[codes]


def role_text(lines: list[str]) -> str:
    """A role's lines as LEAF joins them: separated by single spaces, runs of spaces as one."""
    return re.sub(" {2,}", " ", " ".join(lines))


def _windows(codes: np.ndarray, seq_len: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of ``seq_len`` tokens every ``stride`` and each one's next token."""
    starts = np.arange(0, len(codes) - seq_len, stride)
    if not len(starts):
        return np.zeros((0, seq_len), np.int64), np.zeros(0, np.int64)
    x = np.lib.stride_tricks.sliding_window_view(codes, seq_len)[starts]
    return np.ascontiguousarray(x), codes[starts + seq_len]


@DATASETS.register("shakespeare")
def shakespeare(
    *,
    min_lines: int = 10,
    seq_len: int = 80,
    stride: int = 8,
    test_fraction: float = 0.2,
) -> Dataset:
    """Shakespeare by speaking role (LEAF's Shakespeare on tinyshakespeare, shipped): each
    sample is ``seq_len`` character tokens (int64), its label the next character (80
    classes, LEAF's vocabulary); each role is a natural group (``partition: {name:
    natural}`` makes each one a peer). Roles that give no train or no test window are left
    out (too short for one window on each side of the cut).

    Args:
        min_lines: leave out roles with fewer lines of speech than this (LEAF drops users
            with too few samples); 0 keeps every role that yields windows.
        seq_len: characters in a sample (LEAF: 80).
        stride: characters between the starts of consecutive windows (LEAF: 1; 8 keeps
            the whole text at 80 MB).
        test_fraction: each role's last this fraction of its text is its test split
            (LEAF: 0.2), with no character shared with its train windows.
    """
    if min_lines < 0:
        raise ConfigError("min_lines", f"must be >= 0, got {min_lines}")
    if seq_len < 1:
        raise ConfigError("seq_len", f"must be >= 1, got {seq_len}")
    if stride < 1:
        raise ConfigError("stride", f"must be >= 1, got {stride}")
    if not 0 < test_fraction < 1:
        raise ConfigError("test_fraction", f"must be in (0, 1), got {test_fraction}")
    parts: list[tuple[str, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]] = []
    for name, lines in shipped_roles().items():
        if len(lines) < min_lines:
            continue
        codes = encode(role_text(lines))
        cut = round((1 - test_fraction) * len(codes))
        train, test = _windows(codes[:cut], seq_len, stride), _windows(codes[cut:], seq_len, stride)
        if len(train[1]) and len(test[1]):
            parts.append((name, train, test))
    if not parts:
        raise ConfigError(
            "min_lines",
            f"no role has {min_lines} lines and text for a train and a test window of "
            f"{seq_len} characters; lower min_lines or seq_len",
        )

    def joined(side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs = [p[1 + side][0] for p in parts]
        ys = [p[1 + side][1] for p in parts]
        groups = np.repeat(np.arange(len(parts)), [len(y) for y in ys])
        return (
            torch.from_numpy(np.concatenate(xs)),
            torch.from_numpy(np.concatenate(ys)),
            torch.from_numpy(groups),
        )

    train_x, train_y, train_groups = joined(0)
    test_x, test_y, test_groups = joined(1)
    return Dataset(
        "shakespeare",
        train_x,
        train_y,
        test_x,
        test_y,
        num_classes=len(VOCABULARY),
        train_groups=train_groups,
        test_groups=test_groups,
        group_names=tuple(p[0] for p in parts),
    )
