"""The public surface: classes, signatures (a superset of qhoptim 1.1.0), errors, dispatch."""

from __future__ import annotations

import inspect
import math
from typing import Any
from unittest import mock

import pytest
import torch

import qhoptim.torch as qht
from qhoptim import convert, validation
from qhoptim.torch import QHM, QHAdam, QHAdamW


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]


# ------------------------------------------------------------------- classes
@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
def test_classes_are_torch_optimizers(cls: type) -> None:
    assert issubclass(cls, torch.optim.Optimizer)
    opt = cls(_params(), lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert "Args:" in (cls.__doc__ or "")
    for fragment in ("maximize (bool, optional)", "foreach (bool, optional)", "differentiable"):
        assert fragment in (cls.__doc__ or "")


def test_pyt_keeps_the_1_1_0_import_path_names_and_defaults() -> None:
    from qhoptim import pyt

    # qhoptim.pyt's classes are qhoptim.torch's, with 1.1.0's signatures.
    for name in ("QHM", "QHAdam", "QHAdamW"):
        assert issubclass(getattr(pyt, name), getattr(qht, name))
        assert getattr(pyt, name).__name__ == name
    # 1.1.0's spellings are read silently (warnings are errors in this suite).
    qhm = pyt.QHM(_params(), 1.0, 0.9, 0.7, 0.1, "direct")
    assert qhm.defaults["decoupled_weight_decay"] is True
    qhadam = pyt.QHAdam(_params(), 1e-3, (0.9, 0.999), (0.7, 1.0), 0.1, True)
    assert qhadam.defaults["decoupled_weight_decay"] is True
    assert (
        pyt.QHAdam(_params(), decouple_weight_decay=False).defaults["decoupled_weight_decay"]
        is False
    )
    # 1.1.0's QHAdamW did not decay unless asked to.
    qhadamw = pyt.QHAdamW(_params())
    assert qhadamw.defaults["weight_decay"] == 0.0
    assert qhadamw.defaults["decoupled_weight_decay"] is True


@pytest.mark.parametrize("name", ["QHM", "QHAdam"])
def test_pyt_takes_decoupled_weight_decay_and_refuses_a_spelling_that_disagrees(
    name: str,
) -> None:
    # qhoptim.pyt passed 1.1.0's default spelling ("grad", False) always, and
    # decoupled_weight_decay=True was silently taken as L2 decay.
    from qhoptim import pyt

    cls = getattr(pyt, name)
    opt = cls(_params(), lr=0.1, weight_decay=0.1, decoupled_weight_decay=True)
    assert opt.defaults["decoupled_weight_decay"] is True
    assert cls(_params(), lr=0.1, weight_decay=0.1).defaults["decoupled_weight_decay"] is False
    legacy = {"weight_decay_type": "grad"} if name == "QHM" else {"decouple_weight_decay": False}
    with pytest.raises(ValueError, match=r"means decoupled_weight_decay=False, .*give one"):
        cls(_params(), lr=0.1, decoupled_weight_decay=True, **legacy)
    # Either way round, in both modules: an explicit False is not the default.
    legacy = {"weight_decay_type": "direct"} if name == "QHM" else {"decouple_weight_decay": True}
    for module_cls in (cls, {"QHM": QHM, "QHAdam": QHAdam}[name]):
        with pytest.raises(
            ValueError,
            match=r"means decoupled_weight_decay=True, and decoupled_weight_decay=False .*give one",
        ):
            module_cls(_params(), lr=0.1, decoupled_weight_decay=False, **legacy)
        with pytest.raises(ValueError, match=r"give one"):
            module_cls([{"params": _params(), "decoupled_weight_decay": False, **legacy}], lr=0.1)


@pytest.mark.parametrize("name", ["QHM", "QHAdam"])
def test_a_1_1_0_group_loads_into_an_optimizer_built_with_the_other_decay(name: str) -> None:
    # The saved group's legacy key is its own setting, not one given beside
    # the loading optimizer's decoupled_weight_decay.
    from qhoptim import pyt

    cls = getattr(pyt, name)
    legacy = {"weight_decay_type": "grad"} if name == "QHM" else {"decouple_weight_decay": False}
    params = _params()
    saved = cls(params, lr=0.1).state_dict()
    saved["param_groups"][0].pop("decoupled_weight_decay")
    saved["param_groups"][0].update(legacy)  # as 1.1.0 wrote it
    opt = cls(_params(), lr=0.1, decoupled_weight_decay=True)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    assert next(iter(legacy)) not in opt.param_groups[0]


def test_a_legacy_decay_key_set_on_a_group_later_is_read_or_refused() -> None:
    # 1.1.0 read weight_decay_type at every step: set later, it is read where
    # it agrees with the group's decoupled_weight_decay and refused where not,
    # before anything moves (never silently ignored).
    from qhoptim import pyt

    params = _params()
    opt = pyt.QHM(params, lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["weight_decay_type"] = "direct"
    with pytest.raises(ValueError, match=r"weight_decay_type='direct' means .*give one"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.param_groups[0]["weight_decay_type"] = "grad"
    opt.step()
    assert "weight_decay_type" not in opt.param_groups[0]
    assert opt.param_groups[0]["decoupled_weight_decay"] is False


def test_qhadamw_is_a_class_with_decoupled_decay() -> None:
    opt = QHAdamW(_params())
    assert isinstance(opt, QHAdam)
    assert opt.defaults["decoupled_weight_decay"] is True
    assert opt.defaults["weight_decay"] == 1e-2  # torch's AdamW default


@pytest.mark.parametrize(
    ("cls", "legacy", "decoupled"),
    [
        (QHM, {"weight_decay_type": "direct"}, True),
        (QHM, {"weight_decay_type": "grad"}, False),
        (QHAdam, {"decouple_weight_decay": True}, True),
    ],
)
def test_legacy_weight_decay_names_warn_and_still_work(
    cls: type, legacy: dict[str, object], decoupled: bool
) -> None:
    with pytest.warns(DeprecationWarning, match="use decoupled_weight_decay="):
        opt = cls(_params(), lr=0.1, weight_decay=0.1, **legacy)
    assert opt.defaults["decoupled_weight_decay"] is decoupled
    assert next(iter(legacy)) not in opt.defaults
    with pytest.warns(DeprecationWarning):
        opt.add_param_group({"params": _params(), **legacy})
    assert opt.param_groups[1]["decoupled_weight_decay"] is decoupled


def test_decoupled_weight_decay_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="decoupled_weight_decay must be a bool"):
        QHAdam(_params(), decoupled_weight_decay=1)


@pytest.mark.parametrize("legacy", ["decouple_weight_decay", "decoupled_weight_decay"])
@pytest.mark.parametrize("value", [False, True])
def test_qhadamw_takes_no_weight_decay_switch(legacy: str, value: bool) -> None:
    # qhoptim 1.1.0's rename would otherwise turn QHAdamW's decay into L2.
    with pytest.raises(TypeError, match=f"QHAdamW's weight decay is always decoupled: .*{legacy}="):
        QHAdamW(_params(), **{legacy: value})


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"maximize": "False"}, "maximize must be a bool; received maximize='False'"),
        ({"capturable": 1}, "capturable must be a bool; received capturable=1"),
        ({"differentiable": None}, "differentiable must be a bool; received differentiable=None"),
        ({"fused": "no"}, "fused must be None or a bool; received fused='no'"),
        ({"foreach": 1}, "foreach must be None or a bool; received foreach=1"),
        # A tensor lr is read as the number it holds: True and 0.5+0j are no lr.
        ({"lr": torch.tensor(True)}, "lr must be a real number; received lr=True"),
        ({"lr": torch.tensor(0.5 + 0j)}, r"lr must be a real number; received lr=\(0.5\+0j\)"),
    ],
)
def test_switches_and_tensor_lrs_of_other_types_are_refused(
    cls: type, kwargs: dict[str, Any], match: str
) -> None:
    # torch leaves its switches unchecked, where "False" would maximize.
    with pytest.raises(TypeError, match=match):
        cls(_params(), **{"lr": 0.1, **kwargs})
    opt = cls(_params(), lr=0.1)
    with pytest.raises(TypeError, match=match):
        opt.add_param_group({"params": _params(), **kwargs})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [QHAdam, QHAdamW])
