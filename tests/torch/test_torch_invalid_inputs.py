"""The shared invalid-input table (conformance/invalid_inputs.py) against qhoptim.torch."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import numpy as np
import pytest
import torch

from conformance.invalid_inputs import CONVERSIONS, INVALID, NAMES, Invalid, backend_kwargs, pattern
from qhoptim.torch import QHM, QHAdam, QHAdamW

FAMILIES = [("qhm", QHM), ("qhadam", QHAdam), ("qhadamw", QHAdamW)]
CASES = [
    (cls, entry)
    for family, cls in FAMILIES
    for entry in INVALID
    if entry.applies_to("qhm" if family == "qhm" else "qhadam")
]
IDS = [f"{cls.__name__}-{entry.id}" for cls, entry in CASES]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]


def _kwargs(cls: type, entry: Invalid) -> dict[str, Any]:
    return backend_kwargs("torch", "qhm" if cls is QHM else "qhadam", entry)


@pytest.mark.parametrize(("cls", "entry"), CASES, ids=IDS)
def test_constructor_rejects(cls: type, entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["torch"][entry.param])):
        cls(_params(), **_kwargs(cls, entry))


@pytest.mark.parametrize(("cls", "entry"), CASES, ids=IDS)
def test_added_param_group_rejects_and_changes_nothing(cls: type, entry: Invalid) -> None:
    opt = cls(_params(), lr=0.1)
    before = opt.state_dict()
    group = {"params": [torch.nn.Parameter(torch.ones(2))], **_kwargs(cls, entry)}
    with pytest.raises(entry.error, match=pattern(entry, NAMES["torch"][entry.param])):
        opt.add_param_group(group)
    assert opt.state_dict() == before


LR_ENTRIES = [
    e
    for e in INVALID
    if e.param == "lr" and e.error is ValueError and not isinstance(e.value, np.ndarray)
]


@pytest.mark.parametrize("entry", LR_ENTRIES, ids=[e.id for e in LR_ENTRIES])
def test_a_tensor_lr_is_checked_by_value(entry: Invalid) -> None:
    lr = torch.tensor(float(entry.value), dtype=torch.float64)
    shown = repr(float(entry.value))
    if math.isinf(float(entry.value)):
        shown = "inf" if float(entry.value) > 0 else "-inf"
    want = f"^lr must be in \\[0, inf\\); received lr={shown}$"
    for cls in (QHM, QHAdam):
        with pytest.raises(ValueError, match=want):
            cls(_params(), lr=lr)


@pytest.mark.parametrize("lr", [torch.tensor(0.1), torch.tensor([0.05]), torch.tensor(0.0)])
def test_valid_tensor_lrs_pass_and_step(lr: torch.Tensor) -> None:
    for cls in (QHM, QHAdam, QHAdamW):
        params = _params()
        opt = cls(params, lr=lr)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (QHM, {"momentum": torch.tensor(0.9)}, "momentum"),
        (QHM, {"nu": torch.tensor(0.7)}, "nu"),
        (QHAdam, {"betas": (torch.tensor(0.9), 0.999)}, "betas[0]"),
        (QHAdam, {"nus": (0.7, torch.tensor(1.0))}, "nus[1]"),
        (QHAdamW, {"eps": torch.tensor(1e-8)}, "eps"),
        (QHAdamW, {"weight_decay": torch.tensor(0.01)}, "weight_decay"),
    ],
)
def test_tensor_hyperparameters_other_than_lr_are_refused(
    cls: type, kwargs: dict[str, Any], name: str
) -> None:
    # The steps fold them into Python-float coefficients: a tensor would fail
    # inside step(), or be read once and its later changes ignored.
    message = rf"^{re.escape(name)} must be a Python number \(only lr may be a tensor\); "
    with pytest.raises(TypeError, match=message + re.escape(f"received {name}=tensor(")):
        cls(_params(), lr=0.1, **kwargs)
    opt = cls(_params(), lr=0.1)
    with pytest.raises(TypeError, match=message):
        opt.add_param_group({"params": _params(), **kwargs})
    assert len(opt.param_groups) == 1


def test_missing_lr_is_still_torchs_error() -> None:
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        QHM(_params())


@pytest.mark.parametrize("case", CONVERSIONS, ids=[c.function for c in CONVERSIONS])
def test_conversion_class_methods_reject(case: Any) -> None:
    cls = QHAdam if case.function in ("from_adam", "from_nadam", "from_rmsprop") else QHM
    with pytest.raises(case.error, match=case.match):
        getattr(cls, case.function)(**case.kwargs)


# ------------------------------------------- concrete scalars of other kinds: floats
NUMPY_SCALARS = [
    (QHAdam, {"weight_decay": np.array(0.1)}),
    (QHAdam, {"betas": (0.9, np.array(0.99))}),
    (QHAdam, {"nus": (np.array([0.7]), np.float32(0.5)), "eps": np.array(1e-3)}),
    (QHAdamW, {"weight_decay": np.array([0.1], np.float32), "lr": np.array(0.01)}),
    (QHM, {"momentum": np.array(0.9), "nu": np.array([0.7]), "weight_decay": np.array(0.1)}),
]


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every array replaced by the Python float it holds."""

    def number(v: Any) -> Any:
        return tuple(map(number, v)) if isinstance(v, tuple) else float(np.asarray(v).item())

    return {k: number(v) for k, v in kwargs.items()}


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize(("cls", "kwargs"), NUMPY_SCALARS)
def test_numpy_scalars_are_read_as_floats(cls: type, kwargs: dict, foreach: bool | None) -> None:
    # A 0-d NumPy array used to pass validation, and then step() failed in
    # _foreach_add after QHAdam's step count had advanced.
    kwargs = {"lr": 0.1, **kwargs}
    plain = _plain(kwargs)
    torch.manual_seed(0)
    want = _steps(cls(ps := _params(), foreach=foreach, **plain), ps)
    torch.manual_seed(0)
    opt = cls(ps := _params(), foreach=foreach, **kwargs)
    assert {k: opt.param_groups[0][k] for k in plain} == plain
    assert all(type(x) is float for k in plain for x in np.ravel(opt.param_groups[0][k]).tolist())
    got = _steps(opt, ps)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(("cls", "kwargs"), NUMPY_SCALARS)
