"""The package's shape: imports only go down the layers, and no module imports itself back.

The layers are declared once, in ``pyproject.toml`` (``[tool.importlinter]``); this test runs
that contract and looks for import cycles between any two modules, so a cycle added back
fails the suite, not only ``make lint``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_is_kept() -> None:
    # import-linter's command, through this interpreter: a host whose packages are on its
    # PYTHONPATH has no lint-imports script beside it
    lint = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    proc = subprocess.run(
        [sys.executable, "-c", lint], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "0 broken" in proc.stdout


def import_cycles(package: str = "p2pfl") -> list[list[str]]:
    """Every set of modules that import each other, directly or through others (a package's
    ``__init__`` counts as a module)."""
    graph = grimp.build_graph(package, cache_dir=None)
    g = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            g.add_edge(module, imported)
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_import_cycles() -> None:
    assert import_cycles() == []


OPTIONAL = {"flwr"}  # benchmarks/flower_job.py races Flower where it is installed


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_every_benchmark_imports(path: Path) -> None:
    """A module moved in p2pfl must not silently break a benchmark (it happened twice)."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(path.parent))
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)  # as import does
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        if e.name not in OPTIONAL:
            raise
    finally:
        sys.path.remove(str(path.parent))
        del sys.modules[spec.name]


def test_a_run_imports_no_heavy_library_it_does_not_use() -> None:
    """What every ``p2pfl run`` imports (the app layer, the commands) and loading digits
    leave out scipy, scikit-learn and matplotlib: 0.5 s, 2 s and 0.8 s of each command's
    start-up, imported only where used (a loader, PANs' matching, a figure;
    docs/performance.md, start-up)."""
    code = "import sys, p2pfl.app.cli, p2pfl.app.experiment, p2pfl.app.sweep; "
    code += "from p2pfl.data import load_dataset; load_dataset({'name': 'digits'}, 0); "
    code += (
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'sklearn', 'matplotlib'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_a_convolutional_run_imports_neither_torchs_compiler_nor_sympy() -> None:
    """Sizing a model on the meta device once ran torch's Python meta kernels, which import
    ``torch._dynamo`` and sympy: 1-1.5 s and 150 MiB in every command and ``p2pfl peer``
    process that built a LeNet or a CNN (docs/performance.md). A whole LeNet run, and the
    other convolutional models built, import neither."""
    code = """
import sys, tempfile
from pathlib import Path
from p2pfl.app.config import resolve
from p2pfl.app.experiment import build, run
from p2pfl.learning.models import build_model
for name in ("cnn3", "cnn_s"):
    build_model({"name": name}, (1, 28, 28), 10)
config = {"name": "conv", "dataset": {"name": "digits"}, "model": {"name": "lenet"},
          "topology": {"kind": "ring"}, "peers": {"count": 3},
          "algorithm": {"name": "dfedavgm", "rounds": 1}}
with tempfile.TemporaryDirectory() as out:
    run(build(resolve(config, Path("conv.yaml"))), Path(out))
print(sorted({"torch._dynamo", "sympy"} & set(sys.modules)))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
