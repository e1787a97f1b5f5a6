"""Hostile catalogue: ``p2pfl merge`` on directories that hold more than a run's nodes, and on
node files that are not what a node writes. Merge checks everything before it writes, and
never deletes a file it did not write (``--force`` replaces only a merged run's outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import experiment
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.network.message import Message
from p2pfl.network.wire import encode

NODES = ("0", "1", "2", "3", "server")


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    """The quick-start model's state: what every node's ``final.bin`` holds."""
    return build(experiment()).trainer.module(torch.device("cpu")).state_dict()


def nodes(run: Path, state: dict[str, torch.Tensor]) -> Path:
    """``run/peers/NAME/`` as five finished nodes of a FedAvg star would leave them."""
    config = yaml.safe_dump(build(experiment()).config, sort_keys=False)
    for i, name in enumerate(NODES):
        mine = run / "peers" / name
        mine.mkdir(parents=True)
        (mine / "config.yaml").write_text(config)
        result = {"status": "ok", "output": name == "server", "baselines": {}}
        (mine / "result.json").write_text(json.dumps(result))
        (mine / "metrics.csv").write_text("time,round,peer,metric,value\r\n0.5,1,0,loss,2.1\r\n")
        (mine / "final.bin").write_bytes(encode(Message("model", i, i, 0, state)))
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file under ``run``, by its path, with its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_clean_merge_then_force_replaces_only_the_runs_outputs(tmp_path, state, capsys):
    run = nodes(tmp_path / "run", state)
    assert main(["merge", str(run)]) == 0
    assert (run / "summary.json").is_file() and (run / "comm.csv").is_file()
    (run / "summary.json").write_text("{}")  # a stale output: --force writes it again
    assert main(["merge", str(run), "--force"]) == 0
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("merged_before", [False, True])
@pytest.mark.parametrize("yours", ["notes.txt", "mydata/", "results.json", ".hidden"])
def test_merge_never_deletes_a_users_file(tmp_path, state, capsys, yours, merged_before, force):
    """Issue: ``merge --force`` deleted a ``notes.txt`` and a ``mydata/`` folder beside the
    nodes' ``peers/``, and exited 0. Now: exit 2, one line naming the file, nothing touched."""
    run = nodes(tmp_path / "run", state)
    if merged_before:
        assert main(["merge", str(run)]) == 0
        capsys.readouterr()
    if yours.endswith("/"):
        (run / yours / "deep").mkdir(parents=True)
        (run / yours / "deep" / "data.bin").write_bytes(b"precious")
    else:
        (run / yours).write_text("precious")
    before = snapshot(run)
    assert main(["merge", str(run), *["--force"] * force]) == 2
    err = one_line(capsys)
    assert "files p2pfl did not write" in err and yours.rstrip("/") in err
    assert snapshot(run) == before


def test_a_users_link_among_the_outputs_is_left_alone(tmp_path, state, capsys):
    """A link named like no run file, to a folder of the user's: refused, the folder kept."""
    run = nodes(tmp_path / "run", state)
    assert main(["merge", str(run)]) == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("precious")
    (run / "link").symlink_to(theirs)
    assert main(["merge", str(run), "--force"]) == 2
    assert "link" in one_line(capsys)
    assert (theirs / "keep.txt").read_text() == "precious" and (run / "link").is_symlink()


def frame_of(state: dict[str, torch.Tensor], **change: torch.Tensor | None) -> bytes:
    """A model frame of ``state`` with tensors replaced (or, with ``None``, left out)."""
    tensors = {k: v for k, v in (state | change).items() if v is not None}
    return bytes(encode(Message("model", 1, 1, 0, tensors)))


BAD_FINALS = {
    "garbage": lambda s: b"not a frame" * 10,
    "empty": lambda s: b"",
    "truncated": lambda s: frame_of(s)[:-7],
    "a tensor missing": lambda s: frame_of(s, **{next(iter(s)): None}),
    "a tensor too many": lambda s: frame_of(s, extra=torch.zeros(3)),
    "a wrong shape": lambda s: frame_of(s, **{next(iter(s)): torch.zeros(2, 2)}),
    "a wrong dtype": lambda s: frame_of(s, **{k: v.double() for k, v in list(s.items())[:1]}),
    "no tensors": lambda s: bytes(encode(Message("model", 1, 1, 0, {}))),
}


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "merged-before"])
@pytest.mark.parametrize("case", BAD_FINALS, ids=list(BAD_FINALS))
def test_a_spoilt_final_model_is_one_line_before_anything_is_written(
    tmp_path, state, capsys, case, fresh
):
    """Issue: a corrupt ``final.bin`` was found after merge had written its outputs (exit 1).
    Every node file is now checked first: exit 2, one line naming the file, nothing written
    (and a merged run's earlier outputs kept as they were)."""
    run = nodes(tmp_path / "run", state)
    if not fresh:
        assert main(["merge", str(run)]) == 0
        capsys.readouterr()
    (run / "peers" / "2" / "final.bin").write_bytes(BAD_FINALS[case](state))
    before = snapshot(run)
    assert main(["merge", str(run), "--force"]) == 2
    err = one_line(capsys)
    assert "peers/2/final.bin: not " in err and len(err) < 300, err
    assert snapshot(run) == before