def test_amsgrad_must_be_a_bool(cls: type) -> None:
    assert cls(_params()).defaults["amsgrad"] is False
    assert cls(_params(), amsgrad=True).param_groups[0]["amsgrad"] is True
    for value in (1, "yes", None):
        with pytest.raises(TypeError) as info:
            cls(_params(), amsgrad=value)
        assert str(info.value) == f"amsgrad must be a bool; received amsgrad={value!r}"
    opt = cls(_params())
    with pytest.raises(TypeError, match="amsgrad must be a bool; received amsgrad=1"):
        opt.add_param_group({"params": _params(), "amsgrad": 1})
    # a group of its own: one group with AMSGrad, one without
    opt.add_param_group({"params": _params(), "amsgrad": True})
    assert [g["amsgrad"] for g in opt.param_groups] == [False, True]


def test_functional_qhadam_takes_amsgrad_as_torch_adam() -> None:
    from torch.optim.adam import adam  # torch's functional Adam, to compare the max with

    from qhoptim.torch import qhadam

    params = [torch.zeros(3, dtype=torch.float64)]
    grads = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)]
    state = dict(
        exp_avgs=[torch.zeros(3, dtype=torch.float64)],
        exp_avg_sqs=[torch.zeros(3, dtype=torch.float64)],
        state_steps=[torch.tensor(0.0)],
    )
    hp = dict(lr=0.1, beta1=0.9, beta2=0.99, nu1=0.7, nu2=0.9, eps=1e-8, weight_decay=0.0)
    hp.update(decoupled_weight_decay=False, maximize=False)
    with pytest.raises(ValueError, match="needs max_exp_avg_sqs"):
        qhadam(params, grads, **state, **hp, amsgrad=True)
    with pytest.raises(TypeError, match="amsgrad must be a bool"):
        qhadam(params, grads, **state, **hp, amsgrad=1)  # type: ignore[arg-type]
    theirs = [torch.zeros(3, dtype=torch.float64)]
    adam(
        [torch.zeros(3, dtype=torch.float64)],
        [g.clone() for g in grads],
        [torch.zeros(3, dtype=torch.float64)],
        [torch.zeros(3, dtype=torch.float64)],
        theirs,
        [torch.tensor(0.0)],
        amsgrad=True,
        beta1=0.9,
        beta2=0.99,
        lr=0.1,
        weight_decay=0.0,
        eps=1e-8,
        maximize=False,
    )
    maxes = [torch.zeros(3, dtype=torch.float64)]
    qhadam(params, grads, **state, **hp, amsgrad=True, max_exp_avg_sqs=maxes)
    torch.testing.assert_close(maxes[0], theirs[0], rtol=1e-15, atol=0)
    torch.testing.assert_close(maxes[0], state["exp_avg_sqs"][0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cls", "converted"),
    [
        (QHM, convert.from_nesterov(0.1, 0.9)),
        (QHAdam, convert.from_nadam(1e-3, (0.9, 0.999), 1e-8)),
    ],
)
def test_from_params_builds_from_a_conversion(cls: type, converted: object) -> None:
    opt = cls.from_params(_params(), converted, weight_decay=0.1)
    for key, value in converted.as_kwargs().items():  # type: ignore[attr-defined]
        assert opt.defaults[key] == value
    assert opt.defaults["weight_decay"] == 0.1
    wrong = (
        convert.from_adam(1e-3, (0.9, 0.999), 1e-8)
        if cls is QHM
        else convert.from_momentum(0.1, 0.9)
    )
    with pytest.raises(TypeError, match=r"from_params expects qhoptim\.convert"):
        cls.from_params(_params(), wrong)


# ---------------------------------------------------------------- signatures
def _positional(cls: type) -> list[str]:
    sig = inspect.signature(cls.__init__)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return [n for n, p in sig.parameters.items() if p.kind in kinds][1:]  # drop self


def _keyword_only(cls: type) -> list[str]:
    sig = inspect.signature(cls.__init__)
    return [n for n, p in sig.parameters.items() if p.kind == inspect.Parameter.KEYWORD_ONLY]


def test_signatures_extend_qhoptim_1_1_0() -> None:
    from qhoptim import pyt

    # qhoptim 1.1.0's positional arguments, names and order (qhoptim/pyt/*.py),
    # kept by qhoptim.pyt; qhoptim.torch spells decoupled decay one way.
    assert _positional(QHM) == [
        "params",
        "lr",
        "momentum",
        "nu",
        "weight_decay",
        "decoupled_weight_decay",
    ]
    assert _positional(QHAdam) == [
        "params",
        "lr",
        "betas",
        "nus",
        "weight_decay",
        "decoupled_weight_decay",
        "eps",
    ]
    assert _positional(pyt.QHM) == [
        "params",
        "lr",
        "momentum",
        "nu",
        "weight_decay",
        "weight_decay_type",
    ]
    assert _positional(pyt.QHAdam) == [
        "params",
        "lr",
        "betas",
        "nus",
        "weight_decay",
        "decouple_weight_decay",
        "eps",
    ]
    # QHAdamW(params, *args) forwarded to QHAdam with decoupled_weight_decay=True.
    assert _positional(QHAdamW) == ["params", "lr", "betas", "nus", "weight_decay", "eps"]
    assert _positional(pyt.QHAdamW) == _positional(QHAdamW)
    for cls in (QHM, QHAdam, QHAdamW):
        assert _keyword_only(cls) == [
            "maximize",
            "foreach",
            "capturable",
            "differentiable",
            "fused",
            *(["amsgrad"] if cls is not QHM else []),
            "state_dtype",
            "stochastic_rounding",
        ]


def test_defaults() -> None:
    # 1.1.0 required momentum and nu: they default to the paper's rule of thumb.
    # lr stays required, as in 1.1.0 (unless every param group sets its own).
    qhm = QHM(_params(), lr=1.0)
    assert qhm.defaults["momentum"] == 0.999 and qhm.defaults["nu"] == 0.7
    assert qhm.defaults["weight_decay"] == 0.0 and qhm.defaults["decoupled_weight_decay"] is False
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        QHM(_params())
    per_group = QHM([{"params": _params(), "lr": 0.5}])
    assert per_group.param_groups[0]["lr"] == 0.5
    # QHAdam keeps 1.1.0's defaults (those of Adam).
    qhadam = QHAdam(_params())
    assert qhadam.defaults["lr"] == 1e-3 and qhadam.defaults["betas"] == (0.9, 0.999)
    assert qhadam.defaults["nus"] == (1.0, 1.0) and qhadam.defaults["eps"] == 1e-8
    assert qhadam.defaults["decoupled_weight_decay"] is False
    for opt in (qhm, qhadam):
        flags = {
            k: opt.defaults[k] for k in ("maximize", "foreach", "capturable", "differentiable")
        }
        assert flags == {
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
        }


def test_1_1_0_style_calls_still_work() -> None:
    from qhoptim import pyt

    params = _params()
    assert pyt.QHM(params, 1.0, 0.999, 0.7, 1e-4, "direct").defaults["decoupled_weight_decay"]
    pyt.QHM(params, nu=0.7, momentum=0.999, lr=1.0)
    pyt.QHAdam(params, 3e-4, (0.99, 0.999), (0.8, 1.0), 1e-4, True, 1e-8)
    pyt.QHAdamW(params, 3e-4, (0.99, 0.999), (0.8, 1.0), 1e-4, eps=1e-6)
    pyt.QHAdam(params, weight_decay=1e-4, **pyt.QHAdam.from_nadam(lr=1e-3, betas=(0.9, 0.999)))
    pyt.QHM(params, weight_decay=1e-4, **pyt.QHM.from_pid(k_p=-0.1, k_i=1.0, k_d=3.0))
    # qhoptim.torch reads 1.1.0's positional weight_decay_type too, with a warning.
    with pytest.warns(DeprecationWarning, match="weight_decay_type='direct' is deprecated"):
        qhm = QHM(params, 1.0, 0.999, 0.7, 1e-4, "direct")
    assert qhm.defaults["decoupled_weight_decay"] is True
    QHAdam(params, 3e-4, (0.99, 0.999), (0.8, 1.0), 1e-4, True, 1e-8)


# -------------------------------------------------------------------- errors
def _core_message(check, value, name: str) -> str:
    with pytest.raises(ValueError) as info:
        check(value, name)
    return str(info.value)


QHM_ERRORS = [
    ({"lr": -0.1}, validation.check_lr, -0.1, "lr"),
    ({"lr": math.inf}, validation.check_lr, math.inf, "lr"),
    ({"lr": 0.1, "momentum": 1.2}, validation.check_beta, 1.2, "momentum"),
    ({"lr": 0.1, "momentum": 1.0}, validation.check_beta, 1.0, "momentum"),
    ({"lr": 0.1, "momentum": -0.5}, validation.check_beta, -0.5, "momentum"),
    ({"lr": 0.1, "nu": math.nan}, validation.check_nu, math.nan, "nu"),
    ({"lr": 0.1, "nu": -math.inf}, validation.check_nu, -math.inf, "nu"),
    ({"lr": 0.1, "weight_decay": -1e-4}, validation.check_weight_decay, -1e-4, "weight_decay"),
]
QHADAM_ERRORS = [
    ({"lr": -1e-3}, validation.check_lr, -1e-3, "lr"),
    ({"betas": (1.0, 0.999)}, validation.check_beta, 1.0, "betas[0]"),
    ({"betas": (-0.1, 0.999)}, validation.check_beta, -0.1, "betas[0]"),
    ({"betas": (0.9, 1.5)}, validation.check_beta, 1.5, "betas[1]"),
    ({"nus": (math.nan, 1.0)}, validation.check_nu, math.nan, "nus[0]"),
    ({"nus": (0.7, 1.5)}, validation.check_nu2, 1.5, "nus[1]"),
    ({"nus": (0.7, -0.1)}, validation.check_nu2, -0.1, "nus[1]"),
    ({"eps": -1e-8}, validation.check_eps, -1e-8, "eps"),
    ({"weight_decay": -0.1}, validation.check_weight_decay, -0.1, "weight_decay"),
]


@pytest.mark.parametrize(("kwargs", "check", "value", "name"), QHM_ERRORS)
def test_qhm_errors_are_the_core_messages(kwargs, check, value, name) -> None:
    expected = _core_message(check, value, name)
    with pytest.raises(ValueError) as info:
        QHM(_params(), **kwargs)
    assert str(info.value) == expected
    # ... also for a param group added later (torch only checks the defaults).
    opt = QHM(_params(), lr=0.1)
    with pytest.raises(ValueError) as info:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], **kwargs})
    assert str(info.value) == expected
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [QHAdam, QHAdamW])
@pytest.mark.parametrize(("kwargs", "check", "value", "name"), QHADAM_ERRORS)
def test_qhadam_errors_are_the_core_messages(cls, kwargs, check, value, name) -> None:
    expected = _core_message(check, value, name)
    with pytest.raises(ValueError) as info:
        cls(_params(), **kwargs)
    assert str(info.value) == expected


