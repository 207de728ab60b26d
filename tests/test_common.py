"""qhoptim.common: qhoptim 1.1.0's ``param_conv`` as a thin layer over qhoptim.convert.

Three things are checked for every function: it has 1.1.0's signature and
result type; its result is :mod:`qhoptim.convert`'s, renamed to 1.1.0's fields;
and the result reproduces the source algorithm -- the naive implementation of
``conformance/sources.py`` against the float64 reference QHM / QHAdam, on every
case of ``conformance/recovery.toml`` that uses the function. Where 1.1.0's
numbers are still the right ones, they are compared with 1.1.0's closed forms
(written out below); where 1.1.0 was wrong (the two-state optimizer's ``nu``
outside Ma & Yarats (2019), App. D's conditions), the test shows that 1.1.0's
numbers fail to reproduce the source while ours do.
"""

# ruff: noqa: E741  (l is the papers' name: the smoothness constant L, TSO's l)

from __future__ import annotations

import importlib
import inspect
import json
import math
import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import recovery
from conformance.problems import get_problem
from conformance.runner import max_relative_deviation
from qhoptim import common, convert, validation
from qhoptim.common import param_conv

# qhoptim 1.1.0's qhoptim.common.param_conv: function -> its positional parameters
# (none has a default; 1.1.0's optimizer classmethods added the defaults).
SIGNATURES_110 = {
    "from_pid": ("k_p", "k_i", "k_d"),
    "from_synthesized_nesterov": ("alpha", "beta1", "beta2"),
    "from_robust_momentum": ("l", "kappa", "rho"),
    "from_accsgd": ("delta", "kappa", "xi", "eps"),
    "from_two_state_optimizer": ("h", "k", "l", "m", "q", "z"),
    "from_nadam": ("lr", "beta1", "beta2"),
}
FIELDS_110 = {
    "QHMParams": ("alpha", "nu", "beta"),
    "QHAdamParams": ("alpha", "nu1", "nu2", "beta1", "beta2"),
}

QHM_FUNCTIONS = [n for n in SIGNATURES_110 if n != "from_nadam"]


def _as_110(p: convert.QHMParams) -> param_conv.QHMParams:
    """convert's result under 1.1.0's field names."""
    return param_conv.QHMParams(alpha=p.lr, nu=p.nu, beta=p.momentum)


def _as_convert(p: param_conv.QHMParams) -> convert.QHMParams:
    """A 1.1.0 result as convert's type, for the reference optimizer."""
    return convert.QHMParams(lr=p.alpha, nu=p.nu, momentum=p.beta)


def _legacy_args(case: recovery.RecoveryCase) -> list[Any]:
    """The 1.1.0 call's positional arguments for a recovery case."""
    params = case.params
    if case.convert == "from_nadam":
        return [params["lr"], params["betas"][0], params["betas"][1]]
    return [params.get(name) for name in SIGNATURES_110[case.convert]]  # rho may be None


LEGACY_CASES = [c for c in recovery.load_cases() if c.convert in SIGNATURES_110]


# ---------------------------------------------------------------- import paths
def test_every_110_import_path_works() -> None:
    import qhoptim.common.param_conv as imported

    assert imported is param_conv
    assert importlib.import_module("qhoptim.common.param_conv") is param_conv
    from qhoptim.common.param_conv import QHMParams, from_pid

    assert from_pid is param_conv.from_pid and QHMParams is param_conv.QHMParams
    assert common.__all__ == ["param_conv"]


def test_importing_it_loads_no_framework() -> None:
    code = (
        "import sys, json\nimport qhoptim.common.param_conv\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    frameworks = {"torch", "tensorflow", "keras", "jax", "jaxlib", "optax", "flax"}
    assert not set(json.loads(out)) & frameworks


def test_docstrings_point_to_convert() -> None:
    assert common.__doc__ is not None and "1.1.0" in common.__doc__
    assert param_conv.__doc__ is not None and "qhoptim.convert" in param_conv.__doc__
    for name in SIGNATURES_110:
        doc = getattr(param_conv, name).__doc__
        assert f":func:`qhoptim.convert.{name}`" in doc and "1.1.0" in doc


# ------------------------------------------------------------------- 1.1.0 API
@pytest.mark.parametrize("name", SIGNATURES_110)
def test_signature_is_110s(name: str) -> None:
    params = inspect.signature(getattr(param_conv, name)).parameters
    assert tuple(params) == SIGNATURES_110[name]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())
    assert all(p.default is p.empty for p in params.values())


