"""Closed-loop test problems of the conformance suite.

Each problem is a deterministic gradient oracle ``grad(x, t)`` over one flat
float64 vector ``x``, plus the shapes into which backends split that vector
(so multi-tensor code paths -- torch's foreach kernels, optax pytrees -- see
several parameters of different ranks, including an empty one).

None is trivial: the optimum is away from the origin (so relative deviations
are well defined), and each exercises a different regime -- ill-conditioning,
a curved valley, minibatch noise, rare huge gradient spikes (the regime
QHAdam's ``nu2 < 1`` is meant for), and matrices (QHMuon's, which steps 2-D
parameters only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from numpy.typing import NDArray

__all__ = ["PROBLEMS", "Problem", "get_problem"]

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Problem:
    """A closed-loop gradient oracle over a flat parameter vector."""

    name: str
    description: str
    x0: F64
    shapes: tuple[tuple[int, ...], ...]
    grad_fn: Callable[[F64, int], F64] = field(repr=False)
    loss_fn: Callable[[F64], float] = field(repr=False)

    def __post_init__(self) -> None:
        if sum(int(np.prod(s)) for s in self.shapes) != self.x0.size:
            raise ValueError(f"{self.name}: shapes do not cover x0")

    def grad(self, x: F64, t: int) -> F64:
        """The gradient the optimizer sees at step ``t`` (0-based) at point ``x``."""
        return self.grad_fn(np.asarray(x, dtype=np.float64), t)

    def loss(self, x: F64) -> float:
        return self.loss_fn(np.asarray(x, dtype=np.float64))

    def split(self, x: F64) -> list[F64]:
        """Split a flat vector into the problem's parameter shapes."""
        out, i = [], 0
        for s in self.shapes:
            n = int(np.prod(s))
            out.append(np.asarray(x[i : i + n]).reshape(s))
            i += n
        return out

    @staticmethod
    def join(parts: list[NDArray[np.generic]]) -> F64:
        """Inverse of :meth:`split` (accepts any real dtype, returns float64)."""
        return np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in parts])


def _quadratic() -> Problem:
    # Ill-conditioned (kappa = 1e3) quadratic with a rotated Hessian.
    rng = np.random.default_rng(0)
    n = 12
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    h = q @ np.diag(np.logspace(0, 3, n)) @ q.T
    x_star = rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)
    x0 = x_star + rng.standard_normal(n)
    return Problem(
        "quadratic",
        "ill-conditioned quadratic, kappa = 1000, rotated Hessian",
        x0,
        ((2, 3), (4,), (0,), (2,)),
        lambda x, t: h @ (x - x_star),
        lambda x: 0.5 * float((x - x_star) @ h @ (x - x_star)),
    )


def _rosenbrock() -> Problem:
    # Chained Rosenbrock in 4-D: a narrow curved valley, minimum at (1, 1, 1, 1).
    def loss(x: F64) -> float:
        return float(np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2))

    def grad(x: F64, t: int) -> F64:
        g = np.zeros_like(x)
        d = x[1:] - x[:-1] ** 2
        g[:-1] += -400.0 * x[:-1] * d - 2.0 * (1.0 - x[:-1])
        g[1:] += 200.0 * d
        return g

    return Problem(
        "rosenbrock",
        "chained Rosenbrock, 4-D, start (-1.2, 1, -1.2, 1)",
        np.array([-1.2, 1.0, -1.2, 1.0]),
        ((2,), (1, 2)),
        grad,
        loss,
    )


def _logistic() -> Problem:
    # Minibatch logistic regression: 256 samples, 8 features + bias, batch 32.
    rng = np.random.default_rng(1)
    n, d, batch = 256, 8, 32
    features = np.hstack([rng.standard_normal((n, d)), np.ones((n, 1))])
    w_true = rng.standard_normal(d + 1) * 2.0
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-features @ w_true))).astype(np.float64)
    l2 = 1e-2  # keeps the optimum finite and away from the origin
    batches = np.random.default_rng(2).integers(0, n, size=(4096, batch))

    def grad(x: F64, t: int) -> F64:
        idx = batches[t % len(batches)]
        f = features[idx]
        p = 1.0 / (1.0 + np.exp(-(f @ x)))
        return np.asarray(f.T @ (p - labels[idx]) / batch + l2 * x)

    def loss(x: F64) -> float:
        z = features @ x
        return float(np.mean(np.logaddexp(0.0, z) - labels * z) + 0.5 * l2 * x @ x)

    return Problem(
        "logistic",
        "minibatch logistic regression, 256 x 9, batch 32, L2 1e-2",
        rng.standard_normal(d + 1) * 0.5,
        ((8,), (1,)),
        grad,
        loss,
    )


def _spiky() -> Problem:
    # Noisy diagonal quadratic whose gradient noise is mostly small with rare
    # huge spikes (1% of entries, x1000): the stream QHAdam's nu2 < 1 tames.
    rng = np.random.default_rng(3)
    n, horizon = 10, 4096
    curvature = np.logspace(-1, 1, n)
    x_star = rng.uniform(0.5, 2.0, n)
    noise = 0.01 * rng.standard_normal((horizon, n))
    spikes = rng.random((horizon, n)) < 0.01
    noise[spikes] *= 1000.0
    x0 = x_star + rng.standard_normal(n)

    return Problem(
        "spiky",
        "diagonal quadratic with heavy-tailed gradient noise (1% spikes x1000)",
        x0,
        ((5, 2),),
        lambda x, t: curvature * (x - x_star) + noise[t % horizon],
        lambda x: 0.5 * float(np.sum(curvature * (x - x_star) ** 2)),
    )


