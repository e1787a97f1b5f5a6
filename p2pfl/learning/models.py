"""Model builders, FLOP counting and model-state helpers.

A model builder is ``fn(input_shape, num_classes, *, <keys>) -> nn.Module`` registered in
:data:`MODELS`; its keyword arguments are the keys of the YAML ``model:`` section (see
:mod:`p2pfl.core.options`). Builders create their modules on the CPU, where model state lives
between a peer's turns.

The small models (``mlp``, ``lenet``, ``cnn3``, ``cnn_s``) are built from :class:`Hidden`
layers, so every hidden non-linearity sits in one place per layer (``Hidden.act``), after
the layer and its normalisation. Every builder also takes the ``pans`` key: position-aware
neurons (:mod:`p2pfl.learning.pans`), a fixed encoding on the output of each hidden layer's
normalisation, right before its activation (:func:`hidden_units` lists those points; the
output layer is a bare ``nn.Linear`` and never gets one).
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry, bind, bind_with_common
from p2pfl.learning.pans import Pans, encode

InputShape = tuple[int, ...]
"""The shape of one sample: (channels, height, width) for images; other workloads have others."""
MAX_PARAMETERS = 1 << 30  # 4 GiB of float32 per copy; ResNet-18 has 11 million

MODELS: Registry[Callable[..., nn.Module]] = Registry("model")


class Hidden(nn.Module):
    """One hidden layer: ``layer`` → ``norm`` → ``act`` → ``pool``.

    ``act`` is the layer's only non-linearity; the output of ``norm`` is the layer's
    pre-activation, where a position encoding (PANs) goes. Missing parts are
    ``nn.Identity`` so the forward pass stays uniform and adds no state.
    """

    def __init__(
        self, layer: nn.Module, norm: nn.Module | None = None, pool: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.norm = nn.Identity() if norm is None else norm
        self.act = nn.ReLU()
        self.pool = nn.Identity() if pool is None else pool

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.act(self.norm(self.layer(x))))


class MaxPool2x2(nn.Module):
    """``nn.MaxPool2d(2)`` with the same outputs and gradients, bit for bit, in a third to a
    half of its time on a CPU. There torch's kernel for contiguous (NCHW) batches compares
    one window at a time, with branches: 430 µs of a 1.6 ms LeNet step (28×28, batch 32, one
    core). Its channels-last kernel compares a vector of channels at once, so the batch's
    feature maps are handed to it as the channels of one image, a cache-sized slice at a
    time; the gradient goes back through the NCHW kernel with the same indices
    (docs/performance.md). Inputs under 65,536 elements (LeNet's second pool, 8×8 digits)
    go to torch's kernel, whose fixed cost is lower."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or x.dim() != 4 or x.numel() < _POOL_MIN:
            return F.max_pool2d(x, 2)
        return _ChannelsLastMaxPool.apply(x)[0]


_POOL_MIN = 1 << 16
"""The smallest input pooled through the channels-last kernel: from 64 samples' 16×8×8 maps
up it was faster every time (1.7-2.5×, forward and backward); at half that, slower (its
fixed cost is about 35 µs higher)."""
_POOL_SLICE = 1 << 16
"""Elements of the feature maps pooled at a time (256 KiB of float32): the transposes to
and from channels-last stay in the cache (whole batches of Fashion-MNIST CNN maps ran
slower than torch's own kernel)."""


class _ChannelsLastMaxPool(torch.autograd.Function):
    """2×2 max-pooling of a CPU batch ``[N, C, H, W]`` through the channels-last kernel;
    returns the output and the indices ``nn.MaxPool2d(2, return_indices=True)`` would. Its
    vmap rule folds the mapped dimension into the batch (``torch.func`` stacks peers)."""

    @staticmethod
    def forward(x: Tensor) -> tuple[Tensor, Tensor]:
        n, c, h, w = x.shape
        maps = x.reshape(n * c, h, w)
        out = x.new_empty(n * c, h // 2, w // 2)
        idx = torch.empty(out.shape, dtype=torch.long, device=x.device)
        step = max(1, _POOL_SLICE // (h * w))
        for i in range(0, n * c, step):
            part = maps[i : i + step].unsqueeze(0).contiguous(memory_format=torch.channels_last)
            out[i : i + step], idx[i : i + step] = F.max_pool2d(part, 2, return_indices=True)
        return out.reshape(n, c, h // 2, w // 2), idx.reshape(n, c, h // 2, w // 2)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: tuple[Tensor, Tensor]) -> None:
        ctx.save_for_backward(inputs[0], output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Tensor) -> Tensor:
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx
        )

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int], x: Tensor) -> tuple[Any, tuple[int, int]]:
        stacked = x.movedim(in_dims[0], 0)
        out, idx = _ChannelsLastMaxPool.apply(stacked.flatten(0, 1))
        k = stacked.shape[0]
        return (out.unflatten(0, (k, -1)), idx.unflatten(0, (k, -1))), (0, 0)


def _probe(model: nn.Module, input_shape: InputShape) -> Tensor:
    """Run one all-zero sample through ``model`` in eval mode, without touching its state.

    Eval mode keeps BatchNorm running statistics unchanged; the previous mode is restored.
    A model on the meta device (:func:`build_model` sizes one there) runs on the CPU with
    zeros for its weights, once its size is checked: torch's meta kernels for convolutions
    and activations are Python that imports torch's compiler and sympy, about 1 s and
    150 MiB in every process that builds a convolutional model.
    """
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    dtype = getattr(model, "input_dtype", dtype)  # token models take int64 ids
    forward: Callable[[Tensor], Tensor] = model
    if device.type == "meta":
        _check_size(model, part=True)
        device = torch.device("cpu")
        zeros = {
            name: torch.zeros(t.shape, dtype=t.dtype, device=device)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        }
        forward = lambda x: torch.func.functional_call(model, zeros, (x,))  # noqa: E731
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return forward(torch.zeros(1, *input_shape, device=device, dtype=dtype))
    finally:
        model.train(was_training)


def _flat_size(features: nn.Module, input_shape: InputShape) -> int:
    """Number of features ``features`` produces for one sample (the flatten size)."""
    try:
        return _probe(features, input_shape)[0].numel()
    except RuntimeError as e:  # a conv or pool with an input smaller than its kernel
        raise ConfigError("name", f"input shape {input_shape} is too small for this model") from e


def _check_positive(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(key, f"must be positive, got {value}")


def _auto_padding(padding: int | None, input_shape: InputShape, min_side: int, pad: int) -> int:
    """``padding`` if given, else 0 when the input is at least ``min_side`` pixels a side
    (the published, unpadded network fits) and ``pad`` otherwise (tiny inputs such as 8×8
    digits)."""
    if padding is not None:
        if padding < 0:
            raise ConfigError("padding", f"must be >= 0, got {padding}")
        return padding
    return 0 if min(input_shape[1:]) >= min_side else pad


@MODELS.register("mlp")
def mlp(
    input_shape: InputShape,
    num_classes: int,
    *,
    hidden: tuple[int, ...] = (200,),
    bias: bool = True,
) -> nn.Module:
    """Flatten → (Linear → ReLU) per ``hidden`` size → Linear to the classes.

    FedELMY's CPU-scale MLP is 784-200-10; MA-Echo uses ``hidden: [400, 200, 100]`` with
    ``bias: false``. An empty ``hidden`` list gives logistic regression.

    Args:
        hidden: the hidden layers' widths, input side first (``[]``: logistic regression).
        bias: false makes every linear layer bias-free (MA-Echo's MLP).
    """
    for size in hidden:
        if size <= 0:
            raise ConfigError("hidden", f"sizes must be positive, got {list(hidden)}")
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    width = math.prod(input_shape)  # images [C, H, W], signals [C, L], feature vectors [D]
    for i, size in enumerate(hidden, 1):
        layers[f"fc{i}"] = Hidden(nn.Linear(width, size, bias=bias))
        width = size
    layers["out"] = nn.Linear(width, num_classes, bias=bias)
    return nn.Sequential(layers)


@MODELS.register("logreg")
def logreg(input_shape: InputShape, num_classes: int, *, bias: bool = True) -> nn.Module:
    """Multinomial logistic regression: flatten → Linear to the classes (``mlp`` with
    ``hidden: []``; the same state keys). MNIST-1D's linear baseline (Greydanus 2020) and
    FedProx's model on Synthetic(α, β) (Li et al. 2020, §5.1).

    Args:
        bias: the linear layer has a bias.
    """
    return mlp(input_shape, num_classes, hidden=(), bias=bias)


@MODELS.register("cnn1d")
def cnn1d(input_shape: InputShape, num_classes: int, *, channels: int = 25) -> nn.Module:
    """MNIST-1D's reference CNN (Greydanus 2020, ``ConvBase``) for signals ``[C, L]``:
    conv1d k5 stride 2 pad 1 (C→c), conv1d k3 s2 p1 (c→c) twice, each with ReLU, then
    flatten → Linear to the classes (125 → 10 for length 40 with 25 channels, 5,210
    parameters).

    Args:
        channels: the convolutions' channels (25 in the reference).
    """
    _check_positive("channels", channels)
    if len(input_shape) != 2:
        raise ConfigError("name", f"cnn1d takes signals [C, L], got input shape {input_shape}")
    net = nn.Sequential(
        OrderedDict(
            conv1=Hidden(nn.Conv1d(input_shape[0], channels, 5, stride=2, padding=1)),
            conv2=Hidden(nn.Conv1d(channels, channels, 3, stride=2, padding=1)),
            conv3=Hidden(nn.Conv1d(channels, channels, 3, stride=2, padding=1)),
            flatten=nn.Flatten(),
        )
    )
    net.add_module("out", nn.Linear(_flat_size(net, input_shape), num_classes))
    return net


@MODELS.register("lenet")
def lenet(
    input_shape: InputShape,
    num_classes: int,
    *,
    bias: bool = True,
    padding: int | None = None,
    channels: tuple[int, int] = (6, 16),
    fc: tuple[int, int] = (120, 84),
) -> nn.Module:
    """LeNet-5 style: conv5 C→6, ReLU, pool2; conv5 6→16, ReLU, pool2; fc →120 →84 →classes.
    ``channels: [32, 64], fc: [512, 128], bias: false`` is the CNN of FedMA (Wang et al.
    2020) that FedFisher uses on SVHN and CIFAR-10 (§5: 939,616 parameters for 32×32).

    ``padding`` applies to both convs. By default (null) it is 0 for inputs of 16 pixels a
    side or more, which gives the papers' networks: FedFisher's bias-free FMNIST LeNet
    (28×28, fc 256→120, 44,190 parameters) and FedELMY's ``SimpleCNN`` (32×32, fc 400→120);
    smaller inputs (8×8 digits) get padding 2 so the convs still fit. ``bias: false`` makes
    every conv and linear layer bias-free, as in FedFisher.

    Args:
        bias: false makes every conv and linear layer bias-free (FedFisher's LeNet).
        padding: the padding of both convolutions (null: 0 for inputs of 16 pixels a side or more,
            else 2).
        channels: the two convolutions' output channels.
        fc: the two hidden linear layers' widths.
    """
    for key, sizes in (("channels", channels), ("fc", fc)):
        for size in sizes:
            _check_positive(key, size)
    (c1, c2), (f1, f2) = channels, fc
    pad = _auto_padding(padding, input_shape, min_side=16, pad=2)
    net = nn.Sequential(
        OrderedDict(
            conv1=Hidden(
                nn.Conv2d(input_shape[0], c1, 5, padding=pad, bias=bias), pool=MaxPool2x2()
            ),
            conv2=Hidden(nn.Conv2d(c1, c2, 5, padding=pad, bias=bias), pool=MaxPool2x2()),
            flatten=nn.Flatten(),
        )
    )
    width = _flat_size(net, input_shape)
    net.add_module("fc1", Hidden(nn.Linear(width, f1, bias=bias)))
    net.add_module("fc2", Hidden(nn.Linear(f1, f2, bias=bias)))
    net.add_module("out", nn.Linear(f2, num_classes, bias=bias))
    return net


@MODELS.register("cnn3")
def cnn3(
    input_shape: InputShape,
    num_classes: int,
    *,
    width: int = 128,
    padding: int | None = None,
) -> nn.Module:
    """FedELMY's "three-layer CNN" (``CNNCifar``): three conv3×3 (C→w→w→w) with ReLU, a
    max-pool after the first two, then fc → classes. Biases, no BN.

    ``padding`` applies to all three convs. By default (null) it is 0, the paper's network
    (fc 2048 for 32×32 with w = 128, 1152 for 28×28), for inputs of 18 pixels a side or
    more, and 1 for smaller ones (8×8 digits: fc w·2·2) so the convs still fit.

    Args:
        width: w, the channels of each of the three convolutions.
        padding: the padding of the three convolutions (null: 0 for inputs of 18 pixels a side or
            more, else 1).
    """
    _check_positive("width", width)
    pad = _auto_padding(padding, input_shape, min_side=18, pad=1)
    net = nn.Sequential(
        OrderedDict(
            conv1=Hidden(nn.Conv2d(input_shape[0], width, 3, padding=pad), pool=MaxPool2x2()),
            conv2=Hidden(nn.Conv2d(width, width, 3, padding=pad), pool=MaxPool2x2()),
            conv3=Hidden(nn.Conv2d(width, width, 3, padding=pad)),
            flatten=nn.Flatten(),
        )
    )
    net.add_module("out", nn.Linear(_flat_size(net, input_shape), num_classes))
    return net


@MODELS.register("cnn_s")
def cnn_s(input_shape: InputShape, num_classes: int) -> nn.Module:
    """A small CNN with BatchNorm, ours, for checking BatchNorm handling (docs/fedelmy.md):
    conv5 C→8 (pad 2), BN, ReLU, pool2; conv5 8→16 (pad 2), BN, ReLU, pool2; fc → classes
    (784 inputs for 28×28)."""

    def block(cin: int, cout: int) -> Hidden:
        return Hidden(nn.Conv2d(cin, cout, 5, padding=2), nn.BatchNorm2d(cout), MaxPool2x2())

    net = nn.Sequential(
        OrderedDict(conv1=block(input_shape[0], 8), conv2=block(8, 16), flatten=nn.Flatten())
    )
    net.add_module("out", nn.Linear(_flat_size(net, input_shape), num_classes))
    return net


_GROUPS = 2
"""GroupNorm groups for ``resnet18(norm="group")``: 2, as in Hsieh et al. (2020), the usual
BatchNorm replacement in non-iid FL; it divides every ResNet-18 width."""


@MODELS.register("resnet18")
def resnet18(
    input_shape: InputShape,
    num_classes: int,
    *,
    norm: Literal["bn", "group", "none"] = "bn",
) -> nn.Module:
    """torchvision ResNet-18 (random init, nothing downloaded) in its CIFAR form: a 3×3
    stride-1 stem taking C input channels and no max-pool, as in FedELMY's code.

    ``norm`` picks BatchNorm, GroupNorm (2 groups) or none (``nn.Identity``; FedFisher's
    ResNet has no BN). Position encodings (``pans``) go on each block's norm outputs:
    after BN1 and BN2 and after a projection shortcut's BN, none on the stem.

    Args:
        norm: the normalisation layers: ``bn`` (BatchNorm), ``group`` (GroupNorm, 2 groups) or
            ``none``.
    """
    # Imported here: torchvision doubles the import time and only ResNets need it.
    from torchvision.models import resnet18 as tv_resnet18

    layers: dict[str, Callable[[int], nn.Module]] = {
        "bn": nn.BatchNorm2d,
        "group": lambda c: nn.GroupNorm(_GROUPS, c),
        "none": lambda c: nn.Identity(),
    }
    norm_layer = layers[norm]
    model = tv_resnet18(weights=None, num_classes=num_classes, norm_layer=norm_layer)
    model.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def _width(layer: nn.Module) -> int:
    if isinstance(layer, nn.Linear):
        return layer.out_features
    assert isinstance(layer, (nn.Conv1d, nn.Conv2d))
    return layer.out_channels


def hidden_units(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """Each hidden layer's pre-activation point: the module whose output it is, and its
    number of units (features or channels), by name.

    That is every :class:`Hidden` layer's ``norm`` (named by the layer), and in ResNets each
    basic block's ``bn1``, ``bn2`` and projection-shortcut norm (named by their path); the
    stem and the output layer are not hidden units (PANs paper, App. B and Fig. 13; no
    encoding on the stem, as in the authors' ResNet code).
    """
    # A ResNet was built by torchvision, so it is imported; other models need not load it.
    resnet = sys.modules.get("torchvision.models.resnet")
    units: dict[str, tuple[nn.Module, int]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Hidden):
            units[name] = (m.norm, _width(m.layer))
        elif resnet is not None and isinstance(m, resnet.BasicBlock):
            units[f"{name}.bn1"] = (m.bn1, _width(m.conv1))
            units[f"{name}.bn2"] = (m.bn2, _width(m.conv2))
            if m.downsample is not None:
                units[f"{name}.downsample.1"] = (m.downsample[1], _width(m.downsample[0]))
    return units


def _model_keys(*, pans: dict | None = None) -> None:
    """The keys every model takes besides its builder's (see :class:`Pans`).

    Args:
        pans: position-aware neurons: ``{mode, T, A}`` (see ``model.pans``); off by default.
    """


def resolve_model(options: dict) -> dict[str, Any]:
    """Check a ``model:`` mapping (``name``, its builder's keys, ``pans``) and return it with
    every default filled in."""
    if "name" not in options:
        raise ConfigError("name", f"missing; choose one of: {', '.join(MODELS.names())}")
    fn = MODELS.get(options["name"])
    rest = {k: v for k, v in options.items() if k != "name"}
    own, common = bind_with_common(fn, _model_keys, rest, skip=2)
    pans = dict(common["pans"] or {})
    if pans.get("mode") is False:  # YAML 1.1 reads a bare ``off`` as false
        pans["mode"] = "off"
    try:
        resolved = asdict(Pans(**bind(Pans, pans)))
    except ConfigError as e:
        raise e.within("pans") from None
    return {"name": options["name"]} | own | {"pans": resolved}


def build_model(
    options: dict, input_shape: InputShape, num_classes: int, input_dtype: torch.dtype | None = None
) -> nn.Module:
    """Build the model described by the YAML ``model:`` mapping (``name`` plus its keys),
    checked against the data's ``input_dtype`` if given (:func:`model_builder`)."""
    return model_builder(options, input_shape, num_classes, input_dtype)()


def model_builder(
    options: dict,
    input_shape: InputShape,
    num_classes: int,
    input_dtype: torch.dtype | None = None,
) -> Callable[[], nn.Module]:
    """A function that builds the model of ``options``, checked once here: its keys, its
    size (on the meta device: a typo must not allocate 256 GB) and that it takes the
    data's kind of input (``input_dtype``, if given: float images and signals, or int64
    tokens, which builders marked :func:`token_model` take). A trainer
    builds its model again for each seed and device, and the checks cost 3-4 times the
    build of a small MLP (366 µs against 88 µs for the digits MLP)."""
    keys = resolve_model(options)
    name = keys.pop("name")
    fn = MODELS.get(name)
    pans = Pans(**keys.pop("pans"))
    shape = tuple(input_shape)

    def build() -> nn.Module:
        model = fn(shape, num_classes, **keys)
        try:
            encode(hidden_units(model).values(), pans)
        except ConfigError as e:
            raise e.within("pans") from None
        return model

    tokens = input_dtype is not None and not input_dtype.is_floating_point
    takes = takes_tokens(fn)
    if input_dtype is not None and takes != tokens:
        data = f"token windows {list(shape)} (int64)" if tokens else f"float samples {list(shape)}"
        wanted = "token windows (int64, e.g. dataset shakespeare)" if takes else "float inputs"
        hint = "char_lstm or char_transformer" if tokens else "an image or signal model"
        raise ConfigError("name", f"{name} takes {wanted} but the dataset gives {data}; use {hint}")
    if takes and pans.mode != "off":
        raise ConfigError(
            "pans", f"{name} has no hidden Linear or Conv units to encode; use mode: off"
        )
    with torch.device("meta"):
        _check_size(fn(shape, num_classes, **keys))
    return build


def token_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Mark a model builder whose models take int64 token ids ``[n, seq_len]`` (text) and
    set ``input_dtype = torch.long`` on their class; others take float samples."""
    fn.takes_tokens = True  # type: ignore[attr-defined]
    return fn


def takes_tokens(fn: Callable[..., nn.Module]) -> bool:
    """Whether the builder ``fn`` was marked with :func:`token_model`."""
    return bool(getattr(fn, "takes_tokens", False))


def _check_size(model: nn.Module, part: bool = False) -> None:
    """Refuse a model over :data:`MAX_PARAMETERS` (``part``: a part of one, so the whole has
    at least as many) before anything of it is allocated."""
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        more = " or more" if part else ""
        raise ConfigError("", f"has {size:,} parameters{more}; the limit is {MAX_PARAMETERS:,}")


def forward_flops(model: nn.Module, input_shape: InputShape) -> int:
    """FLOPs of one forward pass for one sample, for the simulator's compute-time model.

    A module with a ``flops(inputs, output)`` method adds what it returns (recurrent and
    attention layers: :mod:`p2pfl.learning.sequence`). Counts Linear (2·in·out per output
    row), Conv2d (2·(Cin/groups)·kh·kw per output element) and Conv1d (2·(Cin/groups)·k per
    output element) layers with forward hooks on a dummy input; bias adds, activations,
    norms, pooling and residual additions are ignored (a few percent at most for these
    models).
    """
    total = 0

    def count(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        nonlocal total
        if callable(getattr(module, "flops", None)):
            total += module.flops(inputs, output)  # type: ignore[operator]
        if isinstance(module, nn.Linear):
            total += 2 * module.in_features * output.numel()
        elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
            kernel = math.prod(module.kernel_size)
            total += 2 * (module.in_channels // module.groups) * kernel * output.numel()

    handles = [
        m.register_forward_hook(count)
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) or callable(getattr(m, "flops", None))
    ]
    try:
        _probe(model, input_shape)
    finally:
        for handle in handles:
            handle.remove()
    return total


Layer = tuple[str, str | None]
"""The state keys of one Linear layer: (weight, bias or None)."""


def mlp_layers(module: nn.Module) -> list[Layer] | None:
    """The Linear layers of an MLP (Flatten, then Linear+ReLU blocks, then a Linear), in
    order; ``None`` for any other architecture (convolutions, norms, other activations) and
    for modules with forward hooks (e.g. position-aware neurons), which change the function."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in module.modules()):
        return None
    children = list(module.named_children()) if isinstance(module, nn.Sequential) else []
    if not children or not isinstance(children[0][1], nn.Flatten):
        return None
    layers: list[Layer] = []
    for i, (name, child) in enumerate(children[1:], 1):
        last = i == len(children) - 1
        if last and type(child) is nn.Linear:
            prefix, linear = name, child
        elif (
            not last
            and type(child) is Hidden
            and type(child.layer) is nn.Linear
            and type(child.norm) is nn.Identity
            and type(child.act) is nn.ReLU
            and type(child.pool) is nn.Identity
        ):
            prefix, linear = f"{name}.layer", child.layer
        else:
            return None
        bias = f"{prefix}.bias" if linear.bias is not None else None
        layers.append((f"{prefix}.weight", bias))
    return layers
