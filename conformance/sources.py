r"""Naive float64 implementations of the algorithms QHM and QHAdam recover.

Each *source* algorithm is written from its **own** original definition -- its
paper's update rule, or for torch-defined optimizers torch's documented
semantics -- and never from the QH conversion formulas of
:mod:`qhoptim.convert`. The recovery suite (:mod:`conformance.recovery`) runs a
source next to QHM / QHAdam with the converted hyperparameters and compares the
trajectories, so a wrong conversion formula (in the paper or in our code) shows
up as a numeric deviation.

Every algorithm is a small frozen dataclass with three methods,

* ``init(x0) -> state`` -- the state before the first step;
* ``point(state) -> x`` -- where the algorithm evaluates the gradient;
* ``update(state, grad) -> state`` -- one step given the gradient at ``point``;

and one generic closed-loop driver, :func:`run`, produces the trajectory of
gradient-evaluation points ``x_0, ..., x_steps``, an array of shape
``(steps + 1, n)``. That sequence is what QHM's iterate :math:`\theta_t`
corresponds to (for SNV, Robust Momentum and Triple Momentum it is the
extrapolated point :math:`y_k`, not the internal state :math:`\xi_k`/:math:`x_k`).

The closed-loop test problems of the recovery suite are defined here too
(:data:`PROBLEMS`), kept separate from the backend conformance problems.
"""

# ruff: noqa: E741  (l is the papers' name: the smoothness constant L, TSO's l)

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "SGD",
    "SOURCES",
    "AccSGD",
    "Adam",
    "AggMo",
    "AnPID",
    "NAdam",
    "RMSprop",
    "RechtPID",
    "RobustMomentum",
    "SynthesizedNesterov",
    "TorchMomentum",
    "TripleMomentum",
    "TwoStateOptimizer",
    "run",
    "run_source",
]

F64 = NDArray[np.float64]
State = dict[str, Any]
GradFn = Callable[[F64, int], F64]  # gradient at x on step t (Problem.grad)


def run(algo: Any, grad_fn: GradFn, x0: F64, steps: int) -> F64:
    """Run ``algo`` closed-loop for ``steps`` steps; return the ``(steps+1, n)`` trajectory.

    Row ``t`` is ``algo.point(state_t)``: the point where step ``t`` evaluates
    the gradient (row 0 is the starting point).
    """
    state = algo.init(np.array(x0, dtype=np.float64))
    traj = [algo.point(state)]
    for t in range(steps):
        state = algo.update(state, grad_fn(traj[-1], t))
        traj.append(algo.point(state))
    return np.stack(traj)


