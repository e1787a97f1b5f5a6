"""Position-aware neurons (§3 and App. B of the paper) and the neuron-matching measure (§5.2)."""

from __future__ import annotations

import copy
import csv
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from conftest import experiment, run_experiment
from p2pfl.app.experiment import build, run
from p2pfl.core.errors import ConfigError
from p2pfl.learning.models import Hidden, build_model, hidden_units
from p2pfl.learning.pans import PositionEncoding
from p2pfl.reporting.matching import diagonal_ratio, unit_activations

DIGITS, MNIST, CIFAR = (1, 8, 8), (1, 28, 28), (3, 32, 32)
MUL = {"mode": "mul", "T": 1.0, "A": 0.1}


def model(name: str = "mlp", pans: dict | None = None, shape=MNIST, **keys: Any) -> nn.Module:
    torch.manual_seed(0)
    options = {"name": name, **keys} | ({"pans": pans} if pans else {})
    return build_model(options, shape, 10).double()


def sattolo(width: int, p_sf: float, gen: torch.Generator) -> Tensor:
    """The paper's Alg. 1: for each j swap j with a later i, with probability p_sf."""
    perm = torch.arange(width)
    for j in range(width - 1):
        i = int(torch.randint(j + 1, width, (1,), generator=gen))
        if torch.rand(1, generator=gen).item() < p_sf:
            perm[[j, i]] = perm[[i, j]]
    return perm


def permute(net: nn.Sequential, perms: dict[str, Tensor]) -> nn.Sequential:
    """A copy of a Sequential of Hidden layers whose hidden layer ``name`` has its units
    reordered by ``perms[name]`` (new unit i = old unit perm[i], Eq. 1): rows of its layer
    and norm, columns of the next layer (per channel block after a flatten). Encodings,
    which are not weights, stay where they are."""
    net = copy.deepcopy(net)
    layers = [m for m in net.children() if isinstance(m, (Hidden, nn.Linear))]
    with torch.no_grad():
        for name, perm in perms.items():
            hidden = getattr(net, name)
            nxt = layers[layers.index(hidden) + 1]
            nxt = nxt.layer if isinstance(nxt, Hidden) else nxt
            tensors = [hidden.layer.weight, hidden.layer.bias]
            if isinstance(hidden.norm, nn.BatchNorm2d):
                n = hidden.norm
                tensors += [n.weight, n.bias, n.running_mean, n.running_var]
            for t in tensors:
                t.copy_(t[perm])
            block = nxt.weight.shape[1] // len(perm)  # spatial positions per channel
            cols = (perm[:, None] * block + torch.arange(block)).flatten()
            nxt.weight.copy_(nxt.weight[:, cols])
    return net


def shuffle_error(net: nn.Module, perms: dict[str, Tensor], x: Tensor) -> float:
    """Eq. 8: ‖logits after − before‖ / output size, averaged over the batch."""
    net.eval()
    with torch.no_grad():
        diff = permute(net, perms)(x) - net(x)
    return (diff.norm(dim=1) / diff.shape[1]).mean().item()


def random_perms(net: nn.Module, p_sf: float, seed: int = 0) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: sattolo(w, p_sf, gen) for n, (_, w) in hidden_units(net).items()}


@pytest.mark.parametrize(("mode", "T", "A"), [("add", 1.0, 0.2), ("mul", 2.0, 0.1)])
def test_encoding_follows_the_formula(mode, T, A):
    net = model(hidden=[64, 30], pans={"mode": mode, "T": T, "A": A})
    for name, width in (("fc1", 64), ("fc2", 30)):
        values = getattr(net, name).norm.pan.values
        wave = torch.tensor([A * math.sin(2 * math.pi * T * j / width) for j in range(width)])
        expected = wave if mode == "add" else 1 + wave
        torch.testing.assert_close(values, expected.double())
    assert not hasattr(net.out, "pan")


