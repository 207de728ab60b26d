"""Non-finite gradients, eps = 0, long runs and float16/bfloat16 parameters (docs/robustness.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from qh_torch_testing import reference_optimizer, reference_trajectory, run_torch

from conformance.runner import max_relative_deviation
from qhoptim import reference
from qhoptim.torch import QHM, QHAdam, QHAdamW

F64 = torch.float64
NAN, INF = math.nan, math.inf


def _param(values: Any, dtype: torch.dtype = F64) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=dtype))


def _run(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    grads: list[list[float]],
    x0: list[float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    p = _param(x0)
    opt = make([p])
    for g in grads:
        p.grad = torch.tensor(g, dtype=F64)
        opt.step()
    return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if k != "step"}


def _assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor) -> None:
    """Non-finite in the same places; equal (to rounding) where finite."""
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (got, want)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-14)


# One coordinate per kind of gradient: finite, NaN, +inf, -inf, and a finite
# coordinate whose earlier gradient was NaN.
X0 = [1.0, -1.0, 0.5, 2.0, -0.5]
POISONED = [[0.5, NAN, INF, -INF, NAN], [0.25, 1.0, 1.0, 1.0, 1.0], [-0.5, 1.0, 1.0, 1.0, 1.0]]


@pytest.mark.parametrize("foreach", [False, True])
def test_non_finite_gradients_propagate_as_in_torch_adam(foreach: bool) -> None:
    for steps in (1, 3):
        grads = POISONED[:steps]
        adam_p, adam_s = _run(lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=foreach), grads, X0)
        qh_p, qh_s = _run(lambda ps: QHAdam(ps, lr=0.1, foreach=foreach), grads, X0)
        _assert_same_nonfinite(qh_p, adam_p)
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_same_nonfinite(qh_s[key], adam_s[key])
        # With nu != 1 the non-finite set is the same; finite coordinates follow the reference.
        qh_p, _ = _run(lambda ps: QHAdam(ps, lr=0.1, nus=(0.7, 0.8), foreach=foreach), grads, X0)
        ref = reference.QHAdam(lr=0.1, nus=(0.7, 0.8))
        x, state = np.array(X0), ref.init(np.array(X0))
        with np.errstate(invalid="ignore"):
            for g in grads:
                x, state = ref.step(x, np.array(g), state)
        assert torch.equal(torch.isfinite(qh_p), torch.isfinite(adam_p))
        _assert_same_nonfinite(qh_p, torch.tensor(x))


@pytest.mark.parametrize("foreach", [False, True])
def test_non_finite_gradients_propagate_as_in_torch_sgd(foreach: bool) -> None:
    # QHM with nu = 1 is SGD with momentum at lr * (1 - beta) (README, convert.from_momentum).
    for steps in (1, 3):
        grads = POISONED[:steps]
        sgd_p, _ = _run(
            lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=foreach), grads, X0
        )
        for nu in (1.0, 0.7):
            qh_p, qh_s = _run(
                lambda ps, nu=nu: QHM(ps, lr=0.1, momentum=0.9, nu=nu, foreach=foreach), grads, X0
            )
            assert torch.equal(torch.isfinite(qh_p), torch.isfinite(sgd_p))
            if nu == 1.0:
                _assert_same_nonfinite(qh_p, sgd_p)
            assert torch.equal(
                torch.isfinite(qh_s["momentum_buffer"]), torch.isfinite(torch.tensor(grads[0]))
            )


# ----------------------------------------------------------------------- eps = 0
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("nus", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.5), (0.0, 0.0)])
def test_eps_zero_with_zero_gradients_is_nan_as_in_adam_and_the_reference(
    nus: tuple[float, float], foreach: bool
) -> None:
    # Coordinate 0 has had only zero gradients: the rule is 0 / 0 there.
    grads = [[0.0, 1.0, -2.0], [0.0, 0.5, 1.0]]
    x0 = [1.0, 1.0, 1.0]
    adam_p, _ = _run(lambda ps: torch.optim.Adam(ps, lr=0.1, eps=0.0, foreach=foreach), grads, x0)
    qh_p, _ = _run(lambda ps: QHAdam(ps, lr=0.1, nus=nus, eps=0.0, foreach=foreach), grads, x0)
    ref = reference.QHAdam(lr=0.1, nus=nus, eps=0.0)
    x, state = np.array(x0), ref.init(np.array(x0))
    with np.errstate(invalid="ignore"):
        for g in grads:
            x, state = ref.step(x, np.array(g), state)
    assert torch.isnan(adam_p[0]) and torch.isnan(qh_p[0])
    _assert_same_nonfinite(qh_p, torch.tensor(x))
    # Any eps > 0 makes the zero-gradient coordinate stand still (0 / eps).
    tiny_p, _ = _run(lambda ps: QHAdam(ps, lr=0.1, nus=nus, eps=1e-300, foreach=foreach), grads, x0)
    assert tiny_p[0] == 1.0
    torch.testing.assert_close(tiny_p[1:], qh_p[1:], rtol=1e-12, atol=0)


# -------------------------------------------------------------------- long runs
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("step", [10**6 - 1, 2**24 - 1, 2**31 - 2])
def test_bias_correction_at_a_large_step_count(step: int, foreach: bool) -> None:
    # The step counter is a float32 tensor, as torch's Adam's. Set it directly
    # instead of looping; beta2 = 0.99999 keeps the bias correction away from 1
    # at 10**6 steps (1 - beta2**t = 0.99995).
    betas, nus = (0.999, 0.99999), (0.7, 0.9)
    rng = np.random.default_rng(step % 1000)
    m0, s0 = rng.standard_normal(4), rng.uniform(0.1, 1.0, 4)
    x0, g = rng.standard_normal(4), rng.standard_normal(4)
    p = _param(x0)
    opt = QHAdam([p], lr=0.01, betas=betas, nus=nus, foreach=foreach)
    opt.state[p].update(
        step=torch.tensor(float(step), dtype=torch.float32),
        exp_avg=torch.tensor(m0),
        exp_avg_sq=torch.tensor(s0),
    )
    p.grad = torch.tensor(g)
    opt.step()
    counted = float(np.float32(step)) + 1  # float32 counts exactly up to 2**24
    assert float(opt.state[p]["step"]) == float(np.float32(counted))
    ref = reference.QHAdam(lr=0.01, betas=betas, nus=nus)
    want, _ = ref.step(x0, g, reference.QHAdamState(int(counted) - 1, m0, s0))
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12)
    assert np.all(np.isfinite(p.detach().numpy()))


def test_the_float32_counter_stops_at_2_24_where_bias_correction_is_1() -> None:
    p = _param([1.0])
    opt = QHAdam([p], lr=0.01, betas=(0.9, 0.99999))
    opt.state[p].update(
        step=torch.tensor(2.0**24, dtype=torch.float32),
        exp_avg=torch.zeros(1, dtype=F64),
        exp_avg_sq=torch.zeros(1, dtype=F64),
    )
    p.grad = torch.ones(1, dtype=F64)
    opt.step()
    assert float(opt.state[p]["step"]) == 2.0**24  # float32: 2**24 + 1 rounds back
    # ... and there the bias correction of beta2 = 0.99999 is 1 in float64 anyway.
    assert 1 - 0.99999 ** (2**24) == 1.0


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
def test_a_long_run_follows_the_reference(cls: type) -> None:
    kwargs: dict[str, Any] = (
        {"lr": 0.01, "momentum": 0.9999, "nu": 0.7}
        if cls is QHM
        else {"lr": 1e-3, "betas": (0.999, 0.9999), "nus": (0.7, 0.9)}
    )
    steps = 5000
    grads = [
        [g] for g in torch.randn(steps, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    ]
    params = [torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=F64))]
    got = run_torch(cls(params, **kwargs), params, grads)[-1][0]
    want = reference_trajectory(cls, kwargs, [torch.tensor([1.0, -2.0, 0.5], dtype=F64)], grads)
    np.testing.assert_allclose(got, want[-1][0], rtol=1e-10)


# ------------------------------------------------------------- low precision
LOW = [torch.float16, torch.bfloat16]
LOW_CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.5, "momentum": 0.99, "nu": 0.7}),
    (QHAdam, {"lr": 0.05, "betas": (0.995, 0.999), "nus": (0.7, 1.0)}),
    (QHAdamW, {"lr": 0.05, "betas": (0.9, 0.99), "nus": (0.7, 0.8), "eps": 1e-3}),
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize(("cls", "kwargs"), LOW_CONFIGS, ids=lambda c: getattr(c, "__name__", ""))
def test_low_precision_params_stay_close_to_the_float64_reference(
    cls: type, kwargs: dict[str, Any], dtype: torch.dtype, foreach: bool
) -> None:
    steps = 20
    rng = np.random.default_rng(0)
    x0 = rng.uniform(0.5, 2.0, 16) * rng.choice([-1, 1], 16)
    grads = rng.uniform(0.1, 1.0, (steps, 16)) * rng.choice([-1, 1], (steps, 16))
    p = torch.nn.Parameter(torch.tensor(x0, dtype=dtype))
    opt = cls([p], **kwargs, foreach=foreach)
    x_ref = p.detach().double().numpy()  # the reference starts where the parameter does
    ref_opt = reference_optimizer(cls, kwargs)
    state = ref_opt.init(x_ref)
    got, want = [x_ref], [x_ref]
    for g in grads:
        g_low = torch.tensor(g, dtype=dtype)
        p.grad = g_low
        opt.step()
        got.append(p.detach().double().numpy())
        x_ref, state = ref_opt.step(x_ref, g_low.double().numpy(), state)  # the same gradient
        want.append(x_ref)
    for key, value in opt.state[p].items():
        assert value.dtype == (torch.float32 if key == "step" else dtype), key
    # Each step rounds the parameter (half an ulp) and the update (a few ulps of
    # lr * |update|): the deviation grows at most by about one eps per step.
    deviation = max_relative_deviation(np.stack(got), np.stack(want))
    assert deviation <= steps * torch.finfo(dtype).eps, deviation


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("nu2", [5e-324, 2.2250738585072014e-309, 1e-300, 1e-30])
@pytest.mark.parametrize("dtype", [F64, torch.complex128], ids=str)
def test_a_tiny_nu2_follows_the_reference(nu2: float, dtype: torch.dtype, foreach: bool) -> None:
    # Found by fuzzing: with nu2 subnormal, (1 - nu2) / nu2 overflowed in the
    # folded coefficients and the step was 0 instead of about lr * g / |g|.
    kwargs = {"lr": 0.5, "betas": (0.0, 0.9), "nus": (0.3, nu2), "eps": 0.0}
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(3, dtype=dtype, generator=gen)] for _ in range(4)]
    x0 = torch.randn(3, dtype=dtype, generator=gen)
    params = [torch.nn.Parameter(x0.clone())]
    got = run_torch(QHAdam(params, **kwargs, foreach=foreach), params, grads)
    want = reference_trajectory(QHAdam, kwargs, [x0], grads)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[0], w[0], rtol=1e-12)


# ------------------------------------------------ bias correction near beta = 1
@pytest.mark.parametrize("beta1", [0.99999, 0.9999999])
@pytest.mark.parametrize(
    "flags",
    [
        {"foreach": False},
        {"foreach": True},
        {"foreach": False, "capturable": True},
        {"foreach": True, "capturable": True},
        {"foreach": False, "differentiable": True},
        {"fused": True},
    ],
    ids=["loop", "foreach", "loop-capturable", "foreach-capturable", "differentiable", "fused"],
)
def test_adam_first_step_is_lr_times_the_sign_in_float32(
    beta1: float, flags: dict[str, bool]
) -> None:
    # With nus = (1, 1) and eps = 0 QHAdam is Adam, whose first step is exactly
    # -lr * sign(grad). Every path computes float32 bias corrections in the
    # expm1 form (qhoptim.rules.bias_correction), so 1 - beta1 ** 1 does not
    # cancel: the step is -1 to float32 rounding, not -0.84 (as 1 - beta1**t
    # evaluated in float32 gives at beta1 = 0.9999999).
    grad = torch.tensor([0.5, -3.0, 1e-3, 7.0])
    param = torch.zeros(4, requires_grad=not flags.get("differentiable", False))
    param.grad = grad
    opt = QHAdam([param], lr=1.0, betas=(beta1, 0.999), eps=0.0, **flags)
    with torch.no_grad():
        opt.step()
    torch.testing.assert_close(param.detach(), -torch.sign(grad), rtol=1e-6, atol=0)
