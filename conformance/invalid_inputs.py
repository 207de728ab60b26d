"""Invalid hyperparameters, as data: every backend must reject each one the same way.

The table uses neutral names (``lr``, ``momentum``, ``nu``, ``beta1``, ``beta2``,
``nu1``, ``nu2``, ``eps``, ``weight_decay``, and the pairs ``betas``, ``nus``);
each backend's tests map them to its own argument names (:data:`NAMES`) and
assert the message :func:`message` builds, word for word::

    <name> must be <requirement>; received <name>=<value as typed>

It imports no framework and no part of ``qhoptim``, so the core tests and
every backend's tests read the same table.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CONVERSIONS",
    "INVALID",
    "NAMES",
    "REQUIREMENTS",
    "Conversion",
    "Invalid",
    "backend_kwargs",
    "message",
    "pattern",
]

#: What each hyperparameter must be, as the messages say it.
REQUIREMENTS = {
    "lr": "in [0, inf)",
    "momentum": "in [0, 1)",
    "beta1": "in [0, 1)",
    "beta2": "in [0, 1)",
    "nu": "a finite real number",
    "nu1": "a finite real number",
    "nu2": "in [0, 1]",
    "eps": "in [0, inf)",
    "weight_decay": "in [0, inf)",
    "betas": "a pair of two numbers",
    "nus": "a pair of two numbers",
}
NOT_A_NUMBER = "a real number"

#: The neutral name -> each backend's argument name (``None``: no such argument).
#: ``core`` is :func:`qhoptim.validation.check_qhm` / ``check_qhadam``;
#: ``reference`` and ``torch`` take ``betas``/``nus`` pairs and name their items.
NAMES: dict[str, dict[str, str | None]] = {
    "core": {
        "lr": "lr",
        "momentum": "momentum",
        "nu": "nu",
        "beta1": "beta1",
        "beta2": "beta2",
        "nu1": "nu1",
        "nu2": "nu2",
        "eps": "eps",
        "weight_decay": "weight_decay",
        "betas": None,
        "nus": None,
    },
    "torch": {
        "lr": "lr",
        "momentum": "momentum",
        "nu": "nu",
        "beta1": "betas[0]",
        "beta2": "betas[1]",
        "nu1": "nus[0]",
        "nu2": "nus[1]",
        "eps": "eps",
        "weight_decay": "weight_decay",
        "betas": "betas",
        "nus": "nus",
    },
    "optax": {
        "lr": "learning_rate",
        "momentum": "momentum",
        "nu": "nu",
        "beta1": "b1",
        "beta2": "b2",
        "nu1": "nu1",
        "nu2": "nu2",
        "eps": "eps",
        "weight_decay": "weight_decay",
        "betas": None,
        "nus": None,
    },
    "keras": {
        "lr": "learning_rate",
        "momentum": "momentum",
        "nu": "nu",
        "beta1": "beta_1",
        "beta2": "beta_2",
        "nu1": "nu_1",
        "nu2": "nu_2",
        "eps": "epsilon",
        "weight_decay": "weight_decay",
        "betas": None,
        "nus": None,
    },
}
NAMES["mlx"] = {**NAMES["torch"], "lr": "learning_rate"}
NAMES["reference"] = NAMES["torch"]

#: Which optimizer family has which hyperparameter.
QHM_PARAMS = ("lr", "momentum", "nu", "weight_decay")
QHADAM_PARAMS = ("lr", "beta1", "beta2", "nu1", "nu2", "eps", "weight_decay", "betas", "nus")


@dataclass(frozen=True)
class Invalid:
    """One invalid value of one hyperparameter.

    ``shown`` is how the message prints the value (as the user typed it;
    NumPy scalars as plain numbers). ``error`` is ``ValueError`` for a number
    out of range (or a malformed pair), ``TypeError`` for a value that is not
    a real number at all.
    """

    param: str
    value: Any
    shown: str
    error: type[Exception] = ValueError

    @property
    def requirement(self) -> str:
        return REQUIREMENTS[self.param] if self.error is ValueError else NOT_A_NUMBER

    @property
    def id(self) -> str:
        return f"{self.param}={self.shown}"

    def applies_to(self, family: str) -> bool:
        """Whether the ``"qhm"`` or ``"qhadam"`` family has this hyperparameter."""
        return self.param in (QHM_PARAMS if family == "qhm" else QHADAM_PARAMS)


def message(entry: Invalid, name: str) -> str:
    """The exact message for ``entry`` under the backend's argument ``name``."""
    return f"{name} must be {entry.requirement}; received {name}={entry.shown}"


def pattern(entry: Invalid, name: str) -> str:
    """:func:`message` as an anchored regular expression (for ``pytest.raises(match=...)``)."""
    return "^" + re.escape(message(entry, name)) + "$"