def test_error_wording() -> None:
    with pytest.raises(ValueError, match=r"^momentum must be in \[0, 1\); received momentum=1.2$"):
        QHM(_params(), lr=0.1, momentum=1.2)
    with pytest.raises(ValueError, match=r"^nus\[1\] must be in \[0, 1\]; received nus\[1\]=2$"):
        QHAdam(_params(), nus=(1.0, 2))


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (
            QHM,
            {"lr": 0.1, "weight_decay_type": "l2"},
            "weight_decay_type must be 'grad' or 'direct'",
        ),
        (
            QHAdam,
            {"betas": (0.9,)},
            r"betas must be a pair of two numbers; received betas=\(0.9,\)",
        ),
        (QHAdam, {"nus": (1.0, 1.0, 1.0)}, "nus must be a pair of two numbers"),
        (QHM, {"lr": torch.tensor([0.1, 0.2])}, "Tensor lr must be 1-element"),
        (QHM, {"lr": torch.tensor(-1.0)}, r"^lr must be in \[0, inf\); received lr=-1.0$"),
        (QHAdam, {"lr": torch.tensor([-1.0])}, r"^lr must be in \[0, inf\); received lr=-1.0$"),
    ],
)
def test_other_invalid_arguments(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(_params(), **kwargs)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
@pytest.mark.parametrize("foreach", [False, True])
def test_sparse_gradients_raise_naming_the_optimizer(cls, foreach) -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = cls([p], lr=0.1, foreach=foreach)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([2.0]), (4,))
    with pytest.raises(RuntimeError, match=f"^{cls.__name__} does not support sparse gradients"):
        opt.step()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize(
    ("cls", "kwargs", "bad", "match"),
    [
        (QHM, {"lr": 0.1}, "sparse", "QHM does not support sparse gradients"),
        (QHAdam, {"foreach": True}, "sparse", "QHAdam does not support sparse gradients"),
        (QHAdam, {"fused": True}, "sparse", "QHAdam does not support sparse gradients"),
        (QHM, {"lr": 0.1, "fused": True}, "complex", "fused=True. requires all the params"),
        (qht.QHMuon, {"lr": 0.02}, "sparse", "QHMuon does not support sparse gradients"),
        (qht.QHMuon, {"lr": 0.02}, "complex", "QHMuon does not support complex parameters"),
    ],
)
def test_a_step_refused_in_a_later_group_moves_no_group(
    cls: type, kwargs: dict[str, Any], bad: str, match: str
) -> None:
    # Every group is checked before any steps: the first group's parameter
    # and state stay as they were, and the refused one gets no state.
    good = torch.nn.Parameter(torch.ones(2, 2))
    opt = cls([good], **kwargs)
    good.grad = torch.ones(2, 2)
    opt.step()
    before = (good.detach().clone(), {k: v.clone() for k, v in opt.state[good].items()})
    other = torch.nn.Parameter(
        torch.ones(2, 2, dtype=torch.complex64 if bad == "complex" else None)
    )
    opt.add_param_group({"params": [other]})
    other.grad = torch.ones_like(other).to_sparse() if bad == "sparse" else torch.ones_like(other)
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert torch.equal(good, before[0])
    assert opt.state[good].keys() == before[1].keys()
    assert all(torch.equal(opt.state[good][k], v) for k, v in before[1].items())
    assert other not in opt.state