def test_numpy_scalars_in_added_and_loaded_groups_are_read_as_floats(
    cls: type, kwargs: dict
) -> None:
    kwargs = {"lr": 0.1, **kwargs}
    plain = _plain(kwargs)
    opt = cls(_params(), lr=0.1)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **kwargs})
    assert {k: opt.param_groups[1][k] for k in plain} == plain
    _steps(opt, [p for g in opt.param_groups for p in g["params"]])
    state = opt.state_dict()
    state["param_groups"][1].update(kwargs)
    fresh = cls(_params(), lr=0.1)
    fresh.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    fresh.load_state_dict(state)
    assert {k: fresh.param_groups[1][k] for k in plain} == plain
    _steps(fresh, [p for g in fresh.param_groups for p in g["params"]])


@pytest.mark.parametrize(
    ("cls", "name", "kwargs_of"),
    [
        (QHM, "lr", lambda a: {"lr": a}),
        (QHM, "momentum", lambda a: {"momentum": a}),
        (QHM, "nu", lambda a: {"nu": a}),
        (QHAdam, "betas[0]", lambda a: {"betas": (a, 0.999)}),
        (QHAdamW, "nus[1]", lambda a: {"nus": (0.7, a)}),
        (QHAdam, "eps", lambda a: {"eps": a}),
        (QHAdam, "weight_decay", lambda a: {"weight_decay": a}),
    ],
)
@pytest.mark.parametrize("foreach", [False, True])
def test_a_hyperparameter_array_of_several_or_no_elements_is_refused(
    cls: type, name: str, kwargs_of: Any, foreach: bool
) -> None:
    # The steps fold each into a Python number: an array of several passed
    # the range checks and failed inside the step, after QHM's buffer had moved.
    escaped = re.escape(name)
    for value, message in [
        (
            np.array([0.1, 0.3]),
            rf"^{escaped} must be one number; received an array of shape \(2,\)$",
        ),
        (np.array([]), rf"^{escaped} must not be empty; received an array of shape \(0,\)$"),
    ]:
        with pytest.raises(ValueError, match=message):
            cls(_params(), **{"lr": 0.1, **kwargs_of(value)})
        # Set in a group later: the next step refuses it and changes nothing.
        opt = cls(ps := _params(), lr=0.1, foreach=foreach)
        _steps(opt, ps)
        before = ([p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict()))
        opt.param_groups[0].update(kwargs_of(value))
        with pytest.raises(ValueError, match=message):
            opt.step()
        for a, b in zip(ps, before[0], strict=True):
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
        after = opt.state_dict()
        for key, state in before[1]["state"].items():
            for k, v in state.items():
                torch.testing.assert_close(after["state"][key][k], v, rtol=0, atol=0)