@pytest.mark.parametrize("name", FIELDS_110)
def test_result_types_are_110s_named_tuples(name: str) -> None:
    cls = getattr(param_conv, name)
    assert cls._fields == FIELDS_110[name]
    assert isinstance(cls(*range(len(FIELDS_110[name]))), tuple)


def test_results_pickle_under_110s_module_name() -> None:
    p = param_conv.from_pid(-0.5, 0.1, 4.5)
    data = pickle.dumps(p, protocol=0)
    # 1.1.0's pickles name qhoptim.common.param_conv.QHMParams, as these do.
    assert b"qhoptim.common.param_conv" in data
    assert pickle.loads(data) == p


# ------------------------------------------------- equal to qhoptim.convert
@pytest.mark.parametrize("case", LEGACY_CASES, ids=[c.name for c in LEGACY_CASES])
def test_result_is_converts_under_110_names(case: recovery.RecoveryCase) -> None:
    got = getattr(param_conv, case.convert)(*_legacy_args(case))
    want = case.converted()
    if isinstance(want, convert.QHAdamParams):
        assert type(got) is param_conv.QHAdamParams
        assert got == (want.lr, want.nus[0], want.nus[1], want.betas[0], want.betas[1])
    else:
        assert type(got) is param_conv.QHMParams
        assert got == _as_110(want)
    assert all(type(v) is float for v in got)


def test_every_110_function_has_a_recovery_case() -> None:
    assert {c.convert for c in LEGACY_CASES} == set(SIGNATURES_110)


unit = st.floats(0.01, 0.99)


@settings(max_examples=50, deadline=None)
@given(k_p=st.floats(-2.0, -1e-3), k_i=st.floats(1e-4, 1.0), k_d=st.floats(1e-3, 10.0))
def test_pid_equals_convert(k_p: float, k_i: float, k_d: float) -> None:
    assert param_conv.from_pid(k_p, k_i, k_d) == _as_110(convert.from_pid(k_p, k_i, k_d))


@settings(max_examples=50, deadline=None)
@given(alpha=st.floats(0.0, 1.0), beta1=unit, beta2=st.floats(-3.0, 3.0))
def test_snv_equals_convert(alpha: float, beta1: float, beta2: float) -> None:
    got = param_conv.from_synthesized_nesterov(alpha, beta1, beta2)
    assert got == _as_110(convert.from_synthesized_nesterov(alpha, beta1, beta2))


@settings(max_examples=50, deadline=None)
@given(l=st.floats(0.1, 100.0), kappa=st.floats(1.01, 1e4), t=st.none() | st.floats(0.0, 1.0))
def test_robust_momentum_equals_convert(l: float, kappa: float, t: float | None) -> None:
    lo, hi = 1 - 1 / math.sqrt(kappa), 1 - 1 / kappa
    rho = None if t is None else min(hi, max(lo, lo + t * (hi - lo)))
    got = param_conv.from_robust_momentum(l, kappa, rho)
    assert got == _as_110(convert.from_robust_momentum(l, kappa, rho))


@settings(max_examples=50, deadline=None)
@given(delta=st.floats(1e-4, 1.0), kappa=st.floats(1.01, 1e4), t=unit, eps=unit)
def test_accsgd_equals_convert(delta: float, kappa: float, t: float, eps: float) -> None:
    xi = t * math.sqrt(kappa)
    got = param_conv.from_accsgd(delta, kappa, xi, eps)
    assert got == _as_110(convert.from_accsgd(delta, kappa, xi, eps))