def test_base_class_checks_still_apply() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        QHM([], lr=0.1)
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        QHAdam([{"params": [p]}, {"params": [p]}])


# --------------------------------------------------------------- conversions
QHM_CONVERSIONS = [
    ("from_sgd", {"lr": 0.1}),
    ("from_momentum", {"lr": 0.1, "momentum": 0.9}),
    ("from_nesterov", {"lr": 0.1, "momentum": 0.9}),
    ("from_pid", {"k_p": -0.1, "k_i": 1.0, "k_d": 3.0}),
    ("from_synthesized_nesterov", {"alpha": 0.1, "beta1": 0.9, "beta2": 0.6}),
    ("from_robust_momentum", {"l": 5.0, "kappa": 15.0}),
    ("from_robust_momentum", {"l": 5.0, "kappa": 15.0, "rho": 0.9}),
    ("from_triple_momentum", {"l": 5.0, "kappa": 15.0}),
    ("from_an_pid", {"r": 0.1, "k_d": 0.5, "beta": 0.9}),
    ("from_accsgd", {"delta": 0.1, "kappa": 1000.0, "xi": 10.0}),
    ("from_two_state_optimizer", {"h": 0.9, "k": 0.0, "l": 0.1, "m": -0.09, "q": 1.0, "z": -0.01}),
]


