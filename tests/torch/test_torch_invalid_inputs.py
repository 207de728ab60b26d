"""The shared invalid-input table (conformance/invalid_inputs.py) against qhoptim.torch."""

from __future__ import annotations

import math
import re
from typing import Any

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


LR_ENTRIES = [e for e in INVALID if e.param == "lr" and e.error is ValueError]


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
