"""FedFisher (Jhunjhunwala, Wang, Joshi, AISTATS 2024): one-shot Fisher-weighted aggregation.

Each peer trains once, computes the true Fisher F̂_i of its final model w_i on its own data
(``fisher: diag`` or ``kfac``, :mod:`p2pfl.learning.curvature`) and uploads (w_i, F̂_i, n_i) once.
The aggregator minimizes the Laplace surrogate Φ(θ) = ½ Σ_i p_i (θ − w_i)^T F̂_i (θ − w_i)
from the one-shot FedAvg point w̄ = Σ p_i w_i (eqs. 5–7, Lemma 1, Alg. 1), whose gradient is

    diag: F̄ ⊙ θ − b                      with F̄ = Σ p_i f_i,  b = Σ p_i f_i ⊙ w_i
    kfac: Σ_i p_i G_il Θ_l A_il − B_l     per layer, B_l = Σ_i p_i G_il W_il A_il,

for ``steps`` steps of ``server_opt``: ``ref_adam`` is the reference code's "Adam" (App. D.3;
its routine for Diag), m ← g + β1·m, v ← g² + β2·v, θ ← θ − lr·m / (√v + eps) (no (1−β)
factors, no bias correction, eps outside the root); ``ref_adam_root`` puts eps inside the
root, θ ← θ − lr·m / √(v + eps), as the reference code's K-FAC routine does (ten times
smaller steps where |g| ≪ √eps); ``torch_adam`` is torch.optim.Adam with the same lr,
betas and eps; ``gd`` is Lemma 1's θ ← θ − (F̄θ − b)/λ_max (λ_max by power iteration),
which converges to the minimizer of Φ nearest w̄. Candidates are the iterates after every
step t with t % ``val_every`` = 0, and the final one; ``select`` chooses among them (see
:mod:`p2pfl.methods.oneshot`). Tensors the statistics do not cover (buffers) take FedAvg.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, cast

import torch
from torch import Tensor

from p2pfl.core.errors import ConfigError
from p2pfl.learning.curvature import as_matrix, from_matrix
from p2pfl.learning.state import tensor_sum
from p2pfl.methods.base import METHODS
from p2pfl.methods.effects import State
from p2pfl.methods.oneshot import OneShot, Upload, fedavg, shares

Blocks = dict[str, Tensor]
"""θ by block: a parameter tensor (diag) or a layer's g × a matrix (kfac), in float64."""


class Surrogate:
    """Φ's gradient operator for the uploads: ``hess(θ)`` = Σ p_i F̂_i θ, and b."""

    def __init__(self, uploads: list[Upload], fisher: Literal["diag", "kfac"]) -> None:
        p = shares(uploads)
        self.fisher = fisher
        if fisher == "diag":
            self.names = list(uploads[0].stats["diag"])
            self.fbar = {
                n: tensor_sum(
                    pi * u.stats["diag"][n].double() for pi, u in zip(p, uploads, strict=True)
                )
                for n in self.names
            }
            points = [{n: u.state[n].double() for n in self.names} for u in uploads]
        else:
            self.layers = uploads[0].layers["kfac"]
            self.names = list(self.layers)
            self.pg = {
                n: torch.stack(
                    [
                        pi * u.stats["kfac"][f"{n}.G"].double()
                        for pi, u in zip(p, uploads, strict=True)
                    ]
                )
                for n in self.names
            }
            self.a = {
                n: torch.stack([u.stats["kfac"][f"{n}.A"].double() for u in uploads])
                for n in self.names
            }
            points = [
                {n: as_matrix(u.state, info).double() for n, info in self.layers.items()}
                for u in uploads
            ]
        self.start = {
            n: tensor_sum(pi * w[n] for pi, w in zip(p, points, strict=True)) for n in self.names
        }
        if fisher == "diag":
            self.b = {
                n: tensor_sum(
                    pi * u.stats["diag"][n].double() * w[n]
                    for pi, u, w in zip(p, uploads, points, strict=True)
                )
                for n in self.names
            }
        else:
            self.b = {
                n: (self.pg[n] @ torch.stack([w[n] for w in points]) @ self.a[n]).sum(0)
                for n in self.names
            }

    def hess(self, theta: Blocks) -> Blocks:
        if self.fisher == "diag":
            return {n: self.fbar[n] * theta[n] for n in self.names}
        return {n: (self.pg[n] @ theta[n] @ self.a[n]).sum(0) for n in self.names}

    def grad(self, theta: Blocks) -> Blocks:
        h = self.hess(theta)
        return {n: h[n] - self.b[n] for n in self.names}

    def lambda_max(self, iterations: int = 300) -> float:
        """Largest eigenvalue of Σ p_i F̂_i (exact for diag, power iteration for K-FAC)."""
        if self.fisher == "diag":
            return max(float(f.max()) for f in self.fbar.values())
        gen = torch.Generator().manual_seed(0)
        v = {n: torch.randn(t.shape, generator=gen, dtype=torch.float64) for n, t in self.b.items()}
        lam = 0.0
        for _ in range(iterations):
            norm = sum(float((t * t).sum()) for t in v.values()) ** 0.5
            v = {n: t / norm for n, t in v.items()}
            hv = self.hess(v)
            lam = sum(float((hv[n] * v[n]).sum()) for n in self.names)
            v = hv
        return lam

    def to_state(self, theta: Blocks, base: State) -> State:
        out = dict(base)
        for n, t in theta.items():
            parts = {n: t} if self.fisher == "diag" else from_matrix(t, self.layers[n])
            for k, v in parts.items():
                out[k] = v.to(base[k].dtype).contiguous()
        return out


