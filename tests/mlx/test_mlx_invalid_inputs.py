"""The shared invalid-input table (conformance/invalid_inputs.py) against qhoptim.mlx."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

from conformance.invalid_inputs import (
    INVALID,
    NAMES,
    Invalid,
    assert_fixed_after_construction,
    assert_refused_when_set,
    backend_kwargs,
    pattern,
)
from qhoptim import reference
from qhoptim.mlx import QHM, QHAdam, QHAdamW, QHMuon

FAMILIES = [("qhm", QHM), ("qhadam", QHAdam), ("qhadam", QHAdamW)]
CASES = [(family, cls, e) for family, cls in FAMILIES for e in INVALID if e.applies_to(family)]
IDS = [f"{cls.__name__}-{entry.id}" for _, cls, entry in CASES]


@pytest.mark.parametrize("fused", [None, False, True], ids=["default", "operations", "fused"])
@pytest.mark.parametrize(("family", "cls", "entry"), CASES, ids=IDS)
def test_constructor_rejects(family: str, cls: type, entry: Invalid, fused: bool | None) -> None:
    # Every path (MLX's operations, the C++ step) is refused alike, before any step.
    with pytest.raises(entry.error, match=pattern(entry, NAMES["mlx"][entry.param])):
        cls(**backend_kwargs("mlx", family, entry), fused=fused)


def test_every_mlx_argument_of_the_table_is_tried() -> None:
    tried = {NAMES["mlx"][e.param] for _, _, e in CASES}
    assert tried == {"learning_rate", "momentum", "nu", "weight_decay"} | {
        "betas[0]", "betas[1]", "nus[0]", "nus[1]", "eps", "betas", "nus",
    }  # fmt: skip


@pytest.mark.parametrize(
    "learning_rate",
    [
        mx.array(0.1),
        mx.array(0.1, dtype=mx.float64),
        optim.cosine_decay(0.1, 100),
        lambda step: 0.1 * 0.9**step,
    ],
    ids=["float32-array", "float64-array", "mlx-schedule", "callable"],
)
def test_arrays_and_schedules_are_passed_through(learning_rate) -> None:
    # Not concrete numbers: their value is known only when a step runs.
    for opt in (QHM(learning_rate), QHAdam(learning_rate), QHAdamW(learning_rate)):
        assert opt.learning_rate.size == 1


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda a: QHM(0.1, momentum=a), "momentum"),
        (lambda a: QHM(0.1, nu=a), "nu"),
        (lambda a: QHAdam(0.1, betas=(a, 0.999)), r"betas\[0\]"),
        (lambda a: QHAdamW(0.1, nus=(0.7, a)), r"nus\[1\]"),
        (lambda a: QHAdam(0.1, weight_decay=a), "weight_decay"),
        (lambda a: QHMuon(0.1, nu=a), "nu"),
    ],
)
def test_a_hyperparameter_array_of_several_elements_is_refused(make, name: str) -> None:
    # The compiled steps take each as one number (MLX's own optimizers accept
    # an array and fail at the step); a one-element array is that number.
    with pytest.raises(
        ValueError, match=rf"^{name} must be one number; received an array of shape \(4,\)"
    ):
        make(mx.array([0.1, 0.3, 0.5, 0.7]))
    with pytest.raises(
        ValueError, match=rf"^{name} must not be empty; received an array of shape \(0,\)"
    ):
        make(mx.array([]))
    make(mx.array([0.5]))


def _schedule() -> float:
    return 0.5


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda f: QHM(0.1, nu=f), "nu"),
        (lambda f: QHAdam(0.1, nus=(f, 1.0)), r"nus\[0\]"),
        (lambda f: QHMuon(0.1, momentum=f), "momentum"),
    ],
)
def test_a_schedule_is_refused_but_for_the_learning_rate(make: Any, name: str) -> None:
    # It passed, and the first step failed inside the compiled step.
    with pytest.raises(
        TypeError, match=rf"^{name} must be a real number; received {name}=<function"
    ):
        make(_schedule)
    opt = QHM(0.1)
    with pytest.raises(TypeError, match=r"^nu must be a real number"):
        opt.nu = _schedule
    assert opt.nu == 0.7


SET_LATER = [
    (QHM, "momentum", 1.0, r"momentum must be in \[0, 1\); received momentum=1.0"),
    (QHM, "nu", float("nan"), r"nu must be a finite real number"),
    (QHM, "weight_decay", -1.0, r"weight_decay must be in \[0, inf\)"),
    (QHAdam, "betas", (1.5, 0.999), r"betas\[0\] must be in \[0, 1\); received betas\[0\]=1.5"),
    (QHAdamW, "nus", (0.7, 1.5), r"nus\[1\] must be in \[0, 1\]"),
    (QHAdam, "eps", -1e-8, r"eps must be in \[0, inf\)"),
    (QHMuon, "momentum", 1.0, r"momentum must be in \[0, 1\)"),
    (QHMuon, "nu", mx.array([0.1, 0.2]), r"nu must be one number"),
    (QHMuon, "ns_steps", -1, r"ns_steps must be in \[0, 100\); received ns_steps=-1"),
    (
        QHMuon,
        "ns_dtype",
        "x",
        r"ns_dtype must be None or one of mx\.bfloat16, .*received ns_dtype='x'",
    ),
]


@pytest.mark.parametrize(
    ("cls", "name", "value", "message"),
    SET_LATER,
    ids=[f"{c.__name__}-{n}" for c, n, _, _ in SET_LATER],
)
def test_a_hyperparameter_set_later_is_checked_as_the_constructor_checks_it(
    cls: type, name: str, value: object, message: str
) -> None:
    # MLX's own optimizers take opt.momentum = 1.5 and step by it; the value
    # before stays.
    opt = cls(0.1)
    assert_refused_when_set(opt, name, value, message)
    if name in ("ns_steps", "ns_dtype"):
        return
    if name in ("betas", "nus"):
        assert_refused_when_set(opt, name, None, rf"{name} must be a pair of two numbers")
    else:
        assert_refused_when_set(opt, name, None, rf"{name} must be a real number", TypeError)
    # Kept as the constructor keeps it: Python floats, whatever held them (a
    # NumPy scalar fails the compiled step; a one-element array would change
    # a 0-d parameter's shape).
    for given in (np.float32(0.5), mx.array([0.5])):
        setattr(opt, name, (given, given) if name in ("betas", "nus") else given)
        kept = getattr(opt, name)
        assert all(
            type(x) is float and x == 0.5 for x in (kept if isinstance(kept, tuple) else (kept,))
        )


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHMuon])
@pytest.mark.parametrize(("name", "value"), [("state_dtype", None), ("stochastic_rounding", False)])
def test_the_state_s_dtype_and_rounding_are_fixed_when_the_optimizer_is_made(
    cls: type, name: str, value: object
) -> None:
    # The state is made in them: changed later, they would no longer describe
    # it (or change nothing). The same value is taken.
    assert_fixed_after_construction(
        cls(0.1, state_dtype=mx.bfloat16, stochastic_rounding=True), name, value
    )


@pytest.mark.parametrize("value", [1, 0, "yes", None, mx.array(True)], ids=repr)
@pytest.mark.parametrize("cls", [QHAdam, QHAdamW])
def test_amsgrad_must_be_a_bool_as_in_the_reference(cls: type, value) -> None:
    with pytest.raises(TypeError) as want:
        reference.QHAdam(amsgrad=value)
    with pytest.raises(TypeError) as got:
        cls(1e-3, amsgrad=value)
    assert str(got.value) == str(want.value)


# ------------------------------------------------------------------- QHMuon
QHMUON_CASES = [e for e in INVALID if e.applies_to("qhm")]


@pytest.mark.parametrize("entry", QHMUON_CASES, ids=[e.id for e in QHMUON_CASES])
def test_qhmuon_rejects_the_table(entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["mlx"][entry.param])):
        QHMuon(**backend_kwargs("mlx", "qhm", entry))


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW, QHMuon])
def test_a_learning_rate_set_later_is_checked_as_the_constructor_checks_it(cls: type) -> None:
    # MLX's own optimizers take a negative one and step uphill.
    opt = cls(learning_rate=0.01)
    with pytest.raises(
        ValueError, match=r"learning_rate must be in \[0, inf\); received learning_rate=-0.1"
    ):
        opt.learning_rate = -0.1
    assert opt.learning_rate.item() == pytest.approx(0.01)
    opt.learning_rate = mx.array(0.5)
    assert opt.learning_rate.item() == 0.5
    with pytest.raises(ValueError, match=r"received learning_rate=nan"):
        opt.learning_rate = mx.array(float("nan"))
    # An array of several made each parameter the broadcast of both shapes.
    several = r"^learning_rate must be one number; received an array of shape \(2, 1\)$"
    with pytest.raises(ValueError, match=several):
        opt.learning_rate = mx.array([[0.1], [0.2]])
    assert opt.learning_rate.item() == 0.5
    with pytest.raises(ValueError, match=several):
        cls(learning_rate=mx.array([[0.1], [0.2]]))
    restored = dict(opt.state) | {"learning_rate": mx.array([[0.1], [0.2]])}
    with pytest.raises(ValueError, match=several):
        opt.state = restored
    assert opt.learning_rate.item() == 0.5


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW, QHMuon])
def test_a_learning_rate_restored_with_a_state_is_checked(cls: type) -> None:
    # opt.state = ... (a checkpoint's state) sets the learning rate MLX reads.
    opt = cls(learning_rate=0.01)
    opt.init({"w": mx.ones((4, 4))})
    restored = dict(opt.state) | {"learning_rate": mx.array(-0.5)}
    with pytest.raises(
        ValueError, match=r"learning_rate must be in \[0, inf\); received learning_rate=-0.5"
    ):
        opt.state = restored
    assert opt.learning_rate.item() == pytest.approx(0.01)
    opt.state = dict(restored) | {"learning_rate": mx.array(0.5)}
    assert opt.learning_rate.item() == 0.5
    # A scheduled learning rate is the schedule's at the next step.
    scheduled = cls(learning_rate=lambda step: 0.01 * mx.ones_like(step))
    scheduled.init({"w": mx.ones((4, 4))})
    scheduled.state = dict(scheduled.state) | {"learning_rate": mx.array(-0.5)}
    scheduled.apply_gradients({"w": mx.ones((4, 4))}, {"w": mx.ones((4, 4))})
    assert scheduled.learning_rate.item() == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("cls", "name", "value", "message"),
    [
        (QHAdam, "betas", np.array([0.9, 0.999]), r"betas must be a pair of two numbers"),
        (QHAdam, "nus", mx.array([0.7, 1.0]), r"nus must be a pair of two numbers"),
        (QHM, "decoupled_weight_decay", "False", r"decoupled_weight_decay must be a bool"),
        (QHAdam, "amsgrad", "no", r"amsgrad must be a bool"),
        (QHAdam, "fused", "yes", r"fused must be a bool"),
    ],
)
def test_a_pair_or_a_switch_set_later_is_refused_in_the_constructor_s_words(
    cls: type, name: str, value: object, message: str
) -> None:
    # A truthy string switched decoupled decay or AMSGrad on; an array where a
    # pair belongs was said not to be one number.
    opt = cls(0.1)
    error = ValueError if name in ("betas", "nus") else TypeError
    assert_refused_when_set(opt, name, value, message, error)


@pytest.mark.parametrize("state_dtype", [mx.float16, mx.float64])
def test_fused_set_later_is_refused_where_the_constructor_refuses_it(state_dtype: Any) -> None:
    # The C++ step stores float32 or bfloat16 state only; set later, fused=True
    # was taken and the step quietly ran MLX's operations.
    message = r"fused=True stores the state in float32 or bfloat16"
    with pytest.raises(ValueError, match=message):
        QHM(0.1, state_dtype=state_dtype, fused=True)
    assert_refused_when_set(QHM(0.1, state_dtype=state_dtype), "fused", True, message)