@pytest.mark.parametrize("name", ["mlp", "lenet", "cnn3", "cnn_s", "resnet18"])
def test_encodings_are_neither_parameters_nor_state(name):
    plain, pan = model(name, shape=CIFAR), model(name, MUL, shape=CIFAR)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {
        k: v.shape for k, v in pan.state_dict().items()
    }
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in pan.named_parameters()]
    encodings = [m for m in pan.modules() if isinstance(m, PositionEncoding)]
    assert len(encodings) == len(hidden_units(pan)) > 0
    assert not any(isinstance(m, PositionEncoding) for m in plain.modules())
    x = torch.randn(2, *CIFAR, dtype=torch.float64)
    assert not torch.allclose(pan.eval()(x), plain.eval()(x))


def test_resnet18_places_encodings_after_each_block_norm_and_none_on_stem_or_output():
    net = model("resnet18", MUL, shape=CIFAR)
    units = hidden_units(net)
    assert len(units) == 8 * 2 + 3  # two per basic block, plus three projection shortcuts
    assert "layer2.0.downsample.1" in units and "layer1.0.downsample.1" not in units
    assert not hasattr(net.bn1, "pan") and not hasattr(net.fc, "pan")
    block, x = net.layer2[0].eval(), torch.randn(2, 64, 8, 8, dtype=torch.float64)
    e1, e2, e3 = (
        m.pan.values.view(1, -1, 1, 1) for m in (block.bn1, block.bn2, block.downsample[1])
    )
    bn = torch.nn.functional.batch_norm

    def norm(m: nn.BatchNorm2d, h: Tensor) -> Tensor:
        return bn(h, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)

    inner = torch.relu(norm(block.bn1, block.conv1(x)) * e1)
    shortcut = norm(block.downsample[1], block.downsample[0](x)) * e3
    expected = torch.relu(norm(block.bn2, block.conv2(inner)) * e2 + shortcut)
    torch.testing.assert_close(block(x), expected)