@pytest.mark.parametrize(("name", "kwargs"), QHM_CONVERSIONS)
def test_qhm_conversions_return_constructor_kwargs(name, kwargs) -> None:
    got = getattr(QHM, name)(**kwargs)
    assert got == getattr(convert, name)(**kwargs).as_kwargs()
    assert set(got) == {"lr", "momentum", "nu"}
    QHM(_params(), weight_decay=1e-4, **got)


@pytest.mark.parametrize(
    ("name", "args", "convert_args"),
    [
        ("from_adam", {"lr": 1e-3, "betas": (0.9, 0.999)}, (1e-3, (0.9, 0.999), 1e-8)),
        ("from_nadam", {"lr": 2e-3, "betas": (0.95, 0.99)}, (2e-3, (0.95, 0.99), 1e-8)),
        ("from_rmsprop", {"lr": 1e-2, "alpha": 0.99}, (1e-2, 0.99, 1e-8)),
    ],
)
def test_qhadam_conversions(name, args, convert_args) -> None:
    want = getattr(convert, name)(*convert_args).as_kwargs()
    # Without eps, the kwargs leave it out (as 1.1.0's from_nadam), so eps=... can be passed.
    got = getattr(QHAdam, name)(**args)
    assert got == {k: v for k, v in want.items() if k != "eps"}
    QHAdam(_params(), eps=1e-6, **got)
    got_eps = getattr(QHAdam, name)(**args, eps=1e-6)
    assert got_eps["eps"] == 1e-6
    QHAdamW(_params(), **got_eps)