#: Valid neutral hyperparameters the table's entries are substituted into.
GOOD: dict[str, dict[str, Any]] = {
    "qhm": {"lr": 0.1, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.0},
    "qhadam": {
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "nu1": 0.7,
        "nu2": 1.0,
        "eps": 1e-8,
        "weight_decay": 0.0,
    },
}


def assert_refused_when_set(
    optimizer: Any, name: str, value: Any, message: str, error_type: type = ValueError
) -> None:
    """Setting ``optimizer.<name> = value`` after construction raises
    ``error_type`` matching ``message`` and leaves the value before (the
    backends whose attributes are checked again: Keras, MLX)."""
    before = getattr(optimizer, name)
    try:
        setattr(optimizer, name, value)
    except error_type as error:
        assert re.search(message, str(error)), (message, str(error))
    else:
        raise AssertionError(f"{name}={value!r} set after construction was taken")
    assert getattr(optimizer, name) == before


def assert_fixed_after_construction(optimizer: Any, name: str, value: Any) -> None:
    """``optimizer.<name>`` (``state_dtype``, ``stochastic_rounding``: the state
    is made in them) is refused when set to ``value``, or to an equal value of
    another type, after construction; set to itself, it is taken (Keras, MLX)."""
    message = rf"{name} is set when the optimizer is made"
    assert_refused_when_set(optimizer, name, value, message)
    setattr(optimizer, name, getattr(optimizer, name))
    if name == "stochastic_rounding":  # equal, but not the same: it would be kept instead
        assert_refused_when_set(optimizer, name, 1, message)


def backend_kwargs(backend: str, family: str, entry: Invalid) -> dict[str, Any]:
    """Valid keyword arguments of ``backend``'s ``family`` optimizer, with ``entry`` put in.

    Backends whose :data:`NAMES` have ``betas``/``nus`` (torch, the reference)
    take QHAdam's discounts as pairs; the entry's value lands in its slot.
    """
    names = NAMES[backend]
    neutral = {**GOOD[family]}
    pairs = family == "qhadam" and names["betas"] is not None
    if not pairs:
        neutral[entry.param] = entry.value
        return {names[k]: v for k, v in neutral.items()}  # type: ignore[misc]
    betas = [neutral.pop("beta1"), neutral.pop("beta2")]
    nus = [neutral.pop("nu1"), neutral.pop("nu2")]
    slots = {"beta1": (betas, 0), "beta2": (betas, 1), "nu1": (nus, 0), "nu2": (nus, 1)}
    kwargs: dict[str, Any] = {"betas": tuple(betas), "nus": tuple(nus)}
    kwargs |= {names[k]: v for k, v in neutral.items()}  # type: ignore[misc]
    if entry.param in slots:
        pair, i = slots[entry.param]
        pair[i] = entry.value
        kwargs["betas"], kwargs["nus"] = tuple(betas), tuple(nus)
    else:
        kwargs[names[entry.param]] = entry.value  # type: ignore[index]
    return kwargs


def _bad_numbers(param: str, values: list[tuple[Any, str]]) -> list[Invalid]:
    return [Invalid(param, v, shown) for v, shown in values]


def _not_numbers(param: str) -> list[Invalid]:
    return [
        Invalid(param, "0.5", "'0.5'", TypeError),
        Invalid(param, None, "None", TypeError),
        Invalid(param, True, "True", TypeError),
        Invalid(param, [0.5], "[0.5]", TypeError),
        Invalid(param, 0.5j, "0.5j", TypeError),
    ]


