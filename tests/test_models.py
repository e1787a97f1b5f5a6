"""Tests for p2pfl.learning.models: builders, option checks, FLOP counting and state helpers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.core.errors import ConfigError
from p2pfl.learning.models import (
    MODELS,
    Hidden,
    MaxPool2x2,
    _ChannelsLastMaxPool,
    build_model,
    forward_flops,
)
from p2pfl.learning.state import average_states, clone_state, state_bytes
from p2pfl.learning.training import TrainConfig, Trainer, optimizer

DIGITS, MNIST, CIFAR = (1, 8, 8), (1, 28, 28), (3, 32, 32)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", [DIGITS, MNIST, CIFAR])
@pytest.mark.parametrize("name", ["mlp", "lenet", "cnn3", "cnn_s", "resnet18"])
def test_every_model_maps_a_batch_to_class_logits(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model({"name": name}, shape, 10)
    assert model(torch.randn(2, *shape)).shape == (2, 10)
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


@pytest.mark.parametrize("shape", [DIGITS, MNIST, CIFAR])
@pytest.mark.parametrize("name", ["lenet", "cnn3", "cnn_s"])
def test_a_model_sized_on_the_meta_device_has_the_cpu_models_shapes(name, shape) -> None:
    """build_model sizes a model on the meta device first, probing its convolutions on the
    CPU with zero weights: every parameter and buffer gets the shape of the real model's."""
    with torch.device("meta"):
        sized = MODELS.get(name)(shape, 10)
    real = build_model({"name": name}, shape, 10)
    assert {k: v.shape for k, v in sized.state_dict().items()} == {
        k: v.shape for k, v in real.state_dict().items()
    }
    assert all(t.is_meta for t in sized.state_dict().values()) and sized.training


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit patterns: NaNs and signed zeros compare exactly."""
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize(
    "shape", [(32, 6, 24, 24), (5, 16, 8, 8), (3, 4, 7, 9), (2, 130, 3, 2), (3, 50, 30, 31)]
)
def test_maxpool2x2_is_nn_maxpool2d_bit_for_bit(shape: tuple[int, ...]) -> None:
    """Outputs, indices and gradients, on values full of ties, signed zeros, infinities and
    NaNs (which window element wins decides where the gradient goes); maps pooled in one
    slice and in several, odd sizes. (MaxPool2x2 sends inputs this small to torch.)"""
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, float("inf"), float("-inf"), float("nan")])
    tied = values[torch.randint(len(values), shape, generator=gen)]
    for x in (tied, torch.randn(shape, generator=gen)):
        ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = _ChannelsLastMaxPool.apply(ours)[0], nn.MaxPool2d(2)(ref)
        assert torch.equal(bits(out), bits(expected))
        assert torch.equal(bits(MaxPool2x2()(x)), bits(expected))  # either way it goes
        g = values[torch.randint(6, expected.shape, generator=gen)]  # finite, signed zeros
        out.backward(g)
        expected.backward(g)
        assert torch.equal(bits(ours.grad), bits(ref.grad))
        indices = F.max_pool2d(x, 2, return_indices=True)[1]
        assert torch.equal(_ChannelsLastMaxPool.apply(x)[1], indices)


def test_maxpool2x2_trains_stacked_peers_as_nn_maxpool2d() -> None:
    """Under ``torch.func`` (vmap of grad: peers trained stacked), LeNet with MaxPool2x2
    gets nn.MaxPool2d's gradients bit for bit (20 samples a peer: its first pool takes the
    channels-last path, through the vmap rule; its second, smaller, torch's kernel)."""
    torch.manual_seed(0)
    ours = [build_model({"name": "lenet"}, MNIST, 10) for _ in range(3)]
    theirs = copy.deepcopy(ours)
    for model in theirs:
        for layer in (model.conv1, model.conv2):
            layer.pool = nn.MaxPool2d(2)
    x, y = torch.randn(3, 20, *MNIST), torch.randint(0, 10, (3, 20))

    def grads(models: list[nn.Module]) -> dict[str, torch.Tensor]:
        params, _ = torch.func.stack_module_state(models)

        def loss(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(torch.func.functional_call(models[0], p, (xb,)), yb)

        return torch.func.vmap(torch.func.grad(loss))(params, x, y)

    mine, reference = grads(ours), grads(theirs)
    assert all(torch.equal(bits(mine[k]), bits(reference[k])) for k in reference)


def test_a_seeds_initial_model_is_the_builder_after_torch_manual_seed() -> None:
    """``Trainer.init_state(seed)`` is what building after ``torch.manual_seed(seed)`` gives
    (the authors' scripts seed so), and it leaves the process's random state alone."""
    trainer = Trainer({"name": "lenet"}, MNIST, 10)
    before = torch.get_rng_state()
    state = trainer.init_state(7)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(7)
    expected = build_model({"name": "lenet"}, MNIST, 10).state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_registry_lists_every_builder() -> None:
    assert MODELS.names() == [
        "char_lstm", "char_transformer", "cnn1d", "cnn3", "cnn_s", "lenet", "logreg", "mlp",
        "resnet18",
    ]  # fmt: skip


def test_mlp_parameter_counts() -> None:
    assert n_params(build_model({"name": "mlp"}, MNIST, 10)) == 159_010
    ma_echo = build_model({"name": "mlp", "hidden": [400, 200, 100], "bias": False}, MNIST, 10)
    assert n_params(ma_echo) == 784 * 400 + 400 * 200 + 200 * 100 + 100 * 10
    assert not any("bias" in name for name, _ in ma_echo.named_parameters())


def test_mlp_without_hidden_layers_is_logistic_regression() -> None:
    model = build_model({"name": "mlp", "hidden": []}, DIGITS, 10)
    assert [type(m) for m in model] == [nn.Flatten, nn.Linear]
    assert n_params(model) == 64 * 10 + 10


def test_lenet_matches_the_papers() -> None:
    # FedFisher's bias-free FMNIST LeNet: d = 44,190 (fc 256 -> 120).
    fedfisher = build_model({"name": "lenet", "bias": False}, MNIST, 10)
    assert n_params(fedfisher) == 44_190
    assert not any("bias" in name for name, _ in fedfisher.named_parameters())
    # FedELMY's SimpleCNN on 32x32: fc 400 -> 120.
    assert build_model({"name": "lenet"}, CIFAR, 7).fc1.layer.in_features == 400
    # Tiny digits are padded; an explicit padding overrides the default.
    assert build_model({"name": "lenet"}, DIGITS, 10).conv1.layer.padding == (2, 2)
    assert build_model({"name": "lenet", "padding": 2}, MNIST, 10).fc1.layer.in_features == 784


def test_cnn3_and_cnn_s_flatten_sizes() -> None:
    assert build_model({"name": "cnn3"}, CIFAR, 10).out.in_features == 2048
    assert build_model({"name": "cnn3"}, MNIST, 10).out.in_features == 128 * 3 * 3
    assert build_model({"name": "cnn3", "width": 8}, DIGITS, 10).out.in_features == 8 * 2 * 2
    assert build_model({"name": "cnn_s"}, MNIST, 10).out.in_features == 784


def test_hidden_layers_have_one_activation_each_and_the_output_none() -> None:
    model = build_model({"name": "lenet"}, MNIST, 10)
    hidden = [m for m in model if isinstance(m, Hidden)]
    assert len(hidden) == 4 and all(isinstance(h.act, nn.ReLU) for h in hidden)
    assert isinstance(model.out, nn.Linear)
    cnn_s = build_model({"name": "cnn_s"}, MNIST, 10)
    assert isinstance(cnn_s.conv1.norm, nn.BatchNorm2d)


def test_resnet18_is_cifar_style() -> None:
    model = build_model({"name": "resnet18"}, MNIST, 10)
    assert model.conv1.in_channels == 1
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize(("norm", "kind"), [("none", nn.Identity), ("group", nn.GroupNorm)])
def test_resnet18_norm_swaps_batchnorm(norm: str, kind: type[nn.Module]) -> None:
    model = build_model({"name": "resnet18", "norm": norm}, CIFAR, 10)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert isinstance(model.bn1, kind) and isinstance(model.layer2[0].downsample[1], kind)
    if norm == "none":
        assert not any(n.endswith("bias") for n, _ in model.named_parameters() if n != "fc.bias")


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"name": "mlp", "hidden": [100, 0]}, "hidden"),
        ({"name": "mlp", "hidden": "wide"}, "hidden"),
        ({"name": "mlp", "depth": 3}, "depth"),
        ({"name": "cnn3", "width": 0}, "width"),
        ({"name": "lenet", "padding": -1}, "padding"),
        ({"name": "resnet18", "norm": "layer"}, "norm"),
        ({"name": "vgg"}, "name"),
        ({}, "name"),
        ({"name": "lenet", "padding": 0}, "name"),  # 8x8 is too small for unpadded convs
    ],
)
def test_bad_options_name_their_key(options: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_model(options, DIGITS, 10)
    assert err.value.key == key


def test_forward_flops_of_an_mlp_is_exact() -> None:
    model = build_model({"name": "mlp", "hidden": [32]}, DIGITS, 10)
    assert forward_flops(model, DIGITS) == 2 * (64 * 32 + 32 * 10)


def test_forward_flops_of_a_conv_follows_the_formula() -> None:
    conv = nn.Conv2d(4, 6, (3, 5), stride=2, padding=1, groups=2)
    out = conv(torch.zeros(1, 4, 11, 13))
    expected = 2 * (4 // 2) * 3 * 5 * 6 * out.shape[2] * out.shape[3]
    assert forward_flops(conv, (4, 11, 13)) == expected


def test_forward_flops_leaves_batchnorm_state_and_mode_alone() -> None:
    model = build_model({"name": "cnn_s"}, DIGITS, 10)
    before = clone_state(model.state_dict())
    assert forward_flops(model, DIGITS) > 0
    assert model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_bytes_and_clone_state() -> None:
    state = {"w": torch.ones(3, 4), "n": torch.tensor(5), "h": torch.ones(2, dtype=torch.half)}
    assert state_bytes(state) == 12 * 4 + 8 + 2 * 2
    w = nn.Parameter(torch.ones(2))
    copy = clone_state({"w": w})
    w.data.add_(1)
    assert torch.equal(copy["w"], torch.ones(2)) and not copy["w"].requires_grad


def test_average_of_two_states_is_the_elementwise_mean() -> None:
    a = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    b = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    mean = average_states([a, b])
    for k, value in a.items():
        assert mean[k].dtype == torch.float32
        torch.testing.assert_close(mean[k], (value + b[k]) / 2)


def test_average_respects_unnormalised_weights() -> None:
    a, b = {"w": torch.zeros(3)}, {"w": torch.full((3,), 4.0)}
    assert torch.equal(average_states([a, b], [1, 3])["w"], torch.full((3,), 3.0))
    assert torch.equal(average_states([a, b], [0.0, 2.0])["w"], b["w"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_average_sums_in_float64_in_state_order(dtype: torch.dtype) -> None:
    """Each element is 0 + share_0 x_0 + share_1 x_1 + ... in float64 (torch's ``add_`` with
    ``alpha`` on float64 copies), in the states' order, then cast back: the bits every
    runtime and world size must agree on (signed zeros, NaN and infinities included), for
    every tensor of a state in its order (sizes that leave scalar tails, one past torch's
    grain for splitting over threads, an integer buffer among them)."""
    g = torch.Generator().manual_seed(3)
    shapes = {"w": (50, 30), "b": (7,), "n": (), "c": (13, 5), "big": (33_000,), "one": ()}
    states = []
    for i in range(4):
        state = {}
        for key, shape in shapes.items():
            if key == "n":  # an integer buffer among them, summed on its own
                state[key] = torch.tensor(3 * i)
                continue
            w = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (8 * i - 12)
            w = w.to(dtype)
            w.view(-1)[:: 7 + i] = -0.0
            w.view(-1)[5 + i :: 97] = (float("nan"), float("inf"), -float("inf"), 1e-40)[i]
            state[key] = w
        states.append(state)
    weights = [0.3, 7.0, 1.0, 0.01]
    shares = [x / sum(weights) for x in weights]
    mean = average_states(states, weights)
    assert list(mean) == list(shapes)
    assert mean["n"].dtype == torch.int64 and mean["n"].item() == 3  # 27.09 / 8.31, rounded
    for key, shape in shapes.items():
        if key == "n":
            continue
        expected = torch.zeros(shape, dtype=torch.float64)
        for share, state in zip(shares, states, strict=True):
            expected.add_(state[key].to(torch.float64), alpha=share)
        assert mean[key].dtype == dtype and mean[key].shape == shape
        bits = expected.to(dtype).reshape(-1).view(torch.uint8)
        assert torch.equal(mean[key].reshape(-1).view(torch.uint8), bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_an_average_owns_its_tensors(dtype: torch.dtype) -> None:
    """The float64 sums are taken in one reused scratch buffer: every mean is a tensor of its
    own, which later averages (a larger one, of another shape, a float64 one, where the cast
    back would be no copy) leave as it was."""
    a, b = {"w": torch.tensor([1, 3], dtype=dtype)}, {"w": torch.tensor([5, 7], dtype=dtype)}
    first = average_states([a, b])
    kept = first["w"].clone()
    big = {"w": torch.ones(4, 5, dtype=dtype)}
    for other in ([big, big], [b, b], [a, a]):
        average_states(other)
    assert first["w"].dtype == dtype and torch.equal(first["w"], kept)
    assert torch.equal(kept, torch.tensor([3, 5], dtype=dtype))


def test_average_rounds_integer_buffers() -> None:
    states = [{"n": torch.tensor(2)}, {"n": torch.tensor(5)}]
    out = average_states(states, [1, 3])["n"]  # (2 + 15) / 4 = 4.25
    assert out.dtype == torch.int64 and out.item() == 4


def test_average_of_identical_states_is_bit_identical() -> None:
    torch.manual_seed(1)
    model = build_model({"name": "cnn_s"}, DIGITS, 10)
    model(torch.randn(4, *DIGITS))  # non-trivial BN running stats and counter
    state = clone_state(model.state_dict())
    for weights in (None, [0.1, 0.7, 0.2]):
        mean = average_states([state, clone_state(state), clone_state(state)], weights)
        assert all(
            torch.equal(mean[k], state[k]) and mean[k].dtype == state[k].dtype for k in state
        )


@pytest.mark.parametrize(
    ("other", "weights"),
    [
        ({"w": torch.zeros(2), "extra": torch.zeros(1)}, None),
        ({"v": torch.zeros(2)}, None),
        ({"w": torch.zeros(3)}, None),
        ({"w": torch.zeros(2, dtype=torch.float64)}, None),
        ({"w": torch.zeros(2)}, [1.0]),
        ({"w": torch.zeros(2)}, [1.0, -1.0]),
        ({"w": torch.zeros(2)}, [0.0, 0.0]),
    ],
)
def test_average_rejects_mismatches(other: dict, weights: list[float] | None) -> None:
    with pytest.raises(ValueError):
        average_states([{"w": torch.zeros(2)}, other], weights)
    with pytest.raises(ValueError):
        average_states([])


OPTIMIZERS = [
    TrainConfig(lr=0.1),
    TrainConfig(lr=0.1, momentum=0.9),
    TrainConfig(lr=0.05, momentum=0.5, weight_decay=1e-2),
    TrainConfig(optimizer="adam", lr=0.01),
    TrainConfig(optimizer="adam", lr=0.003, weight_decay=1e-3),
]


@pytest.mark.parametrize(
    "cfg", OPTIMIZERS, ids=lambda c: f"{c.optimizer}-m{c.momentum}-wd{c.weight_decay}"
)
def test_the_cpu_optimizer_is_torch_optim_bit_for_bit(cfg: TrainConfig) -> None:
    """Local training's CPU optimizer replays torch.optim's single-tensor updates exactly,
    including a layer that gets no gradient (it stays) and a frozen one."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 3))
    ours[0].bias.requires_grad_(False)
    ref = copy.deepcopy(ours)
    start = ours[2].weight.detach().clone()
    params = [[p for p in m.parameters() if p.requires_grad] for m in (ours, ref)]
    mine = optimizer(params[0], cfg)
    if cfg.optimizer == "adam":
        theirs: torch.optim.Optimizer = torch.optim.Adam(
            params[1], lr=cfg.lr, weight_decay=cfg.weight_decay
        )
    else:
        theirs = torch.optim.SGD(
            params[1], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    for _ in range(6):
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        for model, opt in ((ours, mine), (ref, theirs)):
            for p in model.parameters():
                p.grad = None
            F.cross_entropy(model[2](model[1](model[0](x))), y).backward()  # model[3] unused
            opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours[2].weight, start)  # it trained