@settings(max_examples=50, deadline=None)
@given(alpha=st.floats(1e-3, 1.0), nu=st.floats(-1.0, 2.0), beta=unit, c=st.floats(0.5, 2.0))
def test_two_state_equals_convert(alpha: float, nu: float, beta: float, c: float) -> None:
    # QHM with its buffer scaled by c, a = c g, written as a two-state optimizer.
    h, k, l = beta, 0.0, c * (1 - beta)
    m, q, z = -alpha * nu * beta / c, 1.0, -alpha * (1 - nu * beta)
    got = param_conv.from_two_state_optimizer(h, k, l, m, q, z)
    assert got == _as_110(convert.from_two_state_optimizer(h, k, l, m, q, z))


@settings(max_examples=50, deadline=None)
@given(lr=st.floats(0.0, 1.0), beta1=st.floats(0.0, 0.999), beta2=st.floats(0.0, 0.9999))
def test_nadam_equals_convert(lr: float, beta1: float, beta2: float) -> None:
    got = param_conv.from_nadam(lr, beta1, beta2)
    want = convert.from_nadam(lr, (beta1, beta2), 1e-8)
    assert got == (want.lr, want.nus[0], want.nus[1], want.betas[0], want.betas[1])


# ----------------------------------------- the results reproduce the source
def _deviation(case: recovery.RecoveryCase, params: Any) -> float:
    problem = get_problem(case.problem)
    qh = recovery.qh_trajectory(
        params,
        problem,
        case.steps,
        bias_correction=case.bias_correction,
        initial_buffer=case.initial_buffer(problem.x0),
    )
    return max_relative_deviation(case.source_trajectory(), qh)


@pytest.mark.parametrize("case", LEGACY_CASES, ids=[c.name for c in LEGACY_CASES])
def test_result_reproduces_the_source_algorithm(case: recovery.RecoveryCase) -> None:
    got = getattr(param_conv, case.convert)(*_legacy_args(case))
    params: convert.QHMParams | convert.QHAdamParams
    if isinstance(got, param_conv.QHAdamParams):
        # 1.1.0's result has no eps: the conversion keeps the source's.
        betas, nus = (got.beta1, got.beta2), (got.nu1, got.nu2)
        params = convert.QHAdamParams(got.alpha, betas, nus, case.params["eps"])
    else:
        params = _as_convert(got)
    assert _deviation(case, params) <= recovery.TOLERANCE


# ---------------------------------------------- 1.1.0's numbers, where right
# qhoptim 1.1.0's closed forms (Ma & Yarats, 2019, App. C.3-C.5, D; Sec. 5).
def _pid_110(k_p: float, k_i: float, k_d: float) -> tuple[float, ...]:
    return k_i, k_p**2 / (k_i * k_d), k_d / (k_d - k_p)


def _snv_110(alpha: float, beta1: float, beta2: float) -> tuple[float, ...]:
    return alpha / (1 - beta1), 1 - beta2 * (1 - beta1) / beta1, beta1


def _robust_momentum_110(l: float, kappa: float, rho: float | None) -> tuple[float, ...]:
    rho = 1 - 1 / math.sqrt(kappa) if rho is None else rho
    return _snv_110(
        kappa * (1 - rho) ** 2 * (1 + rho) / l,
        kappa * rho**3 / (kappa - 1),
        rho**3 / ((kappa - 1) * (1 - rho) ** 2 * (1 + rho)),
    )


def _accsgd_110(delta: float, kappa: float, xi: float, eps: float) -> tuple[float, ...]:
    return (
        delta * eps * (1 + xi) / (1 + eps),
        (eps * xi - 1) / (eps * (1 + xi)),
        (kappa - eps**2 * xi) / (kappa + eps * xi),
    )


def _two_state_110(h: float, k: float, l: float, m: float, q: float, z: float) -> tuple[float, ...]:
    # App. D as printed (Erratum 3 in docs/conversions.md: nu holds only if q = 1, k m = 0).
    phi = math.sqrt((h - q) ** 2 + 4 * k * m)
    psi = k * m - h * q
    common_ = (h - q - phi) * (l * m - h * z) + 2 * m * (l * q - k * z)
    return common_ / (2 * phi * psi), 2 * m * (l * q - k * z) / common_, (h + q - phi) / 2


