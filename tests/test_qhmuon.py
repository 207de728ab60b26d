"""QHMuon's core: Newton-Schulz, the learning-rate ratio, the float64 reference,
the conversions from Muon and Lion, and the validation wording.

Expected values come from outside the rules: the SVD's polar factor, Muon as
its authors publish it (written out below, step by step), Lion's Program 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from qhoptim import convert, reference, rules, validation

RNG = np.random.default_rng(2024)


def _matrix(rows: int, columns: int, condition: float = 10.0) -> np.ndarray:
    """A random ``rows x columns`` matrix with singular values in [1/condition, 1] (scaled)."""
    u, _ = np.linalg.qr(RNG.standard_normal((rows, rows)))
    v, _ = np.linalg.qr(RNG.standard_normal((columns, columns)))
    k = min(rows, columns)
    s = np.geomspace(1.0, 1.0 / condition, k)
    return 3.7 * (u[:, :k] * s) @ v[:, :k].T


def _polar_factor(m: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(m, full_matrices=False)
    return u @ vt


# ------------------------------------------------------------- Newton-Schulz
@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5), (1, 7)])
def test_cubic_newton_schulz_converges_to_the_polar_factor(shape: tuple[int, int]) -> None:
    # (a, b, c) = (1.5, -0.5, 0) is the classic cubic Newton-Schulz iteration,
    # which converges to U V^T for singular values in (0, sqrt(3)).
    m = _matrix(*shape)
    got = rules.newton_schulz(
        m,
        rows=shape[0],
        columns=shape[1],
        ops=reference.NUMPY_MATRIX_OPS,
        coefficients=(1.5, -0.5, 0.0),
        steps=60,
    )
    np.testing.assert_allclose(got, _polar_factor(m), atol=1e-12)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_muon_quintic_gives_singular_values_near_one(shape: tuple[int, int]) -> None:
    # Muon's five quintic steps: "approximately orthogonal", the singular values
    # of the result in roughly [0.7, 1.2] (Jordan et al., 2024), singular
    # vectors those of the input.
    m = _matrix(*shape, condition=100.0)
    got = rules.newton_schulz(m, rows=shape[0], columns=shape[1], ops=reference.NUMPY_MATRIX_OPS)
    singular_values = np.linalg.svd(got, compute_uv=False)
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25, singular_values
    u, _, vt = np.linalg.svd(m, full_matrices=False)
    np.testing.assert_allclose(u.T @ got @ vt.T, np.diag(np.diag(u.T @ got @ vt.T)), atol=1e-10)


def test_newton_schulz_of_a_transpose_is_the_transpose() -> None:
    m = _matrix(7, 3)
    ops = reference.NUMPY_MATRIX_OPS
    tall = rules.newton_schulz(m, rows=7, columns=3, ops=ops)
    wide = rules.newton_schulz(m.T, rows=3, columns=7, ops=ops)
    np.testing.assert_array_equal(tall, wide.T)


@pytest.mark.parametrize("scale", [1e-8, 1e3])
def test_newton_schulz_narrowed_to_float16_after_the_norm_keeps_the_step(scale: float) -> None:
    # Cast to float16 first, the squared norm of a 64 x 64 matrix overflows
    # float16 (65504) at scale 1e3 and underflows at 1e-8: a zero or NaN step.
    u = np.random.default_rng(0).standard_normal((64, 64)) * scale
    want = rules.newton_schulz(u, rows=64, columns=64, ops=reference.NUMPY_MATRIX_OPS)
    got = rules.newton_schulz(
        u.astype(np.float32), rows=64, columns=64, ops=reference.NUMPY_MATRIX_OPS,
        narrow=lambda x: x.astype(np.float16),
    )  # fmt: skip
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, atol=2e-2 * np.abs(want).max())
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        first = rules.newton_schulz(
            u.astype(np.float16), rows=64, columns=64, ops=reference.NUMPY_MATRIX_OPS
        )
    assert not np.allclose(first.astype(np.float64), want, atol=2e-2 * np.abs(want).max())


def test_newton_schulz_of_zero_is_zero_and_zero_steps_normalize_only() -> None:
    ops = reference.NUMPY_MATRIX_OPS
    zero = rules.newton_schulz(np.zeros((3, 4)), rows=3, columns=4, ops=ops)
    np.testing.assert_array_equal(zero, np.zeros((3, 4)))
    m = _matrix(3, 4)
    normalized = rules.newton_schulz(m, rows=3, columns=4, ops=ops, steps=0)
    np.testing.assert_allclose(normalized, m / np.linalg.norm(m), rtol=1e-15)


# ------------------------------------------------------------ learning rate
@pytest.mark.parametrize(
    ("adjust", "rows", "columns", "ratio"),
    [
        (None, 4, 4, 1.0),
        (None, 16, 4, 2.0),  # sqrt(16 / 4)
        ("original", 4, 16, 1.0),
        ("original", 9, 1, 3.0),
        ("match_rms_adamw", 4, 16, 0.8),  # 0.2 * sqrt(16)
        ("match_rms_adamw", 100, 25, 2.0),  # 0.2 * sqrt(100)
    ],
)
def test_muon_lr_ratio(adjust: str | None, rows: int, columns: int, ratio: float) -> None:
    assert rules.muon_lr_ratio(adjust, rows, columns) == pytest.approx(ratio, rel=1e-15)


def test_unknown_lr_adjustment_is_refused_by_name() -> None:
    with pytest.raises(ValueError) as info:
        rules.muon_lr_ratio("spectral", 4, 4)
    assert str(info.value) == (
        "adjust_lr_fn must be one of None, 'original', 'match_rms_adamw'; "
        "received adjust_lr_fn='spectral'"
    )


# ------------------------------------------------------- Muon, as published
@dataclass
class _PublishedMuon:
    """Muon (Jordan et al., 2024) for one matrix, as ``torch.optim.Muon`` documents it::

    B <- mu B + (1 - mu) g
    D <- (1 - mu) g + mu B   (nesterov)   or   B
    X <- D / max(||D||_F, eps);  five times: A = X X^T, X <- a X + (b A + c A A) X
    theta <- (1 - lr wd) theta - lr sqrt(max(1, rows / columns)) X

    (the iteration on the transpose of a tall matrix).
    """

    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float

    def run(self, theta: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
        buf, out = np.zeros_like(theta), []
        a, b, c = 3.4445, -4.7750, 2.0315
        for g in grads:
            buf = self.momentum * buf + (1 - self.momentum) * g
            d = (1 - self.momentum) * g + self.momentum * buf if self.nesterov else buf
            tall = d.shape[0] > d.shape[1]
            x = d.T if tall else d
            x = x / max(np.linalg.norm(x), 1e-7)
            for _ in range(5):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            x = x.T if tall else x
            scale = math.sqrt(max(1.0, theta.shape[0] / theta.shape[1]))
            theta = (1 - self.lr * self.weight_decay) * theta - self.lr * scale * x
            out.append(theta)
        return out


def _reference_run(opt: reference.QHMuon, theta: np.ndarray, grads: list[np.ndarray]) -> list[Any]:
    state, out = opt.init(theta), []
    for g in grads:
        theta, state = opt.step(theta, g, state)
        out.append(theta)
    return out


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])
def test_from_muon_reproduces_published_muon(nesterov: bool, shape: tuple[int, int]) -> None:
    grads = [RNG.standard_normal(shape) for _ in range(30)]
    theta = RNG.standard_normal(shape)
    muon = _PublishedMuon(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    settings = convert.from_muon(0.9, nesterov=nesterov)
    assert settings.nu == (0.9 if nesterov else 1.0)
    qhmuon = reference.QHMuon(lr=0.02, weight_decay=0.1, **settings.as_kwargs())
    for want, got in zip(muon.run(theta, grads), _reference_run(qhmuon, theta, grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_reference_qhmuon_nu_zero_orthogonalizes_the_gradient_alone() -> None:
    # nu = 0: the buffer is kept but unused; each step is -lr * NS(grad).
    grads = [RNG.standard_normal((3, 5)) for _ in range(4)]
    opt = reference.QHMuon(lr=0.1, momentum=0.9, nu=0.0)
    theta = np.zeros((3, 5))
    for g, got in zip(grads, _reference_run(opt, theta, grads), strict=True):
        theta = theta - 0.1 * rules.newton_schulz(
            g, rows=3, columns=5, ops=reference.NUMPY_MATRIX_OPS
        )
        np.testing.assert_allclose(got, theta, rtol=1e-14, atol=1e-15)


def test_reference_qhmuon_takes_matrices_only() -> None:
    with pytest.raises(ValueError, match=r"QHMuon takes matrices; received .* \(5,\)"):
        reference.QHMuon(lr=0.1).init(np.zeros(5))


# ----------------------------------------------------------------- Lion
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.95, 0.98), (0.0, 0.99), (0.5, 0.5)])
def test_from_lion_is_sign_qhm(betas: tuple[float, float]) -> None:
    # Lion, Program 1 of Chen et al. (2023): c = b1 m + (1 - b1) g;
    # theta -= lr sign(c); m = b2 m + (1 - b2) g.  Sign-QHM: QHM's buffer and
    # direction from the rules, the sign of the direction taken.
    lr, (b1, b2) = 0.01, betas
    settings = convert.from_lion(lr, betas)
    grads = [RNG.standard_normal(8) for _ in range(30)]
    lion_theta = qh_theta = RNG.standard_normal(8)
    m = qh_buf = np.zeros(8)
    for g in grads:
        c = b1 * m + (1 - b1) * g
        lion_theta = lion_theta - lr * np.sign(c)
        m = b2 * m + (1 - b2) * g
        qh_buf, direction = rules.qhm_update(g, qh_buf, momentum=settings.momentum, nu=settings.nu)
        qh_theta = qh_theta - settings.lr * np.sign(direction)
        np.testing.assert_allclose(direction, c, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(qh_theta, lion_theta)


def test_from_lion_closed_form_and_limits() -> None:
    assert convert.from_lion(1e-4, (0.9, 0.99)) == pytest.approx(
        convert.SignQHMParams(1e-4, 0.9 / 0.99, 0.99)
    )
    assert convert.from_lion(1e-4, (0.0, 0.0)) == convert.SignQHMParams(1e-4, 0.0, 0.0)
    assert not hasattr(convert.SignQHMParams, "as_kwargs")  # not QHM's settings
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \(0, 1\) when betas\[0\] > 0"):
        convert.from_lion(1e-4, (0.9, 0.0))
    with pytest.raises(ValueError, match=r"betas\[0\] must be in \[0, 1\); received betas\[0\]=1"):
        convert.from_lion(1e-4, (1, 0.99))
    # nu = betas[0] / betas[1] past float64's range (a subnormal betas[1]).
    with pytest.raises(
        ValueError, match=r"^betas give a QHM nu that overflows float64 \(nu=inf\); received betas="
    ):
        convert.from_lion(1e-4, (0.5, 5e-324))


def test_from_muon_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\); received momentum=1.0"):
        convert.from_muon(1.0)
    with pytest.raises(TypeError, match="nesterov"):
        convert.from_muon(0.9, nesterov="yes")  # type: ignore[arg-type]


# -------------------------------------------------------------- validation
_GOOD: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "nu": 0.7,
    "weight_decay": 0.1,
    "eps": 1e-7,
    "ns_steps": 5,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "adjust_lr_fn": None,
    "adjustments": rules.MUON_LR_ADJUSTMENTS,
}


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"momentum": 1.0}, ValueError, "momentum must be in [0, 1); received momentum=1.0"),
        ({"nu": math.nan}, ValueError, "nu must be a finite real number; received nu=nan"),
        ({"lr": -1.0}, ValueError, "lr must be in [0, inf); received lr=-1.0"),
        ({"eps": -1.0}, ValueError, "eps must be in [0, inf); received eps=-1.0"),
        ({"ns_steps": 100}, ValueError, "ns_steps must be in [0, 100); received ns_steps=100"),
        ({"ns_steps": 2.5}, TypeError, "ns_steps must be an integer; received ns_steps=2.5"),
        ({"ns_steps": True}, TypeError, "ns_steps must be an integer; received ns_steps=True"),
        (
            {"ns_coefficients": (1.0, 2.0)},
            ValueError,
            "ns_coefficients must be three numbers (a, b, c); received ns_coefficients=(1.0, 2.0)",
        ),
        (
            {"ns_coefficients": (1.0, math.inf, 0.0)},
            ValueError,
            "ns_coefficients[1] must be a finite real number; received ns_coefficients[1]=inf",
        ),
        (
            {"adjust_lr_fn": "Original"},
            ValueError,
            "adjust_lr_fn must be one of None, 'original', 'match_rms_adamw'; "
            "received adjust_lr_fn='Original'",
        ),
    ],
)
def test_check_qhmuon_names_argument_range_and_value(
    change: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        validation.check_qhmuon(**{**_GOOD, **change})
    assert str(info.value) == message


def test_check_qhmuon_passes_good_settings_and_any_finite_nu() -> None:
    for nu in (-0.5, 0.0, 1.0, 1.7):
        validation.check_qhmuon(**{**_GOOD, "nu": nu})


def test_norm_guards_divide_by_the_guarded_norm() -> None:
    # steps=0 leaves the normalized matrix: U / max(|U|, eps) or U / (|U| + eps).
    ops = reference.NUMPY_MATRIX_OPS
    small = np.full((2, 2), 1e-8)  # Frobenius norm 2e-8, below eps = 1e-7
    by_max = rules.newton_schulz(small, rows=2, columns=2, ops=ops, steps=0, norm_guard="max")
    by_add = rules.newton_schulz(small, rows=2, columns=2, ops=ops, steps=0, norm_guard="add")
    np.testing.assert_allclose(by_max, small / 1e-7, rtol=1e-15)
    np.testing.assert_allclose(by_add, small / (2e-8 + 1e-7), rtol=1e-15)
    with pytest.raises(ValueError, match="norm_guard must be one of 'max', 'add'; received"):
        rules.newton_schulz(small, rows=2, columns=2, ops=ops, norm_guard="clip")
    with pytest.raises(ValueError, match="norm_guard must be one of 'max', 'add'"):
        reference.QHMuon(lr=0.1, norm_guard="clip")


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.999])
@pytest.mark.parametrize("t", [1, 2, 10, 1000])
def test_bias_corrected_direction_is_optax_muon_at_both_ends(beta: float, t: int) -> None:
    # optax.contrib.scale_by_muon: Nesterov beta * m / (1 - beta**(t+1)) +
    # (1 - beta) * g / (1 - beta**t); without, m / (1 - beta**t).
    g, m = RNG.standard_normal(4), RNG.standard_normal(4)
    c = rules.bias_correction(beta, t)

    def direction(nu: float) -> np.ndarray:
        buffer_correction = rules.qhmuon_buffer_correction(nu, c)
        return rules.qhm_bias_corrected_direction(
            g, m, nu=nu, grad_correction=c, buffer_correction=buffer_correction
        )

    nesterov = beta * m / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
    np.testing.assert_allclose(direction(beta), nesterov, rtol=1e-10)
    np.testing.assert_allclose(direction(1.0), m / (1 - beta**t), rtol=1e-12)
    # Above 1 the buffer keeps the plain correction; below 0 the correction grows.
    assert rules.qhmuon_buffer_correction(1.5, c) == c
    assert rules.qhmuon_buffer_correction(-0.5, c) == pytest.approx(1 + 0.5 * beta**t)


def test_match_rms_adamw_takes_the_rms() -> None:
    assert rules.muon_lr_ratio("match_rms_adamw", 4, 16, rms=0.3) == pytest.approx(1.2)