# ------------------------------------------------------------ default choice
@pytest.mark.parametrize(
    ("cls", "multi"), [(QHM, "_multi_tensor_qhm"), (QHAdam, "_multi_tensor_qhadam")]
)
def test_default_implementation(cls, multi) -> None:
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    # CPU: foreach, chosen by measurement (benchmarks/torch_step.py).
    module = qht._qhm if cls is QHM else qht._qhadam
    with mock.patch.object(module, multi) as patched:
        cls(params, lr=0.1).step()
    patched.assert_called_once()
    # foreach=False and differentiable=True keep the per-tensor loop.
    plain = [p.detach() for p in params]  # differentiable steps cannot write to leaves
    for p, q in zip(plain, params, strict=True):
        p.grad = q.grad
    for kwargs in ({"foreach": False}, {"differentiable": True}):
        with mock.patch.object(module, multi) as patched:
            cls(plain, lr=0.1, **kwargs).step()
        patched.assert_not_called()


def test_qhoptim_1_1_0_module_paths_import_and_unpickle() -> None:
    # 1.1.0's classes lived in qhoptim/pyt/qhm.py and qhadam.py: imports of
    # those modules, and pickles naming the classes there, failed.
    import pickle

    import qhoptim.pyt as pyt
    from qhoptim.pyt.qhadam import QHAdam as QHAdam110
    from qhoptim.pyt.qhadam import QHAdamW as QHAdamW110
    from qhoptim.pyt.qhm import QHM as QHM110

    assert (QHM110, QHAdam110, QHAdamW110) == (pyt.QHM, pyt.QHAdam, pyt.QHAdamW)
    opt = pyt.QHM([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9, nu=0.7)
    module = pyt.QHM.__module__
    try:
        pyt.QHM.__module__ = "qhoptim.pyt.qhm"  # as 1.1.0 pickled it
        blob = pickle.dumps(opt)
    finally:
        pyt.QHM.__module__ = module
    assert b"qhoptim.pyt.qhm" in blob
    assert type(pickle.loads(blob)) is pyt.QHM