def _nadam_110(lr: float, beta1: float, beta2: float) -> tuple[float, ...]:
    return lr, beta1, 1.0, beta1, beta2


CLOSED_FORMS_110: dict[str, Callable[..., tuple[float, ...]]] = {
    "from_pid": _pid_110,
    "from_synthesized_nesterov": _snv_110,
    "from_robust_momentum": _robust_momentum_110,
    "from_accsgd": _accsgd_110,
    "from_two_state_optimizer": _two_state_110,
    "from_nadam": _nadam_110,
}
# App. D's conditions fail here: 1.1.0's nu is wrong.
TSO_OUTSIDE_APP_D = [c for c in LEGACY_CASES if c.source == "two_state" and "general" in c.name]


@pytest.mark.parametrize(
    "case",
    [c for c in LEGACY_CASES if c not in TSO_OUTSIDE_APP_D],
    ids=lambda c: c.name,
)
def test_agrees_with_110_where_110_was_right(case: recovery.RecoveryCase) -> None:
    args = _legacy_args(case)
    got = getattr(param_conv, case.convert)(*args)
    assert got == pytest.approx(CLOSED_FORMS_110[case.convert](*args), rel=1e-12, abs=1e-15)


def test_110_docstring_example() -> None:
    # 1.1.0's QHM.from_two_state_optimizer example: QHM (lr 0.1, nu 1, momentum 0.9)
    # with the buffer a = g (l = 1 - beta), inside App. D's conditions.
    args = (0.9, 0.0, 0.1, -0.09, 1.0, -0.01)
    got = param_conv.from_two_state_optimizer(*args)
    assert got == pytest.approx(_two_state_110(*args), rel=1e-12)
    assert got == pytest.approx((0.1, 1.0, 0.9), rel=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    k_p=st.floats(-2.0, -1e-3),
    k_i=st.floats(1e-4, 1.0),
    k_d=st.floats(1e-3, 10.0),
    beta1=unit,
    beta2=st.floats(0.0, 1.0),
)
def test_agrees_with_110_closed_forms(
    k_p: float, k_i: float, k_d: float, beta1: float, beta2: float
) -> None:
    # Different evaluation order: equal up to rounding (1 - x cancels where nu ~ 0).
    close = {"rel": 1e-12, "abs": 1e-12}
    assert param_conv.from_pid(k_p, k_i, k_d) == pytest.approx(_pid_110(k_p, k_i, k_d), **close)
    snv = param_conv.from_synthesized_nesterov(k_i, beta1, beta2)
    assert snv == pytest.approx(_snv_110(k_i, beta1, beta2), **close)
    nadam = param_conv.from_nadam(k_i, beta1, beta2 * 0.999)
    assert nadam == _nadam_110(k_i, beta1, beta2 * 0.999)


@pytest.mark.parametrize("case", TSO_OUTSIDE_APP_D, ids=lambda c: c.name)
def test_two_state_outside_app_d_corrects_110(case: recovery.RecoveryCase) -> None:
    args = _legacy_args(case)
    ours = param_conv.from_two_state_optimizer(*args)
    theirs = param_conv.QHMParams(*_two_state_110(*args))
    _, k, _, m, q, _ = args
    assert q != 1 and k * m != 0  # outside App. D's conditions
    # alpha and beta agree; nu does not.
    assert (ours.alpha, ours.beta) == pytest.approx((theirs.alpha, theirs.beta), rel=1e-9)
    assert abs(ours.nu - theirs.nu) > 0.1
    # Ours reproduces the source (test above); 1.1.0's does not, whatever the
    # starting buffer: its response to past gradients is already different.
    problem = get_problem(case.problem)
    for g0 in (None, case.initial_buffer(problem.x0)):
        qh = recovery.qh_trajectory(_as_convert(theirs), problem, case.steps, initial_buffer=g0)
        assert max_relative_deviation(case.source_trajectory(), qh) > 1e-2