def descend(
    grad: Callable[[Blocks], Blocks],
    theta: Blocks,
    steps: int,
    server_opt: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    every: int,
) -> list[Blocks]:
    """Run ``steps`` steps from ``theta``; return the iterates after each step t with
    t % every = 0 (none when every = 0) and the last one. ``lr`` is η for ``gd``."""
    theta = {n: t.clone() for n, t in theta.items()}
    b1, b2 = betas
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    v = {n: torch.zeros_like(t) for n, t in theta.items()}
    adam = None
    if server_opt == "torch_adam":
        adam = torch.optim.Adam(list(theta.values()), lr=lr, betas=betas, eps=eps)
    out = []
    for t in range(steps):
        g = grad(theta)
        for n, x in theta.items():
            if server_opt.startswith("ref_adam"):
                m[n] = g[n] + b1 * m[n]
                v[n] = g[n] * g[n] + b2 * v[n]
                root = (v[n] + eps).sqrt() if server_opt == "ref_adam_root" else v[n].sqrt() + eps
                x -= lr * m[n] / root
            elif server_opt == "gd":
                x -= lr * g[n]
            else:
                x.grad = g[n]
        if adam is not None:
            adam.step()
        if every and t % every == 0:
            out.append({n: x.clone() for n, x in theta.items()})
    return [*out, theta]


def fedfisher(
    uploads: list[Upload],
    fisher: Literal["diag", "kfac"],
    steps: int = 2000,
    lr: float = 0.01,
    server_opt: str = "ref_adam",
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 0.01,
    every: int = 0,
) -> list[State]:
    """The FedFisher candidates (see the module docstring); the last is the final iterate."""
    phi = Surrogate(uploads, fisher)
    if server_opt == "gd":
        lr = 1.0 / phi.lambda_max()
    iterates = descend(phi.grad, phi.start, steps, server_opt, lr, betas, eps, every)
    base = fedavg(uploads)
    return [phi.to_state(theta, base) for theta in iterates]


@METHODS.register("fedfisher")
@dataclass(kw_only=True, eq=False)
class FedFisher(OneShot):
    """One-shot Fisher-weighted aggregation, diagonal or K-FAC.

    Args:
        fisher: the Fisher approximation: ``diag`` or ``kfac``.
        steps: T, the server's optimisation steps.
        lr: η, the server's step size (``gd`` ignores it: η = 1/λ_max).
        server_opt: the server's optimiser: ``ref_adam`` (the authors' Diag routine),
            ``ref_adam_root`` (ε inside the root, their K-FAC routine), ``torch_adam`` or ``gd``.
        betas: the momentum and second-moment decays of the Adam variants.
        eps: ε added to √v (to v under ``ref_adam_root``; Adam's ε under ``torch_adam``).
        val_every: keep a candidate every this many steps (with ``select: val``).
    """

    fisher: Literal["diag", "kfac"] = "kfac"
    steps: int = 2000
    lr: float = 0.01
    server_opt: Literal["ref_adam", "ref_adam_root", "torch_adam", "gd"] = "ref_adam"
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 0.01
    val_every: int = 100
    baselines: tuple[str, ...] = ("fedavg", "fisher_merge", "regmean")

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError("steps", "must be >= 0")
        if self.lr <= 0:
            raise ConfigError("lr", "must be > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", "must be in [0, 1)")
        if self.eps < 0:
            raise ConfigError("eps", "must be >= 0")
        if self.val_every < 1:
            raise ConfigError("val_every", "must be >= 1")
        super().__post_init__()

    @property
    def label(self) -> str:
        return f"fedfisher_{self.fisher}"

    @property
    def needs(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.fisher,)

    def count(self) -> int:
        return len(range(0, self.steps, self.val_every)) + 1 if self.select == "val" else 1

    def candidates(self, uploads: list[Upload]) -> list[State]:
        every = self.val_every if self.select == "val" else 0
        return fedfisher(
            uploads, self.fisher, self.steps, self.lr, self.server_opt, self.betas, self.eps, every
        )

    def baseline(self, name: str) -> OneShot:
        """The other FedFisher variant keeps this run's server keys."""
        if name.startswith("fedfisher_"):
            fisher = cast(Literal["diag", "kfac"], name.removeprefix("fedfisher_"))
            return replace(self, fisher=fisher, baselines=())
        return super().baseline(name)
