"""Float64 NumPy reference implementations of QHM, QHAdam, QHAdamW and QHMuon.

These are the oracle of the conformance suite: every backend's trajectory is
compared with them. They are deliberately plain -- one parameter array at a
time, no in-place tricks -- and take all their math from :mod:`qhoptim.rules`.

They are also usable directly, e.g. to prototype on small NumPy problems::

    >>> import numpy as np
    >>> from qhoptim.reference import QHM
    >>> opt = QHM(lr=1.0, momentum=0.999, nu=0.7)
    >>> theta = np.array([1.0, -2.0])
    >>> state = opt.init(theta)
    >>> theta, state = opt.step(theta, 2 * theta, state)   # gradient of |theta|^2
    >>> theta
    array([ 0.3986, -0.7972])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from qhoptim import rules, validation

__all__ = [
    "NUMPY_MATRIX_OPS",
    "QHM",
    "QHAdam",
    "QHAdamState",
    "QHAdamW",
    "QHMState",
    "QHMuon",
    "QHMuonState",
]

Array = NDArray[np.floating] | NDArray[np.complexfloating]


def _as64(x: object) -> Array:
    a = np.asarray(x)
    return a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)


# |x|**2 of the reference's real and complex arrays
_abs_sq = functools.partial(rules.abs_square, conj=np.conj, real=np.real)


#: :func:`qhoptim.rules.newton_schulz`'s matrix operations on NumPy arrays.
NUMPY_MATRIX_OPS = rules.MatrixOps(
    matmul=np.matmul,
    matmul_add=lambda c, a, b, beta, alpha: beta * c + alpha * (a @ b),
    transpose=np.transpose,
    norm=np.linalg.norm,
    clamp_min=max,
)


class QHMState(NamedTuple):
    """QHM's state: the normalized momentum buffer ``g``."""

    momentum_buffer: Array


class QHMuonState(NamedTuple):
    """QHMuon's state: the normalized momentum buffer and the step count (which
    only the bias-corrected form reads)."""

    momentum_buffer: Array
    step: int = 0


class QHAdamState(NamedTuple):
    """QHAdam's state: the step count, both moment EWMAs and, with ``amsgrad``, the
    running maximum of the (uncorrected) second moment (``None`` without it)."""

    step: int
    exp_avg: Array
    exp_avg_sq: Array
    max_exp_avg_sq: Array | None = None


@dataclass(frozen=True)
class QHM:
    """Quasi-hyperbolic momentum (Ma & Yarats, 2019), float64 reference.

    Args:
      lr: the learning rate ``alpha``.
      momentum: ``beta``, discount factor of the normalized momentum buffer.
      nu: immediate discount factor (any finite real).
      weight_decay: ``lambda``.
      decoupled_weight_decay: ``False`` adds ``lambda * theta`` to the gradient
        (L2); ``True`` multiplies ``theta`` by ``1 - lr * lambda`` before the step.
    """

    lr: float
    momentum: float = 0.999
    nu: float = 0.7
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        validation.check_qhm(
            lr=self.lr, momentum=self.momentum, nu=self.nu, weight_decay=self.weight_decay
        )

    def init(self, param: object) -> QHMState:
        return QHMState(np.zeros_like(_as64(param)))

    def step(
        self, param: object, grad: object, state: QHMState, lr: float | None = None
    ) -> tuple[Array, QHMState]:
        """Return ``(theta_{t+1}, state_{t+1})``; ``lr`` overrides ``self.lr`` (schedules)."""
        lr = self.lr if lr is None else validation.check_lr(lr)
        theta, g = _as64(param), _as64(grad)
        g, decay = rules.weight_decay_terms(
            g, theta, lr=lr, weight_decay=self.weight_decay, decoupled=self.decoupled_weight_decay
        )
        buf, direction = rules.qhm_update(
            g, state.momentum_buffer, momentum=self.momentum, nu=self.nu
        )
        return rules.apply_update(theta, direction, lr, decay), QHMState(buf)


