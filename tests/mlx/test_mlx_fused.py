"""qhoptim.mlx's C++ step (``fused``): the operations' step bit for bit, and when it is taken.

The kernel computes what MLX's operations compute, in the same order and
rounding, so a fused run equals the unfused one to the bit: float32 and
bfloat16 state (rounded stochastically by the rule, and to nearest), every
form of QHAdam's denominator, both weight decays, AMSGrad, eager and inside
``mx.compile``; arrays of any layout (a transposed or broadcast gradient, a
0-d and an empty parameter) and one large enough to be stepped in slices on
several threads. Its accuracy against the float64 reference is
the ``mlx-fused`` conformance rows (``test_mlx_conformance.py``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import qhoptim.mlx as qhmlx
from qhoptim.mlx import _extension

pytestmark = pytest.mark.skipif(
    not _extension.fused_extension_available(),
    reason="qhoptim.mlx's C++ step does not build here (a C++ compiler and nanobind)",
)

OPTIMIZERS = {
    "qhm": lambda **kw: qhmlx.QHM(0.1, momentum=0.9, nu=0.7, **kw),
    "qhm-nu1-coupled": lambda **kw: qhmlx.QHM(0.1, 0.9, 1.0, weight_decay=0.1, **kw),
    "qhm-nu0-decoupled": lambda **kw: qhmlx.QHM(
        0.1, 0.9, 0.0, weight_decay=0.1, decoupled_weight_decay=True, **kw
    ),
    "qhadam": lambda **kw: qhmlx.QHAdam(1e-2, nus=(0.7, 1.0), **kw),
    "qhadam-mix-coupled": lambda **kw: qhmlx.QHAdam(
        1e-2, (0.9, 0.99), (0.7, 0.5), weight_decay=0.01, **kw
    ),
    "qhadam-grad-only": lambda **kw: qhmlx.QHAdam(1e-2, (0.9, 0.99), (1.0, 0.0), **kw),
    # nu1 = 1: no gradient term in the numerator
    "qhadam-mix-nu1": lambda **kw: qhmlx.QHAdam(1e-2, (0.9, 0.99), (1.0, 0.5), **kw),
    "qhadamw-amsgrad": lambda **kw: qhmlx.QHAdamW(1e-2, nus=(0.7, 0.8), amsgrad=True, **kw),
}
STATES = {
    "float32": {},
    "bfloat16": {"state_dtype": mx.bfloat16},
    "bfloat16-nearest": {"state_dtype": mx.bfloat16, "stochastic_rounding": False},
}
#: ``big`` is stepped in slices on several threads where the machine has cores.
SHAPES = {"w": (24, 9), "b": (9,), "s": (), "e": (0,), "big": (2, 70_001)}


def _params() -> dict[str, mx.array]:
    rng = np.random.default_rng(0)
    return {k: mx.array(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}


def _grads(t: int) -> dict[str, mx.array]:
    """Gradients of every layout: ``w``'s transposed, ``b``'s broadcast from one value."""
    rng = np.random.default_rng(100 + t)
    w = mx.array(rng.standard_normal((9, 24)).astype(np.float32)).T
    b = mx.broadcast_to(mx.array(np.float32(rng.standard_normal())), (9,))
    s = mx.array(np.float32(rng.standard_normal()))
    big = mx.array(rng.standard_normal(SHAPES["big"]).astype(np.float32))
    return {"w": w, "b": b, "s": s, "e": mx.zeros((0,)), "big": big}


def _run(opt: Any, steps: int, compiled: bool | None) -> list[tuple[str, np.ndarray, Any]]:
    """The parameters and state after ``steps`` steps: (name, float32 values, dtype).

    ``compiled=None``: with MLX's compilation off, every operation its own
    kernel, so that no compiler can contract a product and a sum into a fused
    multiply-add (MLX's compiled kernels may, on CPUs that have one).
    """
    if compiled is None:
        mx.disable_compile()
        try:
            return _run(opt, steps, compiled=False)
        finally:
            mx.enable_compile()
    params = _params()

    def step(params: Any, grads: Any) -> Any:
        return opt.apply_gradients(grads, params)

    if compiled:
        state = [opt.state]
        step = mx.compile(step, inputs=state, outputs=state)
    for t in range(steps):
        params = step(params, _grads(t))
        mx.eval(params, opt.state)
    arrays = tree_flatten({"params": params, "state": opt.state})
    return [(k, np.array(v.astype(mx.float32)), v.dtype) for k, v in arrays]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_fused_step_gives_the_operations_bits(name: str, state: str, compiled: bool) -> None:
    fused = _run(OPTIMIZERS[name](fused=True, **STATES[state]), 4, compiled)
    unfused = _run(OPTIMIZERS[name](fused=False, **STATES[state]), 4, compiled=None)
    assert [k for k, *_ in fused] == [k for k, *_ in unfused]
    for (key, a, a_dtype), (_, b, b_dtype) in zip(fused, unfused, strict=True):
        assert a_dtype == b_dtype, key
        assert a.shape == b.shape, key
        np.testing.assert_array_equal(a, b, err_msg=key)
    # the runs moved: a step that did nothing would pass the comparison too
    moved = dict((k, v) for k, v, _ in fused)["params.w"]
    assert not np.array_equal(moved, np.array(_params()["w"]))


def test_a_resumed_fused_run_continues_bit_for_bit() -> None:
    def make() -> Any:
        return OPTIMIZERS["qhadamw-amsgrad"](fused=True, state_dtype=mx.bfloat16)

    whole = make()
    params = _params()
    for t in range(4):
        params = whole.apply_gradients(_grads(t), params)
    first, params2 = make(), _params()
    for t in range(2):
        params2 = first.apply_gradients(_grads(t), params2)
    mx.eval(params2, first.state)
    resumed = make()
    resumed.state = {k: v for k, v in first.state.items()}
    for t in range(2, 4):
        params2 = resumed.apply_gradients(_grads(t), params2)
    for key in SHAPES:
        np.testing.assert_array_equal(np.array(params[key]), np.array(params2[key]))


class _Spy:
    """Counts the C++ steps taken."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        module = _extension.fused_extension()

        class Counting:
            def fused_step(inner, *args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return module.fused_step(*args, **kwargs)

        monkeypatch.setattr(_extension, "fused_extension", lambda: Counting())


@pytest.mark.parametrize(
    ("options", "kernel_steps"),
    [
        ({}, 0),  # float32 state, fused=None: MLX's operations
        ({"state_dtype": mx.bfloat16}, 3),  # a bfloat16 state steps in the kernel by default
        ({"state_dtype": mx.bfloat16, "fused": False}, 0),
        ({"fused": True}, 3),
    ],
)
def test_which_parameters_step_in_the_kernel(
    options: dict[str, Any], kernel_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    opt = qhmlx.QHAdam(1e-2, **options)
    params = {
        "a": mx.ones((3,)),
        "b": mx.ones((2, 2)),
        "c": mx.ones((4,)),
        "d": mx.ones((3,), dtype=mx.float64),  # another dtype: MLX's operations
    }
    grads = {k: mx.full(v.shape, 0.5, dtype=v.dtype) for k, v in params.items()}
    if options.get("state_dtype") is not None:
        del params["d"], grads["d"]  # a bfloat16 state is narrower than float32 only
    mx.eval(opt.apply_gradients(grads, params))
    assert spy.calls == kernel_steps


def test_fused_none_takes_mlxs_operations_where_the_kernel_does_not_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params, grads = _params(), _grads(0)
    expected = qhmlx.QHM(0.1, state_dtype=mx.bfloat16, fused=False).apply_gradients(grads, params)
    monkeypatch.setattr(_extension, "_built", lambda: (None, "it needs nanobind"))
    got = qhmlx.QHM(0.1, state_dtype=mx.bfloat16).apply_gradients(grads, params)
    for key in SHAPES:
        np.testing.assert_array_equal(np.array(got[key]), np.array(expected[key]))
    with pytest.raises(RuntimeError, match=r"it needs nanobind.*fused=False"):
        qhmlx.QHM(0.1, fused=True).apply_gradients(grads, params)


@pytest.mark.parametrize("cls", [qhmlx.QHM, qhmlx.QHAdam, qhmlx.QHAdamW])
def test_invalid_fused_settings_are_refused(cls: type) -> None:
    with pytest.raises(TypeError, match=r"fused must be a bool; received fused='yes'"):
        cls(0.1, fused="yes")
    # float16 state is refused for QHAdam's second moment before fused is read
    state_dtype = mx.float16 if cls is qhmlx.QHM else mx.float64
    with pytest.raises(ValueError, match=r"fused=True stores the state in float32 or bfloat16"):
        cls(0.1, state_dtype=state_dtype, fused=True)


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("name", ["qhm", "qhadamw-amsgrad"])
def test_arrays_the_caller_still_holds_are_left_as_they_were(name: str, state: str) -> None:
    # The kernel writes over an old array only where MLX donates it (nothing
    # else holds it); here the caller keeps every old parameter and state.
    opt = OPTIMIZERS[name](fused=True, **STATES[state])
    params = _params()
    params = opt.apply_gradients(_grads(0), params)
    mx.eval(params, opt.state)
    held = tree_flatten({"params": params, "state": opt.state})  # the arrays themselves
    before = [np.array(v.astype(mx.float32)) for _, v in held]
    new = opt.apply_gradients(_grads(1), params)
    mx.eval(new, opt.state)
    for (key, array), was in zip(held, before, strict=True):
        np.testing.assert_array_equal(np.array(array.astype(mx.float32)), was, err_msg=key)
    assert not np.array_equal(np.array(new["big"]), np.array(params["big"]))


def test_a_learning_rate_of_shape_1_steps_as_a_number() -> None:
    params, grads = _params(), _grads(0)
    want = qhmlx.QHAdam(0.01, fused=True).apply_gradients(grads, params)
    lr = mx.array([0.01], dtype=mx.float32)
    got = qhmlx.QHAdam(lr, fused=True).apply_gradients(grads, params)
    for key in SHAPES:
        np.testing.assert_array_equal(np.array(got[key]), np.array(want[key]))


def test_a_shapeless_compiled_step_takes_the_kernel() -> None:
    # The primitive states its outputs' shapes (MLX's view, which the
    # operations' bfloat16 rounding needs, cannot), so shapeless=True compiles.
    opt = qhmlx.QHAdam(1e-2, nus=(0.7, 1.0), state_dtype=mx.bfloat16, fused=True)
    eager = qhmlx.QHAdam(1e-2, nus=(0.7, 1.0), state_dtype=mx.bfloat16, fused=True)
    params = _params()
    opt.init(params)
    state = [opt.state]
    step = mx.compile(
        lambda p, g: opt.apply_gradients(g, p), inputs=state, outputs=state, shapeless=True
    )
    compiled, plain = params, params
    for t in range(3):
        compiled = step(compiled, _grads(t))
        plain = eager.apply_gradients(_grads(t), plain)
    for key in SHAPES:
        np.testing.assert_array_equal(np.array(compiled[key]), np.array(plain[key]))


@pytest.mark.parametrize("state_dtype", [None, mx.bfloat16])
@pytest.mark.parametrize("cls", [qhmlx.QHM, qhmlx.QHAdam])
def test_a_gradient_that_broadcasts_against_its_parameter_steps_as_mlx_s_operations(
    cls: type, state_dtype: Any
) -> None:
    # A (3,) gradient of a (4, 3) parameter, as MLX's SGD takes it: the C++
    # step takes a gradient of its parameter's shape, so this one takes MLX's
    # operations (it was refused).
    def run(fused: bool) -> tuple[mx.array, list[mx.array]]:
        opt = cls(learning_rate=0.1, state_dtype=state_dtype, fused=fused)
        params = {"w": mx.ones((4, 3))}
        for t in range(3):
            params = opt.apply_gradients({"w": mx.array([1.0, 0.5, -0.25]) * (t + 1)}, params)
        # A float32 state left of the gradient's shape (3,), then a gradient of
        # the parameter's: the state's shape differs, MLX's operations take it.
        params = opt.apply_gradients({"w": mx.full((4, 3), 0.5)}, params)
        return params["w"], [v for k, v in opt.state["w"].items()]

    (fused_w, fused_state), (plain_w, plain_state) = run(True), run(False)
    assert mx.array_equal(fused_w, plain_w).item()
    for a, b in zip(fused_state, plain_state, strict=True):
        assert mx.array_equal(a, b).item()