# ------------------------------------------------------ inputs 1.1.0 took
@pytest.mark.parametrize(
    ("name", "args", "match"),
    [
        # 1.1.0 returned a momentum outside [0, 1) (same-sign gains).
        ("from_pid", (0.5, 0.1, 4.5), "opposite signs"),
        # 1.1.0 divided by zero.
        ("from_pid", (-0.5, 0.1, 0.0), "k_d must be nonzero"),
        ("from_pid", (-0.5, 0.0, 4.5), "k_i must be in"),
        ("from_synthesized_nesterov", (0.1, 0.0, 0.5), "beta2 must be 0"),
        ("from_robust_momentum", (1.0, 1.0, None), "kappa must be in"),
        # 1.1.0 accepted parameters outside the source's domain.
        ("from_robust_momentum", (100.0, 100.0, 0.5), "rho must be in"),
        ("from_accsgd", (1e-3, 100.0, 11.0, 0.7), "xi must be in"),
        ("from_accsgd", (1e-3, 100.0, 5.0, 1.5), "eps must be in"),
        ("from_two_state_optimizer", (0.5, 0.1, 0.1, 0.1, 0.5, -0.1), "eigenvalue within 1e-9"),
        ("from_nadam", (1e-3, 1.0, 0.999), "beta1 must be in"),
        ("from_nadam", (1e-3, 0.9, -0.1), "beta2 must be in"),
        ("from_nadam", (-1e-3, 0.9, 0.999), "lr must be in"),
    ],
)
def test_invalid_inputs_raise_value_error(name: str, args: tuple[float, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        getattr(param_conv, name)(*args)
    with pytest.raises(ValueError, match=match):  # the same as convert, under 1.1.0's names
        if name == "from_nadam":
            validation.check_beta(args[1], "beta1")
            validation.check_beta(args[2], "beta2")
            convert.from_nadam(args[0], args[1:], 0.0)
        else:
            getattr(convert, name)(*args)


def test_degenerate_inputs_that_110_divided_by_zero_on() -> None:
    # Plain SGD.
    assert param_conv.from_pid(0.0, 0.1, 0.0) == (0.1, 0.0, 0.0)
    assert param_conv.from_synthesized_nesterov(0.1, 0.0, 0.0) == (0.1, 0.0, 0.0)
    # Two-state optimizers with QHM momentum 0 (h + q = 1) or lr 0 (theta never moves).
    tso = {"h": 0.5, "k": 0.5, "l": -0.1, "m": 0.5, "q": 0.5, "z": -0.1}
    assert param_conv.from_two_state_optimizer(**tso) == _as_110(
        convert.from_two_state_optimizer(**tso)
    )
    assert param_conv.from_two_state_optimizer(**tso) == pytest.approx((0.1, 0.0, 0.0))
    assert param_conv.from_two_state_optimizer(0.9, 0.0, 0.1, 0.0, 1.0, 0.0) == pytest.approx(
        (0.0, 0.0, 0.9)
    )
    for args in (tuple(tso.values()), (0.9, 0.0, 0.1, 0.0, 1.0, 0.0)):
        with pytest.raises(ZeroDivisionError):
            _two_state_110(*args)


def test_input_types() -> None:
    got = param_conv.from_pid(np.float32(-0.5), np.int64(1), 4.5)
    assert all(type(v) is float for v in got)
    assert got == param_conv.from_pid(-0.5, 1.0, 4.5)
    with pytest.raises(TypeError, match="beta1 must be a real number"):
        param_conv.from_nadam(1e-3, True, 0.999)
    # A concrete one-element array is the number it holds (the rule of every
    # backend); an array of several numbers is not one number.
    assert param_conv.from_accsgd(1e-3, 100.0, np.array([5.0]), 0.7) == param_conv.from_accsgd(  # type: ignore[arg-type]
        1e-3, 100.0, 5.0, 0.7
    )
    with pytest.raises(TypeError, match="must be a real number"):
        param_conv.from_accsgd(1e-3, 100.0, np.array([5.0, 6.0]), 0.7)  # type: ignore[arg-type]