def test_encoding_sits_after_the_norm_and_before_the_activation():
    net = model("cnn_s", {"mode": "add", "A": 0.2}).eval()
    h, x = net.conv1, torch.randn(3, *MNIST, dtype=torch.float64)
    e = h.norm.pan.values.view(1, -1, 1, 1)
    bn = h.norm
    normed = (h.layer(x) - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(
        bn.running_var.view(1, -1, 1, 1) + bn.eps
    ) * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
    torch.testing.assert_close(h(x), h.pool(torch.relu(normed + e)))


def test_mul_with_zero_amplitude_is_the_plain_network_and_add_is_a_bias_shift():
    x = torch.randn(5, *MNIST, dtype=torch.float64)
    plain = model(hidden=[64, 64])
    off = model(hidden=[64, 64], pans={"mode": "mul", "A": 0.0})
    assert torch.equal(off(x), plain(x))
    add = model(hidden=[64, 64], pans={"mode": "add", "A": 0.2})
    shifted = copy.deepcopy(plain)
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            getattr(shifted, name).layer.bias.add_(getattr(add, name).norm.pan.values)
    torch.testing.assert_close(add(x), shifted(x))


@pytest.mark.parametrize(("name", "keys"), [("mlp", {"hidden": [64, 64, 64]}), ("cnn_s", {})])
def test_permuting_hidden_units_is_invisible_only_without_pans(name, keys):
    x = torch.randn(16, *MNIST, dtype=torch.float64)
    for pans in (None, {"mode": "mul", "A": 0.0}, {"mode": "add", "A": 0.0}):
        net = model(name, pans, **keys)
        assert shuffle_error(net, random_perms(net, 1.0), x) < 1e-12
    for pans in (MUL, {"mode": "add", "A": 0.1}):
        net = model(name, pans, **keys)
        assert shuffle_error(net, random_perms(net, 0.5), x) > 1e-4


def test_sensitivity_grows_with_amplitude():
    """Mean shuffle error (Eq. 8) over 10 permutations rises with A, for both ops (Fig. 3)."""
    x = torch.randn(32, *MNIST, dtype=torch.float64)
    for mode in ("add", "mul"):
        errors = []
        for amplitude in (0.0, 0.01, 0.05, 0.1, 0.25):
            net = model(hidden=[64, 64, 64], pans={"mode": mode, "A": amplitude})
            errors.append(
                sum(shuffle_error(net, random_perms(net, 0.5, s), x) for s in range(10)) / 10
            )
        assert errors == sorted(errors) and len(set(errors)) == 5, (mode, errors)


def test_symmetric_units_share_an_encoding_generic_ones_do_not():
    """At T = 1, J = 64, units 5 and 27 = J/2 − 5 have the same value: sin(2πj/J) =
    sin(2π(J/2 − j)/J), so swapping them leaves the output unchanged even with PANs on."""
    net = model(hidden=[64], pans=MUL)
    x = torch.randn(8, *MNIST, dtype=torch.float64)

    def swap(i: int, j: int) -> float:
        perm = torch.arange(64)
        perm[[i, j]] = perm[[j, i]]
        return shuffle_error(net, {"fc1": perm}, x)

    assert swap(5, 27) < 1e-12
    assert swap(5, 6) > 1e-6


def test_training_leaves_the_encodings_alone(tmp_path):
    config = experiment(
        model={"name": "mlp", "hidden": [32], "pans": MUL},
        algorithm={"name": "fedavg", "rounds": 2},
    )
    setup = build(config)
    run(setup, tmp_path)
    values = setup.trainer.module(torch.device("cpu")).fc1.norm.pan.values
    expected = 1 + 0.1 * torch.sin(2 * math.pi * torch.arange(32.0) / 32)
    torch.testing.assert_close(values, expected)


@pytest.mark.parametrize(
    ("pans", "key"),
    [
        ({"mode": "sin"}, "model.pans.mode"),
        ({"mode": "add", "A": -0.1}, "model.pans.A"),
        ({"mode": "mul", "A": 1.0}, "model.pans.A"),
        ({"mode": "mul", "period": 2}, "model.pans.period"),
        ("mul", "model.pans"),
        ({"mode": "mul", "T": 32}, "model.pans.T"),  # sin(2π·32·j/32) = 0 for every unit
    ],
)
def test_bad_pans_keys_name_themselves(pans, key):
    with pytest.raises(ConfigError) as err:
        build(experiment(model={"name": "mlp", "hidden": [32], "pans": pans}))
    assert err.value.key == key


def test_yaml_off_is_read_as_the_off_mode():
    config = experiment(model={"name": "mlp", "pans": {"mode": False}}).config
    assert config["model"]["pans"] == {"mode": "off", "T": 1.0, "A": 0.1}
    assert experiment().config["model"]["pans"]["mode"] == "off"


HOSTS = [
    ({"name": "fedavg", "rounds": 2, "participation": 0.5}, {"kind": "star"}),
    ({"name": "fedprox", "rounds": 2, "mu": 0.1}, {"kind": "star"}),
    ({"name": "dfedavgm", "rounds": 2}, {"kind": "ring"}),
    ({"name": "dfedsam", "rounds": 1}, {"kind": "ring"}),
    ({"name": "regmean", "placement": "mesh"}, {"kind": "mesh"}),
]


@pytest.mark.parametrize(("algorithm", "topology"), HOSTS, ids=[a["name"] for a, _ in HOSTS])
def test_pans_plug_into_every_host_and_send_the_same_bytes(tmp_path, algorithm, topology):
    runs = {}
    for mode in ("off", "mul"):
        runs[mode] = run_experiment(
            tmp_path / mode,
            model={"name": "mlp", "hidden": [32], "pans": {"mode": mode, "A": 0.3}},
            topology=topology,
            peers={"count": 4},
            algorithm=algorithm,
        )
    assert runs["off"]["status"] == runs["mul"]["status"] == "ok"
    assert runs["off"]["comm"] == runs["mul"]["comm"]
    assert runs["off"]["final"] != runs["mul"]["final"]


def test_fedprox_with_mu_zero_reproduces_fedavg_with_pans(tmp_path):
    sections = {"model": {"name": "mlp", "hidden": [32], "pans": MUL}}
    a = run_experiment(tmp_path / "a", algorithm={"name": "fedavg", "rounds": 3}, **sections)
    b = run_experiment(
        tmp_path / "b", algorithm={"name": "fedprox", "rounds": 3, "mu": 0.0}, **sections
    )
    assert a["final"] == b["final"] and a["per_peer"] == b["per_peer"]


def test_matching_a_model_with_itself_and_with_a_shuffled_copy():
    """Ratio 1 against itself; against a copy shuffled by Π (PANs off) the
    Hungarian matching undoes Π, so the ratio is Π's fraction of fixed points."""
    net = model(hidden=[64, 48]).eval()
    x = torch.randn(200, *MNIST, dtype=torch.float64)
    acts = unit_activations(net, x)
    assert set(acts) == {"fc1", "fc2"} and acts["fc1"].shape == (64, 200)
    assert diagonal_ratio(acts["fc1"], acts["fc1"]) == 1.0
    perms = random_perms(net, 0.3, seed=3)
    shuffled = unit_activations(permute(net, perms), x)
    for name, perm in perms.items():
        kept = (perm == torch.arange(len(perm))).double().mean().item()
        assert 0 < kept < 1
        assert diagonal_ratio(acts[name], shuffled[name]) == pytest.approx(kept)


def test_matching_reads_encoded_pre_activations_and_reduces_conv_maps():
    net = model("cnn_s", {"mode": "add", "A": 0.2}).eval()
    x = torch.randn(10, *MNIST, dtype=torch.float64)
    acts = unit_activations(net, x)
    h = net.conv1
    pre = h.norm(h.layer(x))  # the norm's output includes its encoding
    torch.testing.assert_close(acts["conv1"], pre.amax((2, 3)).T)
    assert acts["conv2"].shape == (16, 10)


def test_matching_in_a_run_goes_to_the_summary_and_the_metrics(tmp_path):
    summary = run_experiment(
        tmp_path,
        model={"name": "mlp", "hidden": [32, 16], "pans": MUL},
        peers={"count": 4},
        algorithm={"name": "fedavg", "rounds": 2},
        eval={"matching": {"peers": 3, "epochs": 2, "samples": 100}},
    )
    matching = summary["matching"]
    assert set(matching) == {"global", "peers"}
    assert set(matching["global"]) == {"fc1", "fc2", "mean"}
    assert all(0 <= v <= 1 for part in matching.values() for v in part.values())
    with open(tmp_path / "metrics.csv") as f:
        rows = {r["metric"]: float(r["value"]) for r in csv.DictReader(f) if "match" in r["metric"]}
    assert rows["match_global/fc2"] == matching["global"]["fc2"]
    assert rows["match_peers/mean"] == matching["peers"]["mean"]


@pytest.mark.parametrize(
    ("model_keys", "matching", "key"),
    [
        ({"hidden": [8]}, {"peers": 5}, "eval.matching.peers"),
        ({"hidden": [8]}, {"epochs": 0}, "eval.matching.epochs"),
        ({"hidden": [8]}, {"pairs": 2}, "eval.matching.pairs"),
        ({"hidden": []}, {}, "eval.matching"),
    ],
)
def test_bad_matching_keys_name_themselves(model_keys, matching, key):
    with pytest.raises(ConfigError) as err:
        build(experiment(model={"name": "mlp"} | model_keys, eval={"matching": matching}))
    assert err.value.key == key