@pytest.mark.parametrize("flags", [{"foreach": True}, {"foreach": False}, {"capturable": True}])
def test_a_pair_changed_in_place_or_for_an_equal_one_is_checked_again(flags: dict) -> None:
    # A list changed in place was the object checked, and an equal pair of
    # other types compared equal: neither was checked again (a nan stepped
    # the parameters to nan; an array element failed after they had moved).
    opt = QHAdam(ps := _params(), lr=0.1, betas=[0.9, 0.99], nus=[0.7, 0.8], **flags)
    _steps(opt, ps)
    opt.param_groups[0]["betas"] = (0.9, np.array(0.99))  # equal, of another type: read as floats
    opt.step()
    assert all(type(x) is float for x in opt.param_groups[0]["betas"])
    opt.param_groups[0]["betas"] = [0.9, 0.99]
    opt.step()
    for key, i, bad, error, message in [
        (
            "betas",
            0,
            math.nan,
            ValueError,
            r"^betas\[0\] must be in \[0, 1\); received betas\[0\]=nan$",
        ),
        ("nus", 1, 1.5, ValueError, r"^nus\[1\] must be in \[0, 1\]; received nus\[1\]=1.5$"),
        ("nus", 1, True, TypeError, r"^nus\[1\] must be a real number; received nus\[1\]=True$"),
    ]:
        before = [p.detach().clone() for p in ps]
        good = opt.param_groups[0][key][i]
        opt.param_groups[0][key][i] = bad
        with pytest.raises(error, match=message):
            opt.step()
        for p, b in zip(ps, before, strict=True):
            torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
        opt.param_groups[0][key][i] = good


def test_arrays_out_of_range_and_an_empty_tensor_lr_take_the_shared_wording() -> None:
    # As every backend words them: the range first, then "one number".
    with pytest.raises(ValueError, match=r"^momentum must be in \[0, 1\); received momentum=array"):
        QHM(_params(), lr=0.1, momentum=np.array([0.5, 1.5]))
    with pytest.raises(
        ValueError, match=r"^lr must not be empty; received an array of shape \(0,\)$"
    ):
        QHM(_params(), lr=torch.zeros(0))


@pytest.mark.parametrize("name", ["momentum", "nu", "weight_decay"])
def test_qhmuon_refuses_a_hyperparameter_array_of_several_elements(name: str) -> None:
    from qhoptim.torch import QHMuon

    with pytest.raises(
        ValueError, match=rf"^{name} must be one number; received an array of shape \(2,\)$"
    ):
        QHMuon([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1, **{name: np.array([0.1, 0.2])})


def _schedule() -> float:
    return 0.5


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda f: QHM(_params(), lr=f), "lr"),
        (lambda f: QHM(_params(), lr=0.1, momentum=f), "momentum"),
        (lambda f: QHAdam(_params(), lr=0.1, weight_decay=f), "weight_decay"),
        (lambda f: QHAdamW(_params(), lr=0.1, nus=(0.7, f)), r"nus\[1\]"),
    ],
)
def test_a_schedule_is_refused_as_a_non_number(make: Any, name: str) -> None:
    # It passed, and the first step failed inside the kernels.
    with pytest.raises(
        TypeError, match=rf"^{name} must be a real number; received {name}=<function"
    ):
        make(_schedule)


# ------------------------------------------------------------------- QHMuon
QHMUON_CASES = [e for e in INVALID if e.applies_to("qhm")]


@pytest.mark.parametrize("entry", QHMUON_CASES, ids=[e.id for e in QHMUON_CASES])
def test_qhmuon_rejects_the_table_at_construction_and_in_added_groups(entry: Invalid) -> None:
    from qhoptim.torch import QHMuon

    kwargs = backend_kwargs("torch", "qhm", entry)
    want = pattern(entry, NAMES["torch"][entry.param])
    with pytest.raises(entry.error, match=want):
        QHMuon([torch.nn.Parameter(torch.randn(3, 2))], **kwargs)
    opt = QHMuon([torch.nn.Parameter(torch.randn(3, 2))], lr=0.1)
    before = opt.state_dict()
    with pytest.raises(entry.error, match=want):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, 2))], **kwargs})
    assert opt.state_dict() == before