@dataclass(frozen=True)
class QHAdam:
    """QHAdam (Ma & Yarats, 2019), float64 reference.

    Args:
      lr: the learning rate ``alpha``.
      betas: ``(beta1, beta2)``, discount factors of the two moment EWMAs.
      nus: ``(nu1, nu2)``, immediate discount factors; ``(1, 1)`` is Adam.
      eps: added to the denominator after the square root.
      weight_decay: ``lambda``.
      decoupled_weight_decay: ``False`` is L2 decay through the gradient,
        ``True`` is AdamW-style decoupled decay.
      amsgrad: the AMSGrad variant (:func:`qhoptim.rules.qhadam_amsgrad_update`):
        the denominator reads the running maximum of the uncorrected second
        moment, bias-corrected by the current step, as ``torch.optim.Adam``.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    nus: tuple[float, float] = (1.0, 1.0)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    amsgrad: bool = False

    def __post_init__(self) -> None:
        validation.check_bool(self.amsgrad, "amsgrad")
        beta1, beta2 = validation.check_pair(self.betas, "betas")
        nu1, nu2 = validation.check_pair(self.nus, "nus")
        validation.check_qhadam(
            lr=self.lr,
            beta1=beta1,
            beta2=beta2,
            nu1=nu1,
            nu2=nu2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            names={"beta1": "betas[0]", "beta2": "betas[1]", "nu1": "nus[0]", "nu2": "nus[1]"},
        )

    def init(self, param: object) -> QHAdamState:
        theta = _as64(param)
        zeros = np.zeros(theta.shape, np.float64)
        return QHAdamState(0, np.zeros_like(theta), zeros, zeros.copy() if self.amsgrad else None)

    def step(
        self,
        param: object,
        grad: object,
        state: QHAdamState,
        lr: float | None = None,
        *,
        bias_correction: bool = True,
    ) -> tuple[Array, QHAdamState]:
        """Return ``(theta_{t+1}, state_{t+1})``; ``lr`` overrides ``self.lr``.

        ``bias_correction=False`` drops the moments' bias correction; it exists
        only to state the paper's "modulo bias correction" recoveries exactly.
        """
        lr = self.lr if lr is None else validation.check_lr(lr)
        theta, g = _as64(param), _as64(grad)
        g, decay = rules.weight_decay_terms(
            g, theta, lr=lr, weight_decay=self.weight_decay, decoupled=self.decoupled_weight_decay
        )
        step = state.step + 1
        beta1, beta2 = self.betas
        bc1, bc2 = (
            (rules.bias_correction(beta1, step), rules.bias_correction(beta2, step))
            if bias_correction
            else (1.0, 1.0)
        )
        hparams: dict[str, Any] = dict(
            beta1=beta1,
            beta2=beta2,
            nu1=self.nus[0],
            nu2=self.nus[1],
            eps=self.eps,
            bias_correction1=bc1,
            bias_correction2=bc2,
            sqrt=np.sqrt,
            square=_abs_sq,
        )
        if not self.amsgrad:
            exp_avg, exp_avg_sq, update = rules.qhadam_update(
                g, state.exp_avg, state.exp_avg_sq, **hparams
            )
            new_state = QHAdamState(step, exp_avg, exp_avg_sq)
        else:
            if state.max_exp_avg_sq is None:
                raise ValueError(
                    "QHAdam(amsgrad=True).step needs a state with max_exp_avg_sq "
                    "(from init of an amsgrad optimizer)"
                )
            exp_avg, exp_avg_sq, max_exp_avg_sq, update = rules.qhadam_amsgrad_update(
                g,
                state.exp_avg,
                state.exp_avg_sq,
                state.max_exp_avg_sq,
                maximum=np.maximum,
                **hparams,
            )
            new_state = QHAdamState(step, exp_avg, exp_avg_sq, max_exp_avg_sq)
        return rules.apply_update(theta, update, lr, decay), new_state


@dataclass(frozen=True)
class QHAdamW(QHAdam):
    """QHAdam with decoupled weight decay (``theta *= 1 - lr * weight_decay``), as AdamW."""

    weight_decay: float = 1e-2
    decoupled_weight_decay: bool = True


@dataclass(frozen=True)
class QHMuon:
    """QHMuon, float64 reference: QHM's direction orthogonalized by Muon's
    Newton-Schulz iteration, for one matrix (``rows x columns``) at a time.

    Args:
      lr: the learning rate ``alpha``, scaled per shape by
        :func:`qhoptim.rules.muon_lr_ratio` (``adjust_lr_fn``).
      momentum: ``beta``, discount factor of the normalized momentum buffer.
      nu: immediate discount factor; ``nu = momentum`` is Muon with Nesterov
        momentum, ``nu = 1`` Muon without.
      weight_decay: ``lambda``, decoupled: ``theta *= 1 - lr * lambda``.
      ns_coefficients, ns_steps, eps: :func:`qhoptim.rules.newton_schulz`'s.
      adjust_lr_fn: ``None``, ``"original"`` or ``"match_rms_adamw"``.
      norm_guard: ``"max"`` (torch) or ``"add"`` (MLX, Keras, optax): how ``eps``
        keeps the norm Newton-Schulz divides by from zero.
      decoupled_weight_decay: ``True`` (torch, Keras, optax) multiplies theta by
        ``1 - lr * lambda``; ``False`` (MLX) adds ``lambda * theta`` to the gradient.
      bias_corrected: optax's direction,
        :func:`qhoptim.rules.qhm_bias_corrected_direction`, instead of QHM's.
      fan_in_first: the matrix is ``(fan_in, fan_out)`` (optax, Keras) rather
        than ``(fan_out, fan_in)`` (torch, MLX), for the shape's ratio.
      unnormalized_buffer: Keras's form, :func:`qhoptim.rules.qhm_trace_update`
        (the state is then the trace ``m = g / (1 - beta)``).
      rms: the RMS of ``adjust_lr_fn="match_rms_adamw"`` (Keras's ``rms_rate``).
    """

    lr: float
    momentum: float = 0.95
    nu: float = 0.95
    weight_decay: float = 0.0
    ns_coefficients: tuple[float, float, float] = rules.MUON_NS_COEFFICIENTS
    ns_steps: int = rules.MUON_NS_STEPS
    eps: float = rules.MUON_EPS
    adjust_lr_fn: str | None = None
    norm_guard: str = "max"
    decoupled_weight_decay: bool = True
    bias_corrected: bool = False
    fan_in_first: bool = False
    unnormalized_buffer: bool = False
    rms: float = 0.2

    def __post_init__(self) -> None:
        validation.check_qhmuon(
            lr=self.lr,
            momentum=self.momentum,
            nu=self.nu,
            weight_decay=self.weight_decay,
            eps=self.eps,
            ns_steps=self.ns_steps,
            ns_coefficients=self.ns_coefficients,
            adjust_lr_fn=self.adjust_lr_fn,
            adjustments=rules.MUON_LR_ADJUSTMENTS,
        )
        validation.check_choice(self.norm_guard, "norm_guard", rules.MUON_NORM_GUARDS)
        validation.check_bool(self.decoupled_weight_decay, "decoupled_weight_decay")
        validation.check_bool(self.bias_corrected, "bias_corrected")
        validation.check_bool(self.fan_in_first, "fan_in_first")
        validation.check_bool(self.unnormalized_buffer, "unnormalized_buffer")
        if self.bias_corrected and self.unnormalized_buffer:
            raise ValueError("bias_corrected and unnormalized_buffer are two forms; choose one")
        validation.check_finite(validation.require_real(self.rms, "rms"), "rms")

    def init(self, param: object) -> QHMuonState:
        theta = _as64(param)
        if theta.ndim != 2:
            raise ValueError(f"QHMuon takes matrices; received an array of shape {theta.shape}")
        return QHMuonState(np.zeros_like(theta))

    def step(
        self, param: object, grad: object, state: QHMuonState, lr: float | None = None
    ) -> tuple[Array, QHMuonState]:
        """Return ``(theta_{t+1}, state_{t+1})``; ``lr`` overrides ``self.lr`` (schedules)."""
        lr = self.lr if lr is None else validation.check_lr(lr)
        theta, g = _as64(param), _as64(grad)
        if not self.decoupled_weight_decay:
            g = rules.coupled_weight_decay(g, theta, self.weight_decay)
        step = state.step + 1
        if self.bias_corrected:
            buf = rules.ewma(state.momentum_buffer, g, self.momentum)
            grad_correction = rules.bias_correction(self.momentum, step)
            direction = rules.qhm_bias_corrected_direction(
                g,
                buf,
                nu=self.nu,
                grad_correction=grad_correction,
                buffer_correction=rules.qhmuon_buffer_correction(self.nu, grad_correction),
            )
        elif self.unnormalized_buffer:
            buf, direction = rules.qhm_trace_update(
                g, state.momentum_buffer, momentum=self.momentum, nu=self.nu
            )
        else:
            buf, direction = rules.qhm_update(
                g, state.momentum_buffer, momentum=self.momentum, nu=self.nu
            )
        rows, columns = theta.shape
        update = rules.newton_schulz(
            direction,
            rows=rows,
            columns=columns,
            ops=NUMPY_MATRIX_OPS,
            coefficients=self.ns_coefficients,
            steps=self.ns_steps,
            eps=self.eps,
            norm_guard=self.norm_guard,
        )
        fan_out, fan_in = (columns, rows) if self.fan_in_first else (rows, columns)
        ratio = rules.muon_lr_ratio(self.adjust_lr_fn, fan_out, fan_in, rms=self.rms)
        wd = self.weight_decay if self.decoupled_weight_decay else 0.0
        decay = rules.decoupled_decay_factor(lr, wd)
        return rules.apply_update(theta, update, lr * ratio, decay), QHMuonState(buf, step)