class _Iterate:
    """Mixin for algorithms whose gradient point is the stored iterate ``x``."""

    def point(self, s: State) -> F64:
        return s["x"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------- SGD family
@dataclass(frozen=True)
class SGD(_Iterate):
    """Plain SGD (Robbins & Monro, 1951): ``x <- x - lr * grad``."""

    lr: float

    def init(self, x0: F64) -> State:
        return {"x": x0}

    def update(self, s: State, g: F64) -> State:
        return {"x": s["x"] - self.lr * g}


@dataclass(frozen=True)
class TorchMomentum(_Iterate):
    """Heavy-ball momentum / NAG with ``torch.optim.SGD`` semantics (dampening 0).

    From the ``torch.optim.SGD`` documentation (the Sutskever et al., 2013
    formulation, unnormalized buffer)::

        buf <- g                      on the first step
        buf <- momentum * buf + g     afterwards
        d   <- g + momentum * buf     if nesterov else buf
        x   <- x - lr * d
    """

    lr: float
    momentum: float
    nesterov: bool = False

    def init(self, x0: F64) -> State:
        return {"x": x0, "buf": None}

    def update(self, s: State, g: F64) -> State:
        buf = g.copy() if s["buf"] is None else self.momentum * s["buf"] + g
        d = g + self.momentum * buf if self.nesterov else buf
        return {"x": s["x"] - self.lr * d, "buf": buf}


# --------------------------------------------------------------------------- PID
@dataclass(frozen=True)
class RechtPID(_Iterate):
    r"""PID control optimizer of Recht (2018), as stated in Ma & Yarats (2019), App. B.

    With error :math:`e_t = -\nabla L(\theta_t)` and :math:`e_{-1} = w_{-1} = v_{-1} = 0`::

        v_t = beta * v_{t-1} + (1 - beta) * (e_t - e_{t-1})     (low-pass-filtered D term)
        w_t = w_{t-1} + e_t                                     (I term)
        theta_{t+1} = theta_0 + k_p * e_t + k_i * w_t + k_d * v_t
    """

    k_p: float
    k_i: float
    k_d: float
    beta: float

    def init(self, x0: F64) -> State:
        z = np.zeros_like(x0)
        return {"x": x0, "x0": x0, "e": z, "w": z, "v": z}

    def update(self, s: State, g: F64) -> State:
        e = -g
        v = self.beta * s["v"] + (1 - self.beta) * (e - s["e"])
        w = s["w"] + e
        x = s["x0"] + self.k_p * e + self.k_i * w + self.k_d * v
        return {"x": x, "x0": s["x0"], "e": e, "w": w, "v": v}


@dataclass(frozen=True)
class AnPID(_Iterate):
    r"""PID optimizer of An et al. (2018), CVPR, as stated in Ma & Yarats (2019), App. E.

    An et al.'s integral term :math:`V_{t+1} = \alpha V_t - r g_t` plus :math:`K_d` times a
    filtered difference of gradients :math:`D_{t+1} = \alpha D_t + (1-\alpha)(g_t - g_{t-1})`,
    exactly as App. E restates it (``beta`` is An et al.'s alpha, :math:`e_t = -g_t`,
    :math:`e_{-1} = 0`; App. E notes the D term is the *negated* error derivative)::

        v_t = beta * v_{t-1} - (1 - beta) * (e_t - e_{t-1})     (the *negated* derivative)
        w_t = beta * w_{t-1} + r * e_t
        theta_{t+1} = theta_t + w_t + k_d * v_t
    """

    r: float
    k_d: float
    beta: float

    def init(self, x0: F64) -> State:
        z = np.zeros_like(x0)
        return {"x": x0, "e": z, "w": z, "v": z}

    def update(self, s: State, g: F64) -> State:
        e = -g
        v = self.beta * s["v"] - (1 - self.beta) * (e - s["e"])
        w = self.beta * s["w"] + self.r * e
        return {"x": s["x"] + w + self.k_d * v, "e": e, "w": w, "v": v}


# ------------------------------------------------------------- SNV, RM, TM
@dataclass(frozen=True)
class SynthesizedNesterov:
    r"""Lessard, Recht & Packard (2016), Sec. 6: the three-parameter Nesterov variant.

    In Lessard et al.'s notation (step ``alpha``), with :math:`\xi_{-1} = \xi_0 = x_0`::

        y_k     = xi_k + beta2 * (xi_k - xi_{k-1})              (gradient point)
        xi_{k+1} = xi_k - alpha * grad(y_k) + beta1 * (xi_k - xi_{k-1})

    Ma & Yarats (2019, Sec. 4.3) write ``gamma`` for ``alpha`` and ``theta`` for ``y``.
    """

    alpha: float
    beta1: float
    beta2: float

    def init(self, x0: F64) -> State:
        return {"xi": x0, "xi_prev": x0}

    def point(self, s: State) -> F64:
        return s["xi"] + self.beta2 * (s["xi"] - s["xi_prev"])  # type: ignore[no-any-return]

    def update(self, s: State, g: F64) -> State:
        xi = s["xi"] - self.alpha * g + self.beta1 * (s["xi"] - s["xi_prev"])
        return {"xi": xi, "xi_prev": s["xi"]}


@dataclass(frozen=True)
class RobustMomentum:
    r"""Robust Momentum Method of Cyrus, Hu, Van Scoy & Lessard (2018), ACC.

    For an ``l``-smooth, ``l/kappa``-strongly convex function and a rate
    :math:`\rho \in [1 - 1/\sqrt\kappa, 1 - 1/\kappa]` (default the fast end)::

        alpha = kappa (1 - rho)^2 (1 + rho) / l
        beta  = kappa rho^3 / (kappa - 1)
        gamma = rho^3 / ((kappa - 1) (1 - rho)^2 (1 + rho))
        y_k     = x_k + gamma * (x_k - x_{k-1})                 (gradient point)
        x_{k+1} = x_k + beta * (x_k - x_{k-1}) - alpha * grad(y_k)

    with :math:`x_{-1} = x_0`. The trajectory is :math:`y_k`.
    """

    l: float
    kappa: float
    rho: float | None = None

    def _coefs(self) -> tuple[float, float, float]:
        k = self.kappa
        rho = 1 - 1 / math.sqrt(k) if self.rho is None else self.rho
        alpha = k * (1 - rho) ** 2 * (1 + rho) / self.l
        beta = k * rho**3 / (k - 1)
        gamma = rho**3 / ((k - 1) * (1 - rho) ** 2 * (1 + rho))
        return alpha, beta, gamma

    def init(self, x0: F64) -> State:
        return {"x": x0, "x_prev": x0}

    def point(self, s: State) -> F64:
        gamma = self._coefs()[2]
        return s["x"] + gamma * (s["x"] - s["x_prev"])  # type: ignore[no-any-return]

    def update(self, s: State, g: F64) -> State:
        alpha, beta, _ = self._coefs()
        return {"x": s["x"] + beta * (s["x"] - s["x_prev"]) - alpha * g, "x_prev": s["x"]}


@dataclass(frozen=True)
class TripleMomentum:
    r"""Triple Momentum Method of Van Scoy, Freeman & Lynch (2018), IEEE L-CSS.

    With :math:`\rho = 1 - 1/\sqrt\kappa`, :math:`\alpha = (1+\rho)/L`,
    :math:`\beta = \rho^2/(2-\rho)`, :math:`\gamma = \rho^2/((1+\rho)(2-\rho))`,
    :math:`\delta = \rho^2/(1-\rho^2)` and :math:`\xi_{-1} = \xi_0 = x_0`::

        xi_{k+1} = (1 + beta) xi_k - beta xi_{k-1} - alpha grad(y_k)
        y_k      = (1 + gamma) xi_k - gamma xi_{k-1}            (gradient point)
        x_k      = (1 + delta) xi_k - delta xi_{k-1}            (the method's output)

    The trajectory is :math:`y_k`; the output :math:`x_k` is not QHM's iterate.
    """

    l: float
    kappa: float

    def _coefs(self) -> tuple[float, float, float]:
        rho = 1 - 1 / math.sqrt(self.kappa)
        return (1 + rho) / self.l, rho**2 / (2 - rho), rho**2 / ((1 + rho) * (2 - rho))

    def init(self, x0: F64) -> State:
        return {"xi": x0, "xi_prev": x0}

    def point(self, s: State) -> F64:
        gamma = self._coefs()[2]
        return (1 + gamma) * s["xi"] - gamma * s["xi_prev"]  # type: ignore[no-any-return]

    def update(self, s: State, g: F64) -> State:
        alpha, beta, _ = self._coefs()
        xi = (1 + beta) * s["xi"] - beta * s["xi_prev"] - alpha * g
        return {"xi": xi, "xi_prev": s["xi"]}


# ------------------------------------------------------------------------ AccSGD
@dataclass(frozen=True)
class AccSGD(_Iterate):
    r"""AccSGD of Kidambi, Netrapalli, Jain & Kakade (2018), ICLR, Algorithm 1.

    Written as the authors' public PyTorch ``AccSGD`` optimizer computes it
    (``lr = delta``, ``kappa``, ``xi``, ``smallConst = eps = 0.7``), with
    :math:`\bar w_0 = w_0`::

        a      = 1 - eps^2 xi / kappa                  (Algorithm 1's alpha)
        zeta   = eps / (eps + 1 - a)                   (= kappa / (kappa + eps xi))
        wbar_{t+1} = a wbar_t + (1 - a) (w_t - (kappa delta / eps) grad(w_t))
        w_{t+1}    = zeta (w_t - delta grad(w_t)) + (1 - zeta) wbar_{t+1}

    ``printed=True`` instead runs the update rule *as printed* in Ma & Yarats
    (2019), Sec. 4.4 / App. C.5, which swaps ``a <-> 1 - a`` and
    ``zeta <-> 1 - zeta`` (an erratum; see ``docs/conversions.md``).
    """

    delta: float
    kappa: float
    xi: float
    eps: float = 0.7
    printed: bool = False

    def init(self, x0: F64) -> State:
        return {"x": x0, "wbar": x0}

    def update(self, s: State, g: F64) -> State:
        a = 1 - self.eps**2 * self.xi / self.kappa
        zeta = self.eps / (self.eps + 1 - a)
        if self.printed:
            a, zeta = 1 - a, 1 - zeta
        w = s["x"]
        wbar = a * s["wbar"] + (1 - a) * (w - self.kappa * self.delta / self.eps * g)
        return {"x": zeta * (w - self.delta * g) + (1 - zeta) * wbar, "wbar": wbar}


# --------------------------------------------------------------------------- TSO
@dataclass(frozen=True)
class TwoStateOptimizer(_Iterate):
    r"""General two-state optimizer of Ma & Yarats (2019), App. D.

    ``a_{t+1} = h a_t + k theta_t + l grad``; ``theta_{t+1} = m a_t + q theta_t + z grad``,
    with initial buffer ``a_0 = a0_scale * theta_0 + a0_shift`` (element-wise).
    """

    h: float
    k: float
    l: float
    m: float
    q: float
    z: float
    a0_scale: float = 0.0
    a0_shift: float = 0.0

    def init(self, x0: F64) -> State:
        return {"x": x0, "a": self.a0_scale * x0 + self.a0_shift}

    def update(self, s: State, g: F64) -> State:
        a, x = s["a"], s["x"]
        return {
            "a": self.h * a + self.k * x + self.l * g,
            "x": self.m * a + self.q * x + self.z * g,
        }


# -------------------------------------------------------------------------- AggMo
@dataclass(frozen=True)
class AggMo(_Iterate):
    r"""Aggregated Momentum of Lucas, Sun, Zemel & Grosse (2019), ICLR.

    As Ma & Yarats (2019), App. H write it (and the authors' PyTorch ``AggMo``
    computes it: zero buffers, ``lr / K`` per buffer): ``K = len(betas)``
    unnormalized buffers, one per discount, none merged::

        g_i <- betas[i] * g_i + grad                   for i = 1 .. K   (g_i = 0 initially)
        x   <- x - (lr / K) * sum_i g_i                AggMo (lr a number)
        x   <- x - (1 / K) * sum_i lr[i] * g_i         extended AggMo (lr: one rate per buffer)

    Only arithmetic touches the arrays, so it also runs on JAX arrays (traced
    ``lr`` included); ``benchmarks/aggmo.py`` trains with this class.
    """

    lr: Any  # a number, or a sequence of len(betas) per-buffer rates
    betas: tuple[float, ...]

    def init(self, x0: F64) -> State:
        # 0 * x0: zero buffers of x0's shape and array type (NumPy or JAX).
        return {"x": x0, "bufs": tuple(0 * x0 for _ in self.betas)}

    def update(self, s: State, g: F64) -> State:
        k = len(self.betas)
        rates = tuple(self.lr) if isinstance(self.lr, (tuple, list)) else (self.lr,) * k
        bufs = tuple(b * buf + g for b, buf in zip(self.betas, s["bufs"], strict=True))
        step = sum(r * buf for r, buf in zip(rates, bufs, strict=True)) / k
        return {"x": s["x"] - step, "bufs": bufs}


# ----------------------------------------------------------------- Adam family
@dataclass(frozen=True)
class Adam(_Iterate):
    r"""Adam of Kingma & Ba (2015), Algorithm 1 (``eps`` after the square root)::

        m_t = b1 m_{t-1} + (1 - b1) g;  v_t = b2 v_{t-1} + (1 - b2) g^2
        x_t = x_{t-1} - lr * (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)

    with :math:`m_0 = v_0 = 0` and ``t`` counting from 1.
    """

    lr: float
    betas: tuple[float, float]
    eps: float

    def init(self, x0: F64) -> State:
        return {"x": x0, "t": 0, "m": np.zeros_like(x0), "v": np.zeros_like(x0)}

    def update(self, s: State, g: F64) -> State:
        (b1, b2), t = self.betas, s["t"] + 1
        m = b1 * s["m"] + (1 - b1) * g
        v = b2 * s["v"] + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        return {"x": s["x"] - self.lr * mhat / (np.sqrt(vhat) + self.eps), "t": t, "m": m, "v": v}


@dataclass(frozen=True)
class NAdam(_Iterate):
    r"""NAdam of Dozat (2016), Algorithm 2, with a constant momentum schedule ``mu_t = b1``::

        m_t = b1 m_{t-1} + (1 - b1) g;  n_t = b2 n_{t-1} + (1 - b2) g^2
        mbar_t = (1 - b1) g / (1 - b1^t) + b1 m_t / (1 - b1^{t+1});  nhat_t = n_t / (1 - b2^t)
        x_t = x_{t-1} - lr * mbar_t / (sqrt(nhat_t) + eps)

    ``bias_correction=False`` drops all three corrections (denominators become 1).
    """

    lr: float
    betas: tuple[float, float]
    eps: float
    bias_correction: bool = True

    def init(self, x0: F64) -> State:
        return {"x": x0, "t": 0, "m": np.zeros_like(x0), "n": np.zeros_like(x0)}

    def update(self, s: State, g: F64) -> State:
        (b1, b2), t = self.betas, s["t"] + 1
        m = b1 * s["m"] + (1 - b1) * g
        n = b2 * s["n"] + (1 - b2) * g * g
        c1, c1n, c2 = (
            (1 - b1**t, 1 - b1 ** (t + 1), 1 - b2**t) if self.bias_correction else (1, 1, 1)
        )
        mbar = (1 - b1) * g / c1 + b1 * m / c1n
        x = s["x"] - self.lr * mbar / (np.sqrt(n / c2) + self.eps)
        return {"x": x, "t": t, "m": m, "n": n}


@dataclass(frozen=True)
class RMSprop(_Iterate):
    r"""RMSProp (Tieleman & Hinton, 2012) with ``torch.optim.RMSprop`` semantics.

    Not centered, no momentum: ``s = alpha s + (1 - alpha) g^2``;
    ``x = x - lr g / (sqrt(s) + eps)`` (no bias correction).
    """

    lr: float
    alpha: float
    eps: float

    def init(self, x0: F64) -> State:
        return {"x": x0, "s": np.zeros_like(x0)}

    def update(self, s: State, g: F64) -> State:
        sq = self.alpha * s["s"] + (1 - self.alpha) * g * g
        return {"x": s["x"] - self.lr * g / (np.sqrt(sq) + self.eps), "s": sq}


SOURCES: dict[str, Callable[..., Any]] = {
    "sgd": SGD,
    "momentum": TorchMomentum,
    "nesterov": lambda **p: TorchMomentum(**p, nesterov=True),
    "pid": RechtPID,
    "an_pid": AnPID,
    "snv": SynthesizedNesterov,
    "robust_momentum": RobustMomentum,
    "triple_momentum": TripleMomentum,
    "accsgd": AccSGD,
    "two_state": TwoStateOptimizer,
    "aggmo": AggMo,
    "adam": Adam,
    "nadam": NAdam,
    "rmsprop": RMSprop,
}


def run_source(name: str, grad_fn: GradFn, x0: F64, steps: int, **params: Any) -> F64:
    """``run_<name>``: build source ``name`` from ``params`` and run it closed-loop."""
    for key in ("betas", "lr"):
        if isinstance(params.get(key), list):
            params[key] = tuple(params[key])
    return run(SOURCES[name](**params), grad_fn, x0, steps)