_NON_FINITE = [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")]

INVALID: list[Invalid] = [
    # learning rate: [0, inf)
    *_bad_numbers("lr", [(-0.1, "-0.1"), (-1, "-1"), (np.float64(-1e-3), "-0.001"), *_NON_FINITE]),
    *_not_numbers("lr"),
    # discount factors: [0, 1)
    *_bad_numbers(
        "momentum",
        [(1.0, "1.0"), (1.2, "1.2"), (-0.1, "-0.1"), (1, "1"), (np.float32(1.5), "1.5")],
    ),
    *_bad_numbers("momentum", _NON_FINITE),
    *_not_numbers("momentum"),
    Invalid("momentum", (0.9, 0.99), "(0.9, 0.99)", TypeError),
    *_bad_numbers("beta1", [(1.0, "1.0"), (-0.1, "-0.1"), (2, "2"), *_NON_FINITE]),
    Invalid("beta1", "0.9", "'0.9'", TypeError),
    *_bad_numbers("beta2", [(1.0, "1.0"), (1.5, "1.5"), (-1e-3, "-0.001"), (math.nan, "nan")]),
    Invalid("beta2", None, "None", TypeError),
    # immediate discounts: nu, nu1 any finite real; nu2 in [0, 1]
    *_bad_numbers("nu", _NON_FINITE),
    Invalid("nu", "0.7", "'0.7'", TypeError),
    Invalid("nu", (0.7,), "(0.7,)", TypeError),
    *_bad_numbers("nu1", _NON_FINITE),
    Invalid("nu1", "1", "'1'", TypeError),
    *_bad_numbers("nu2", [(1.5, "1.5"), (-0.1, "-0.1"), (2, "2"), *_NON_FINITE]),
    Invalid("nu2", 1j, "1j", TypeError),
    # eps and weight decay: [0, inf)
    *_bad_numbers("eps", [(-1e-8, "-1e-08"), *_NON_FINITE]),
    Invalid("eps", "1e-8", "'1e-8'", TypeError),
    Invalid("eps", None, "None", TypeError),
    *_bad_numbers(
        "weight_decay", [(-0.1, "-0.1"), (-1, "-1"), (math.nan, "nan"), (math.inf, "inf")]
    ),
    Invalid("weight_decay", "0.01", "'0.01'", TypeError),
    # Concrete scalars -- 0-d and one-element arrays whose value is known -- are
    # read as the float they hold and checked like one, in every backend (the
    # message shows that float); only traced values pass unchecked.
    *_bad_numbers("lr", [(np.array([-0.1]), "-0.1")]),
    *_bad_numbers("momentum", [(np.array([1.5]), "1.5"), (np.array(1.0, np.float32), "1.0")]),
    *_bad_numbers("beta1", [(np.array(-1.0), "-1.0")]),
    *_bad_numbers("beta2", [(np.array([1.0]), "1.0")]),
    *_bad_numbers("nu", [(np.array(np.inf), "inf")]),
    *_bad_numbers("nu1", [(np.array([np.nan]), "nan")]),
    *_bad_numbers("nu2", [(np.array([1.5], np.float32), "1.5")]),
    *_bad_numbers("eps", [(np.array([-1.0]), "-1.0")]),
    *_bad_numbers("weight_decay", [(np.array(-0.1), "-0.1")]),
    Invalid("momentum", np.array(True), "array(True)", TypeError),
    Invalid("eps", np.array([1j]), "array([0.+1.j])", TypeError),
    # pairs (torch, the reference and convert.from_adam take betas and nus as pairs)
    Invalid("betas", (0.9, 0.99, 0.999), "(0.9, 0.99, 0.999)"),
    Invalid("betas", (0.9,), "(0.9,)"),
    Invalid("betas", 0.9, "0.9"),
    Invalid("betas", "0.9,0.99", "'0.9,0.99'"),
    Invalid("nus", (0.7, 1.0, 1.0), "(0.7, 1.0, 1.0)"),
    Invalid("nus", 0.7, "0.7"),
]


@dataclass(frozen=True)
class Conversion:
    """A conversion whose preconditions fail: no QH optimizer has these settings.

    ``function`` names a function of :mod:`qhoptim.convert` (torch's ``QHM`` /
    ``QHAdam`` have class methods of the same names); ``match`` is a regular
    expression for its message.
    """

    function: str
    kwargs: dict[str, Any]
    match: str
    error: type[Exception] = ValueError


CONVERSIONS: list[Conversion] = [
    # PID gains whose QHM momentum k_d / (k_d - k_p) would be >= 1.
    Conversion(
        "from_pid",
        {"k_p": 0.1, "k_i": 0.1, "k_d": 0.9},
        r"momentum k_d / \(k_d - k_p\).*must be in \[0, 1\); received k_p=0.1, k_d=0.9",
    ),
    # AccSGD needs xi <= sqrt(kappa); here nu would leave QHM's reachable set.
    Conversion(
        "from_accsgd",
        {"delta": 0.1, "kappa": 100.0, "xi": 11.0},
        r"^xi must be in \(0, 10\]; received xi=11.0$",
    ),
    # A two-state optimizer whose momentum h + q - 1 is not a discount factor.
    Conversion(
        "from_two_state_optimizer",
        {"h": 1.5, "k": 0.0, "l": 0.1, "m": 0.1, "q": 1.0, "z": -0.1},
        r"momentum h \+ q - 1 must be in \[0, 1\); received h=1.5, q=1.0",
    ),
    # SNV with beta1 = 0 has no momentum to weight: nu is undefined unless beta2 = 0.
    Conversion(
        "from_synthesized_nesterov",
        {"alpha": 0.1, "beta1": 0.0, "beta2": 0.5},
        r"beta2 must be 0 when beta1 = 0.*received beta1=0.0, beta2=0.5",
    ),
    Conversion(
        "from_nesterov",
        {"lr": 0.1, "momentum": math.nan},
        r"^momentum must be in \[0, 1\); received momentum=nan$",
    ),
    Conversion(
        "from_adam",
        {"lr": 1e-3, "betas": (0.9, 0.999, 0.9), "eps": 1e-8},
        r"^betas must be a pair of two numbers; received betas=\(0.9, 0.999, 0.9\)$",
    ),
    Conversion(
        "from_momentum",
        {"lr": "0.1", "momentum": 0.9},
        r"^lr must be a real number; received lr='0.1'$",
        TypeError,
    ),
]