def _matrices() -> Problem:
    # Two matrix least-squares problems, one wide (3 x 5) and one tall (6 x 2,
    # which Newton-Schulz runs transposed): 0.5 * <W - W*, A (W - W*) B> with
    # A, B symmetric positive definite (condition 4 each, 16 together).
    #
    # Muon's update has the same size whatever the gradient's, so its closed
    # loop is stable only while no singular value of the gradient nears zero:
    # there the orthogonalization responds like a sign, and rounding grows
    # from 1e-16 to 1e-2 within tens of steps (measured, starting one unit from
    # W* at lr 0.02) -- no float64 comparison survives that. So the start is far
    # away (W0 - W* has singular values 3 .. 5) and the cases' learning rates
    # (0.01 at most) keep every singular value from zero for their 150 steps;
    # ``tests/test_conformance.py`` checks that margin on the reference.
    rng = np.random.default_rng(4)
    shapes = ((3, 5), (6, 2))

    def spd(n: int) -> F64:
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        return np.asarray(q @ np.diag(np.geomspace(0.5, 2.0, n)) @ q.T)

    def offset(rows: int, columns: int) -> F64:
        k, n = min(rows, columns), max(rows, columns)
        u, _ = np.linalg.qr(rng.standard_normal((n, n)))
        v, _ = np.linalg.qr(rng.standard_normal((k, k)))
        e = u[:, :k] @ np.diag(np.linspace(3.0, 5.0, k)) @ v.T
        return np.asarray(e if rows >= columns else e.T)

    terms = []
    for rows, columns in shapes:
        optimum = rng.uniform(0.5, 1.5, (rows, columns)) * rng.choice([-1.0, 1.0], (rows, columns))
        terms.append((spd(rows), spd(columns), optimum))
    x0 = np.concatenate(
        [(w + offset(*shape)).ravel() for (_, _, w), shape in zip(terms, shapes, strict=True)]
    )

    def matrices(x: F64) -> list[F64]:
        out, i = [], 0
        for rows, columns in shapes:
            out.append(x[i : i + rows * columns].reshape(rows, columns))
            i += rows * columns
        return out

    def grad(x: F64, t: int) -> F64:
        return np.concatenate(
            [(a @ (w - w0) @ b).ravel() for (a, b, w0), w in zip(terms, matrices(x), strict=True)]
        )

    def loss(x: F64) -> float:
        return sum(
            0.5 * float(np.sum((w - w0) * (a @ (w - w0) @ b)))
            for (a, b, w0), w in zip(terms, matrices(x), strict=True)
        )

    return Problem(
        "matrices",
        "two matrix least-squares problems, 3 x 5 and 6 x 2, condition 16, start far away",
        x0,
        shapes,
        grad,
        loss,
    )


# -- full-batch problems of the recovery suite (conformance/recovery.toml) -----------
# Theory-based methods (Robust / Triple Momentum, AccSGD) are parameterized by
# the strong convexity mu and smoothness L, so their quadratic has a known
# spectrum [mu, L] = [1, 100]; all three are deterministic.


def _quadratic_kappa100() -> Problem:
    rng = np.random.default_rng(20190101)
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    a = q @ np.diag(np.geomspace(1.0, 100.0, 6)) @ q.T
    x_star = np.array([3.0, -2.0, 1.5, 4.0, -1.0, 2.5])
    return Problem(
        "quadratic-kappa100",
        "quadratic, spectrum [1, 100] (mu = 1, L = 100), start at 0",
        np.zeros(6),
        ((6,),),
        lambda x, t: a @ (x - x_star),
        lambda x: 0.5 * float((x - x_star) @ a @ (x - x_star)),
    )


def _rosenbrock_2d() -> Problem:
    def grad(x: F64, t: int) -> F64:
        d = x[1] - x[0] ** 2
        return np.array([-2 * (1 - x[0]) - 400 * x[0] * d, 200 * d])

    return Problem(
        "rosenbrock-2d",
        "Rosenbrock, 2-D, start (-1.2, 1)",
        np.array([-1.2, 1.0]),
        ((2,),),
        grad,
        lambda x: float(100 * (x[1] - x[0] ** 2) ** 2 + (1 - x[0]) ** 2),
    )


def _logistic_full_batch() -> Problem:
    # L2-regularized logistic regression (bias column included), 64 samples, 4 features.
    rng = np.random.default_rng(7)
    feats = np.hstack([rng.standard_normal((64, 3)), np.ones((64, 1))])
    labels = (feats @ np.array([1.5, -2.0, 0.5, 1.0]) + rng.standard_normal(64) > 0) * 1.0

    def grad(x: F64, t: int) -> F64:
        p = 1 / (1 + np.exp(-(feats @ x)))
        return np.asarray(feats.T @ (p - labels) / 64 + 0.01 * x)

    def loss(x: F64) -> float:
        z = feats @ x
        return float(np.mean(np.logaddexp(0.0, z) - labels * z) + 0.005 * x @ x)

    return Problem(
        "logistic-full-batch",
        "full-batch logistic regression, 64 x 4, L2 1e-2",
        np.array([0.5, 0.5, -0.5, 0.25]),
        ((4,),),
        grad,
        loss,
    )


_FACTORIES: dict[str, Callable[[], Problem]] = {
    "quadratic": _quadratic,
    "rosenbrock": _rosenbrock,
    "logistic": _logistic,
    "spiky": _spiky,
    "matrices": _matrices,
    "quadratic-kappa100": _quadratic_kappa100,
    "rosenbrock-2d": _rosenbrock_2d,
    "logistic-full-batch": _logistic_full_batch,
}
PROBLEMS = tuple(_FACTORIES)


@cache
def get_problem(name: str) -> Problem:
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise KeyError(f"unknown problem {name!r}; known: {', '.join(PROBLEMS)}") from None
