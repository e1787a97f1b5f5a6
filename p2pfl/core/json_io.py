"""Writing JSON that every reader can take: strict (no NaN or infinity) and atomic."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def strict(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def write_json(path: Path, value: Any) -> None:
    """Write strict JSON atomically (a reader never sees half a file, nor does a process
    killed while writing leave one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(strict(value), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
