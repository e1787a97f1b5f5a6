"""``p2pfl report``: one self-contained HTML page of finished runs and sweeps, rendered in a
real headless Chromium (the Debian package; ``make test`` installs it, and the browser tests
skip without it), with its figures, without console errors; and bad directories are one
``error:`` line, exit 2, nothing written."""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.image import imread

import p2pfl
from conftest import ROOT, run_cli
from p2pfl.app import cli
from p2pfl.app.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (make test installs the Debian package)"
)
WINDOW = (1400, 3000)
SMALL = {"model": {"name": "mlp", "hidden": [16]}, "peers": {"count": 4}}


def cli_run(tmp: Path, name: str, config: dict) -> Path:
    out = tmp / name
    done = run_cli(tmp / f"{name}.yaml", config, out, "--quiet")
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The quick-start (5 of its 20 rounds), a small DFedAvgM ring under churn with
    ``eval.targets``, and a tiny sweep (FedAvg, 2 and 3 rounds x star and ring x seeds 0, 1:
    the ring cells are skipped, FedAvg needs a star)."""
    tmp = tmp_path_factory.mktemp("report")
    quickstart = yaml.safe_load((ROOT / "experiments" / "quickstart.yaml").read_text())
    quickstart["algorithm"]["rounds"] = 5
    churn = {
        "name": "churn", "seed": 0, "dataset": {"name": "digits"}, "partition": {"name": "iid"},
        "model": SMALL["model"], "topology": {"kind": "ring"}, "peers": {"count": 5},
        "algorithm": {"name": "dfedavgm", "rounds": 6, "wait_s": 0.05},
        "eval": {"targets": [0.3, 0.99]},
        "network": {"churn": {"online": {"dist": "exponential", "mean_s": 0.05},
                              "offline_fraction": 0.3}},
    }  # fmt: skip
    sweep = {
        "name": "tiny", "seed": 0, "dataset": {"name": "digits"}, "partition": {"name": "iid"},
        **SMALL, "topology": {"kind": "star"}, "algorithm": {"name": "fedavg", "rounds": 2},
        "sweep": {"algorithm.rounds": [2, 3], "topology": ["star", "ring"], "seed": [0, 1]},
    }  # fmt: skip
    # the quick-start as a user runs it; the other two from Python (no second torch import)
    return {
        "quickstart": cli_run(tmp, "quickstart", quickstart),
        "churn": p2pfl.run(churn, out=tmp / "churn").out,
        "sweep": p2pfl.sweep(sweep, out=tmp / "sweep").out,
    }


def report(*args: str) -> int:
    return main(["report", *args])


@pytest.fixture(scope="module")
def pages(runs, tmp_path_factory) -> dict[str, Path]:
    """The page of the quick-start, of the sweep, and of all three together."""
    together = tmp_path_factory.mktemp("together") / "new" / "all.html"  # its folder made
    assert report(str(runs["quickstart"])) == 0
    assert report(str(runs["sweep"])) == 0
    assert report(*map(str, runs.values()), "--out", str(together)) == 0
    return {
        "quickstart": runs["quickstart"] / "report.html",
        "sweep": runs["sweep"] / "report.html",
        "together": together,
    }


# -- in the browser ---------------------------------------------------------------------------


def browse(page: Path, tmp: Path) -> tuple[np.ndarray, str, list[str]]:
    """Open ``page`` in headless Chromium: its screenshot (RGB floats in [0, 1]), the DOM
    after loading, and the console messages it logged."""
    assert CHROMIUM is not None
    shot = tmp / f"{page.stem}.png"
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr",
         "--v=0", f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    console = [
        line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line
    ]
    return imread(shot)[..., :3], done.stdout, console


def coloured(image: np.ndarray) -> int:
    """Pixels of a clear colour (figures' lines, bars and colour maps): the page's own text,
    rules and backgrounds are greys and a dark slate, all below this saturation."""
    return int(((image.max(axis=2) - image.min(axis=2)) > 0.25).sum())


@needs_chromium
def test_the_quickstart_page_renders_its_figures_in_chromium(pages, tmp_path):
    image, dom, console = browse(pages["quickstart"], tmp_path)
    assert console == []
    assert image.shape == (WINDOW[1], WINDOW[0], 3)
    # accuracy; traffic on the graph and by direction; the partition: four inline SVGs
    assert dom.count("<svg") == dom.count("<figure>") == 4
    for section in ("runs", "run-1", "accuracy", "traffic", "data"):
        assert f'<section id="{section}">' in dom
    assert "availability" not in re.findall(r'<section id="(\w+)"', dom)  # no churn
    assert coloured(image) > 20_000
    # the same page without its figures, and with a script that fails: the browser check
    # sees the console error, and the colour was the figures'
    text = pages["quickstart"].read_text()
    bare = re.sub(r"<svg.*?</svg>", "", text, flags=re.S)
    assert bare.count("<figure>") == 4 and "<svg" not in bare
    control = tmp_path / "control.html"
    control.write_text(bare.replace("</body>", '<script>throw new Error("boom")</script></body>'))
    image, dom, console = browse(control, tmp_path)
    assert any("Uncaught Error: boom" in line for line in console)
    assert coloured(image) < 2_000


@needs_chromium
def test_the_sweep_page_renders_its_figures_and_cells_in_chromium(pages, runs, tmp_path):
    image, dom, console = browse(pages["sweep"], tmp_path)
    assert console == []
    # side by side (bars per line); accuracy; traffic; seeds 0 and 1's two partitions
    assert dom.count("<svg") == dom.count("<figure>") == 5
    assert coloured(image) > 20_000
    # the four cells that ran, each its own section, and the four skipped with their reason
    assert len(re.findall(r'<section id="run-\d+">', dom)) == 4
    assert dom.count("fedavg runs on star, not on 'ring'") == 4
    assert dom.count('<tr class="bad">') == 4 and "every cell of the grid (4 of 8 ran)" in dom
    # the two lines (rounds 2 and 3), each the mean of two seeds
    assert "rounds=2 · star" in dom and "rounds=3 · star" in dom


# -- the page's content -----------------------------------------------------------------------


class References(html.parser.HTMLParser):
    """Every attribute that names a resource, and every tag, of an HTML text."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.links += [v or "" for k, v in attrs if k in ("src", "href", "xlink:href", "srcset")]


@pytest.mark.parametrize("name", ["quickstart", "sweep", "together"])
def test_the_page_needs_nothing_outside_itself(pages, name):
    text = pages[name].read_text(encoding="utf-8")
    found = References()
    found.feed(text)
    # anchors in the page, and the pixels of an image drawn in a figure (a colour map)
    inline = [link for link in found.links if link.startswith("data:image/png;base64,")]
    anchors = [link for link in found.links if link.startswith("#")]
    assert anchors and len(anchors) + len(inline) == len(found.links)
    assert not found.tags & {"script", "link", "img", "iframe", "object", "embed", "base"}
    assert "@import" not in text
    assert all(u.startswith("#") for u in re.findall(r"url\(([^)]*)\)", text))  # clip paths
    # every http(s) address is an SVG namespace name, never fetched
    addresses = re.findall(r'(\S*)"(https?://[^"]*)"', text)
    assert addresses and all(re.fullmatch(r"xmlns(:\w+)?=", a) for a, _ in addresses)
    # every in-page link has its target
    ids = set(re.findall(r'\sid="([^"]+)"', text))
    assert {link[1:] for link in anchors} <= ids


def test_the_page_of_several_runs_compares_them(pages, runs):
    text = pages["together"].read_text(encoding="utf-8")
    sections = re.findall(r'<section id="([\w-]+)">', text)
    assert sections == ["runs", "accuracy", "traffic", "availability", "data",
                        *(f"run-{i}" for i in range(1, 7))]  # fmt: skip
    # the runs table: one row per run, with summary.json's numbers
    for run in (runs["quickstart"], runs["churn"]):
        summary = json.loads((run / "summary.json").read_text())
        assert f'<td class="num">{summary["comm"]["total_bytes"]:,}</td>' in text
        assert f'<td class="num">{summary["final"]["accuracy"]:.6g}</td>' in text
    # the churn run's targets: its time to each, "never", and "—" for the runs without
    header = re.findall(r"<th>([^<]+)</th>", text[: text.index("</table>")])
    assert header[-2:] == ["time to 0.3 (s)", "time to 0.99 (s)"]
    reached = json.loads((runs["churn"] / "summary.json").read_text())["time_to_accuracy"]
    assert reached["0.99"] is None
    churn = re.search(r"<tr><td><a href=\"#run-2\">churn</a>.*?</tr>", text)
    assert churn is not None and churn.group().endswith(
        f'<td class="num">{reached["0.3"]["time_s"]:.6g}</td><td>never</td></tr>'
    )
    assert text[: text.index("</table>")].count("<td>—</td>") == 2 * 5
    # what differs: a column for each key every run has and whose values differ, the keys
    # only some runs have as text (the churn run's network section, a method's own keys)
    differs = text[text.index("<h3>What differs</h3>") : text.index("<h3>Side by side</h3>")]
    header = re.findall(r"<th>([^<]+)</th>", differs)
    assert header[0] == "run" and header[-1] == "keys only some runs have"
    assert {"seed", "topology.kind", "algorithm.name", "algorithm.rounds"} <= set(header)
    assert "dataset.name" not in header and "dataset.name" not in differs  # all digits
    assert "network.churn.offline_fraction=0.3" in differs
    assert "algorithm.participation=0.5" in differs  # the quick-start's FedAvg only
    # side by side: quickstart, churn and the sweep's two lines (named after the sweep)
    side = text[text.index("<h3>Side by side</h3>") : text.index("Sweep sweep: its cells")]
    assert re.findall(r"<tr><td>([^<]+)</td><td class=\"num\">(\d)</td>", side) == [
        ("quickstart", "1"), ("churn", "1"),
        ("sweep: rounds=2 · star", "2"), ("sweep: rounds=3 · star", "2"),
    ]  # fmt: skip
    # the churn run's targets add the accuracy-against-time and -bytes figures
    accuracy = text[text.index('<section id="accuracy">') : text.index('<section id="traffic">')]
    assert accuracy.count("<svg") == 3 and "target 0.3" in accuracy


def test_one_run_shows_its_summary_and_config(pages, runs):
    text = pages["quickstart"].read_text(encoding="utf-8")
    run = runs["quickstart"]
    summary = json.loads((run / "summary.json").read_text())
    config = (run / "config.yaml").read_text()
    assert f"<pre>{html.escape(config)}</pre>" in text  # as written
    assert f'<tr><td>comm.messages</td><td class="num">{summary["comm"]["messages"]:,}' in text
    assert f'<tr><td>final.loss</td><td class="num">{summary["final"]["loss"]:.6g}' in text
    for peer in summary["per_peer"]:
        assert f'<td class="num">{peer["accuracy"]:.6g}</td>' in text
    assert "p2pfl report " + str(run) in text  # the command that made it


def test_the_availability_section_of_one_run_with_churn(runs, tmp_path):
    out = tmp_path / "churn.html"
    assert report(str(runs["churn"]), "--out", str(out)) == 0
    text = out.read_text(encoding="utf-8")
    section = text[text.index('<section id="availability">') : text.index('<section id="data">')]
    assert section.count("<svg") == 2  # peers online, and each peer's intervals
    rows = [line.split(",") for line in (runs["churn"] / "availability.csv").read_text().split()]
    online = sum(float(b) - float(a) for _, a, b in rows[1:])
    end = json.loads((runs["churn"] / "summary.json").read_text())["sim_time_s"]
    assert f"{online / (5 * end):.1%} of peer-time online" in section


def test_default_places_and_what_a_run_or_sweep_may_hold(pages, runs):
    assert pages["quickstart"] == runs["quickstart"] / "report.html"
    assert pages["sweep"] == runs["sweep"] / "report.html"
    # the page is a run's and a sweep's own file: --force replaces them, a sweep resumes
    assert cli._is_run(runs["quickstart"]) and cli._is_sweep(runs["sweep"])


def test_bad_directories_are_one_error_line_and_nothing_is_written(runs, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(runs["quickstart"], broken, ignore=shutil.ignore_patterns("report.html"))
    (broken / "summary.json").write_text('{"experiment": "quickstart", ')
    listed = tmp_path / "listed"
    shutil.copytree(runs["quickstart"], listed, ignore=shutil.ignore_patterns("report.html"))
    (listed / "summary.json").write_text("[1, 2]")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out" / "page.html"
    cases = {
        str(tmp_path / "missing"): "is neither a run (summary.json) nor a sweep (cells.csv)",
        str(tmp_path / "empty"): "is neither a run (summary.json) nor a sweep (cells.csv)",
        str(broken): f"not a finished run: {broken / 'summary.json'}: Expecting",
        str(listed): f"{listed / 'summary.json'}: not a run summary",
    }
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for path, message in cases.items():
        for args in ([path], [path, "--out", str(out)], [str(runs["quickstart"]), path, "--out",
                                                          str(out)]):  # fmt: skip
            assert report(*args) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # several directories without --out; an --out that is a directory
    assert report(str(runs["quickstart"]), str(runs["churn"])) == 2
    assert capsys.readouterr().err == (
        "error: --out: 2 run directories: name the page's file, e.g. --out report.html\n"
    )
    assert report(str(runs["churn"]), "--out", str(tmp_path)) == 2
    assert capsys.readouterr().err == (
        f"error: --out: {tmp_path} is a directory; name the page's file, "
        f"e.g. {tmp_path / 'report.html'}\n"
    )
    assert not (runs["churn"] / "report.html").exists()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_failed_run_has_its_page_too(runs, tmp_path):
    """A run that failed before its first evaluation and message: the page says so."""
    failed = tmp_path / "failed"
    shutil.copytree(runs["quickstart"], failed, ignore=shutil.ignore_patterns("report.html"))
    summary = json.loads((failed / "summary.json").read_text())
    error = "deadlock: " + "; ".join(f"{i} waits for 1 model message(s)" for i in range(40))
    summary |= {"status": "failed", "error": error}
    (failed / "summary.json").write_text(json.dumps(summary))
    for name in ("metrics.csv", "comm.csv"):
        header = (failed / name).read_text().splitlines()[0]
        (failed / name).write_text(header + "\n")
    assert report(str(failed)) == 0
    text = (failed / "report.html").read_text(encoding="utf-8")
    assert text.count('<tr class="bad">') == 1
    # a long error: its first 300 characters, the whole of it folded
    assert (
        len(error) == 1_318
        and (
            f"<tr><td>error</td><td>{error[:300]}…<details><summary>all 1,318 characters</summary>"
            f"{error}</details></td></tr>"
        )
        in text
    )
    assert text.count("<svg") == 4


def test_the_same_runs_give_the_same_page_but_for_its_date(runs):
    from p2pfl.reporting.report import render

    paths = [runs["churn"]]  # every kind of figure a run has: targets, churn
    date = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")
    first, second = (date.sub("DATE", render(paths, "p2pfl report ...")) for _ in range(2))
    assert first == second and first.count("DATE") == 1


def test_a_large_population_is_sent_by_direction_in_blocks_of_nodes(runs, monkeypatch):
    """Beyond ``DIRECTION_MAX`` nodes the by-direction matrix sums blocks of consecutive
    node ids (10⁵ nodes one by one asked for a 75 GiB matrix and crashed the report): every
    byte of comm.csv is in its block."""
    from p2pfl.reporting import plots, report

    run = plots.read_run(runs["quickstart"])  # 10 peers and the server: 11 nodes
    whole = report.direction_figure(run)[0].axes[0].images[0].get_array()
    monkeypatch.setattr(report, "DIRECTION_MAX", 4)
    figure, caption = report.direction_figure(run)
    blocks = figure.axes[0].images[0].get_array()
    assert whole.shape == (11, 11) and blocks.shape == (4, 4)  # blocks of 3 nodes
    assert "each block of 3 consecutive nodes" in caption
    for i in range(4):
        for j in range(4):
            assert blocks[i, j] == pytest.approx(whole[3 * i : 3 * i + 3, 3 * j : 3 * j + 3].sum())
    total = json.loads((runs["quickstart"] / "summary.json").read_text())["comm"]["total_bytes"]
    assert blocks.sum() == pytest.approx(total / 1e6)
