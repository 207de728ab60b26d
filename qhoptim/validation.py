"""Hyperparameter validation shared by every backend.

Every backend calls these checks with its own argument names (``momentum`` in
torch, ``beta_1`` in Keras, ``b1`` in optax), so a bad value produces the same
sentence everywhere::

    ValueError: momentum must be in [0, 1); received momentum=1.2

Only *concrete* numbers are checked, and every backend checks them the same
way: Python and NumPy reals, and *concrete scalars* -- 0-d or one-element
arrays and tensors of NumPy, JAX, TensorFlow or torch whose value is known
(:func:`concrete_float` reads them as a Python float; backends store that
float). Values whose number is only known later are returned untouched: a
traced array under ``jax.jit`` or ``optax.inject_hyperparams`` (or in a
``tf.function`` graph), a variable (anything with an ``assign`` method, such as
a Keras or TensorFlow variable, meant to change while training), and a
learning-rate schedule or other callable; an array of several elements is
returned as it is, each of its elements checked. Everything
else -- a string, ``None``, a bool, a complex number, a list or tuple where one
number is expected -- is a ``TypeError`` in the same shape::

    TypeError: momentum must be a real number; received momentum='0.9'
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

__all__ = [
    "CheckedAttributes",
    "as_float",
    "check_beta",
    "check_bool",
    "check_choice",
    "check_conversion",
    "check_eps",
    "check_finite",
    "check_interval",
    "check_lr",
    "check_not_callable",
    "check_nu",
    "check_nu2",
    "check_one_number",
    "check_pair",
    "check_qhadam",
    "check_qhm",
    "check_qhmuon",
    "check_unit_interval",
    "check_weight_decay",
    "concrete_float",
    "format_bound",
    "range_error",
    "require_real",
]

T = TypeVar("T")


def _not_a_number(name: str, value: object) -> TypeError:
    return TypeError(f"{name} must be a real number; received {name}={value!r}")


class _Deferred:
    """The marker :func:`_scalar_of` returns for a value not known yet."""


_DEFERRED = _Deferred()


def _is_jax_tracer(value: object) -> bool:
    # Only if JAX is imported already: a tracer cannot exist otherwise.
    jax = sys.modules.get("jax")
    core = getattr(jax, "core", None)
    tracer = getattr(core, "Tracer", None)
    return isinstance(tracer, type) and isinstance(value, tracer)


def _may_change(value: object) -> bool:
    """A variable (it has ``assign``) or a traced value: its number is not known here."""
    return hasattr(value, "assign") or _is_jax_tracer(value)


def _scalar_of(value: object) -> object:
    """The Python scalar of a concrete one-element array or tensor (any framework).

    :data:`_DEFERRED` for a value whose number is not known yet: a traced
    value, a variable (it has ``assign``: it may change while training), an
    array of other than one element, or one whose value cannot be read here
    (a symbolic TensorFlow tensor, a torch meta or fake tensor). Duck-typed,
    so that no framework is imported.
    """
    if _may_change(value):
        return _DEFERRED
    try:
        dims: list[int] = [int(d) for d in value.shape]  # type: ignore[attr-defined]
        size = math.prod(dims)
    except Exception:
        return _DEFERRED
    if size != 1:
        return _DEFERRED
    try:
        if hasattr(value, "item"):  # NumPy, JAX, torch
            return value.item()
        if hasattr(value, "numpy"):  # TensorFlow's eager tensors
            return value.numpy().item()
        if hasattr(value, "__array__"):
            return value.__array__().item()
    except Exception:
        return _DEFERRED
    return _DEFERRED


def _as_float(value: numbers.Real) -> float:
    """``float(value)``, with a real beyond float64's range (a Python int of
    400 digits) as the infinity of its sign, which every range check refuses
    as it refuses ``inf``, rather than Python's OverflowError."""
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def _flattened(listed: object) -> list[object]:
    return (
        [x for item in listed for x in _flattened(item)] if isinstance(listed, list) else [listed]
    )


def _elements_of(value: object, name: str) -> list[float]:
    """The numbers of a concrete array of several elements (NumPy, JAX,
    torch, TensorFlow's eager tensors), each a real, else a ``TypeError``;
    ``[]`` for anything else (a scalar, a deferred value). Such an array passes
    as it is -- an optax hyperparameter may be one, broadcast against its
    leaf -- but every element in range, so that ``momentum=[0.5, 1.5]`` is
    refused where it would have stepped."""
    if _may_change(value) or not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return []
    try:
        listed = value.tolist() if hasattr(value, "tolist") else value.numpy().tolist()  # type: ignore[attr-defined]
    except Exception:  # a value not readable here: symbolic, meta, fake
        return []
    elements = _flattened(listed)
    if not elements:  # no number to step with, in any backend
        raise _empty_error(name, tuple(int(n) for n in value.shape))
    if len(elements) < 2:
        return []
    if any(isinstance(x, bool) or not isinstance(x, numbers.Real) for x in elements):
        raise _not_a_number(name, value)
    return [_as_float(x) for x in elements]  # type: ignore[arg-type]


def _empty_error(name: str, shape: tuple[int, ...]) -> ValueError:
    return ValueError(f"{name} must not be empty; received an array of shape {shape}")


def _concrete(value: object, name: str | None) -> float | None:
    """``value`` as a float if a concrete real, ``None`` if deferred; otherwise a TypeError."""
    if isinstance(value, bool):
        if name is None:
            raise TypeError(f"expected a real number, received the bool {value!r}")
        raise _not_a_number(name, value)
    if isinstance(value, numbers.Real):
        return _as_float(value)
    if callable(value) or not (hasattr(value, "shape") and hasattr(value, "dtype")):
        # A schedule, or no array at all (a string, None, a list, a complex number).
        if callable(value) or name is None:
            return None
        raise _not_a_number(name, value)
    scalar = _scalar_of(value)
    if scalar is _DEFERRED:
        return None
    if isinstance(scalar, bool):  # a boolean array
        if name is None:
            raise TypeError(f"expected a real number, received the bool {value!r}")
        raise _not_a_number(name, value)
    if isinstance(scalar, numbers.Real):
        return _as_float(scalar)
    # A complex or non-numeric array.
    if name is None:
        return None
    raise _not_a_number(name, value)


def concrete_float(value: object) -> float | None:
    """Return ``value`` as a float if it is a concrete real number, else ``None``.

    Python ``int``/``float``, NumPy scalars and *concrete scalars* -- 0-d or
    one-element arrays and tensors of any framework (NumPy, JAX, TensorFlow,
    torch) whose value is known -- are concrete. Traced values, variables,
    arrays of several elements and callables are not (``None``). Booleans are
    not numbers here (``momentum=True`` is a mistake, not ``1``): they raise
    ``TypeError``. The ``check_*`` functions go further and reject every value
    that is neither a concrete real nor deferred (see the module docstring).
    """
    return _concrete(value, None)


def as_float(value: T) -> float | T:
    """``value`` as a backend stores it once checked: a concrete scalar as a Python float.

    A concrete real that is not a Python ``int`` or ``float`` (a NumPy scalar,
    a one-element array or tensor whose value is known) becomes its ``float``,
    so that no step ever computes with an array the optimizer was not built
    for (a float64 0-d array in a float32 kernel, a negative ε read only inside
    ``jit``). Python numbers, deferred values (traced arrays, variables,
    schedules) and values that are not numbers at all come back unchanged:
    call this after the ``check_*`` functions, which report the latter.
    """
    if type(value) in (int, float):
        return value
    try:
        x = concrete_float(value)
    except TypeError:
        return value
    return value if x is None else x


def format_bound(x: float) -> str:
    """A bound as short as it reads (``0``, ``1``, ``1e-08``), or all its digits
    where fewer would round it: a computed bound (``sqrt(kappa)``) rounded to
    six would print a range that seems to hold the value refused."""
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def _shown(value: object, x: float) -> str:
    # Python numbers print as typed; NumPy scalars print as plain floats,
    # not as ``np.float64(1.2)``.
    return repr(value) if type(value) in (int, float) else repr(x)


def require_real(value: object, name: str) -> float:
    """``value`` as a float; a ``TypeError`` if it is not a concrete real number.

    For functions that compute with the value right away (conversions, the
    analysis), where passing a traced value through is not an option.
    """
    x = _concrete(value, name)
    if x is None:
        raise _not_a_number(name, value)
    return x


def range_error(name: str, interval: str, value: object) -> ValueError:
    """The shared message: ``<name> must be in <interval>; received <name>=<value>``."""
    x = concrete_float(value)
    shown = repr(value) if x is None else _shown(value, x)
    return ValueError(f"{name} must be in {interval}; received {name}={shown}")


def check_interval(
    value: T,
    name: str,
    low: float,
    high: float,
    *,
    low_closed: bool = True,
    high_closed: bool = False,
) -> T:
    """Check a concrete ``value`` lies in the interval from ``low`` to ``high``.

    NaN is never inside; deferred values (traced arrays, variables,
    callables) are returned unchecked, a concrete array of several elements
    checked element by element, any other non-number is a ``TypeError``.
    """
    x = _concrete(value, name)

    def inside(x: float) -> bool:
        ok = not math.isnan(x)
        ok = ok and (x >= low if low_closed else x > low)
        return ok and (x <= high if high_closed else x < high)

    if not all(map(inside, _elements_of(value, name) if x is None else [x])):
        interval = (
            ("[" if low_closed else "(")
            + f"{format_bound(low)}, {format_bound(high)}"
            + ("]" if high_closed else ")")
        )
        raise range_error(name, interval, value)
    return value


def check_bool(value: T, name: str) -> T:
    """A switch (``amsgrad``, ``decoupled_weight_decay``): ``True`` or ``False``, nothing else.

    ``1``, ``"yes"``, ``None`` or an array are a ``TypeError`` in the shared shape::

        TypeError: amsgrad must be a bool; received amsgrad=1
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; received {name}={value!r}")
    return value


def check_one_number(value: T, name: str) -> T:
    """A hyperparameter a backend folds into its step as one number (MLX's
    compiled steps take Python numbers): an array of several elements, which
    optax broadcasts against its leaf, is refused here, in the shared shape::

        ValueError: momentum must be one number; received an array of shape (4,)

    A callable (a schedule), as no step folds one in, as any non-number::

        TypeError: nu must be a real number; received nu=<function <lambda> at 0x...>

    An empty array, which no backend can step with, as the range checks refuse it::

        ValueError: momentum must not be empty; received an array of shape (0,)
    """
    check_not_callable(value, name)  # a schedule: no step folds one in
    shape = getattr(value, "shape", ())
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:  # not an array's shape
        return value
    if math.prod(shape) == 0:
        raise _empty_error(name, shape)
    if math.prod(shape) > 1:
        raise ValueError(f"{name} must be one number; received an array of shape {shape}")
    return value


def check_optional_bool(value: T, name: str) -> T:
    """A switch with a default (``foreach``, ``fused``, ``stochastic_rounding``):
    ``None``, ``True`` or ``False``, in the shared shape::

        TypeError: fused must be None or a bool; received fused='no'
    """
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None or a bool; received {name}={value!r}")
    return value


def check_pair(value: object, name: str) -> tuple[Any, Any]:
    """``value`` as a 2-tuple (``betas``, ``nus``); a ``ValueError`` for anything else."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} must be a pair of two numbers; received {name}={value!r}")
    return value[0], value[1]


def check_conversion(where: str, converted: object, *expected: type) -> None:
    """A ``from_params`` argument: a conversion's result (:mod:`qhoptim.convert`) of
    one of the ``expected`` kinds, else a ``TypeError`` in every backend's wording.

    >>> check_conversion("QHM.from_params", 0.1, type(None))
    Traceback (most recent call last):
    ...
    TypeError: QHM.from_params expects qhoptim.convert.NoneType; received float
    """
    if isinstance(converted, expected):
        return
    kinds = " or ".join(f"qhoptim.convert.{kind.__name__}" for kind in expected)
    raise TypeError(f"{where} expects {kinds}; received {type(converted).__name__}")


def check_finite(value: T, name: str) -> T:
    """Any finite real (QHM's ``nu``, QHAdam's ``nu1``)."""
    x = _concrete(value, name)
    if x is not None and not math.isfinite(x):
        raise ValueError(f"{name} must be a finite real number; received {name}={_shown(value, x)}")
    if x is None and not all(map(math.isfinite, _elements_of(value, name))):
        raise ValueError(f"{name} must be a finite real number; received {name}={value!r}")
    return value


def check_lr(value: T, name: str = "lr") -> T:
    """Learning rate: ``0 <= lr < inf``."""
    return check_interval(value, name, 0.0, math.inf)


def check_beta(value: T, name: str) -> T:
    """Exponential discount factor: ``0 <= beta < 1``."""
    return check_interval(value, name, 0.0, 1.0)


def check_unit_interval(value: T, name: str) -> T:
    """A weight in the closed interval ``[0, 1]``."""
    return check_interval(value, name, 0.0, 1.0, high_closed=True)


def check_eps(value: T, name: str = "eps") -> T:
    """Denominator offset: ``0 <= eps < inf``."""
    return check_interval(value, name, 0.0, math.inf)


def check_weight_decay(value: T, name: str = "weight_decay") -> T:
    """Weight decay: ``0 <= weight_decay < inf``."""
    return check_interval(value, name, 0.0, math.inf)


def check_nu(value: T, name: str = "nu") -> T:
    """Immediate discount factor of QHM / ``nu1`` of QHAdam: any finite real.

    Conversions from other algorithms legitimately produce values outside
    ``[0, 1]`` (e.g. PID or AccSGD settings), so no range is imposed.
    """
    return check_finite(value, name)


def check_nu2(value: T, name: str = "nu2") -> T:
    """QHAdam's ``nu2`` must lie in ``[0, 1]``.

    Outside that interval ``(1 - nu2) g**2 + nu2 * s`` can be negative and
    its square root is undefined.
    """
    return check_unit_interval(value, name)


def _no_schedules(
    values: dict[str, object], names: dict[str, str], callables: Collection[str]
) -> None:
    """Refuse a callable (a schedule) for each hyperparameter but ``lr`` and
    ``callables`` (Keras's QHM and QHAdam call theirs at each step): no other
    step can read one, and it would fail inside the first."""
    for key, value in values.items():
        if key != "lr" and key not in callables:
            check_not_callable(value, names[key])


def check_not_callable(value: T, name: str) -> T:
    """A hyperparameter a step reads as a number, not a schedule: a callable is
    refused as any other non-number is (only learning rates are scheduled)."""
    if callable(value):
        raise _not_a_number(name, value)
    return value


def check_qhm(
    *,
    lr: object,
    momentum: object,
    nu: object,
    weight_decay: object = 0.0,
    names: dict[str, str] | None = None,
    callables: Collection[str] = (),
) -> None:
    """Validate a full QHM hyperparameter set (``names`` maps to backend
    spellings; ``callables``: the hyperparameters that may be zero-argument
    callables besides ``lr``)."""
    n = {"lr": "lr", "momentum": "momentum", "nu": "nu", "weight_decay": "weight_decay"}
    n.update(names or {})
    values = {"lr": lr, "momentum": momentum, "nu": nu, "weight_decay": weight_decay}
    _no_schedules(values, n, callables)
    check_lr(lr, n["lr"])
    check_beta(momentum, n["momentum"])
    check_nu(nu, n["nu"])
    check_weight_decay(weight_decay, n["weight_decay"])


def check_qhadam(
    *,
    lr: object,
    beta1: object,
    beta2: object,
    nu1: object,
    nu2: object,
    eps: object,
    weight_decay: object = 0.0,
    names: dict[str, str] | None = None,
    callables: Collection[str] = (),
) -> None:
    """Validate a full QHAdam hyperparameter set (``names``, ``callables``: as
    :func:`check_qhm`'s)."""
    n = {
        "lr": "lr",
        "beta1": "beta1",
        "beta2": "beta2",
        "nu1": "nu1",
        "nu2": "nu2",
        "eps": "eps",
        "weight_decay": "weight_decay",
    }
    n.update(names or {})
    values = {"lr": lr, "beta1": beta1, "beta2": beta2, "nu1": nu1, "nu2": nu2, "eps": eps}
    _no_schedules({**values, "weight_decay": weight_decay}, n, callables)
    check_lr(lr, n["lr"])
    check_beta(beta1, n["beta1"])
    check_beta(beta2, n["beta2"])
    check_nu(nu1, n["nu1"])
    check_nu2(nu2, n["nu2"])
    check_eps(eps, n["eps"])
    check_weight_decay(weight_decay, n["weight_decay"])


def check_ns_steps(value: object, name: str = "ns_steps") -> Any:
    """Newton-Schulz steps: an integer in ``[0, 100)`` (torch's bound: more is never useful).

    A one-element integer array counts as its integer, and a traced one
    (``optax.inject_hyperparams`` makes every number an array) is passed.
    Returns the count as a Python ``int`` (a traced one as it is).
    """
    count: object = value
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, bool):
        count = _scalar_of(value)
        if count is _DEFERRED and _is_jax_tracer(value):
            return value
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"{name} must be an integer; received {name}={value!r}")
    return check_interval(int(count), name, 0, 100)


def _check_ns_coefficients(value: object, name: str) -> None:
    """Newton-Schulz coefficients ``(a, b, c)``: three finite reals."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"{name} must be three numbers (a, b, c); received {name}={value!r}")
    for i, coefficient in enumerate(value):
        label = f"{name}[{i}]"
        check_finite(require_real(coefficient, label), label)


def check_choice(value: object, name: str, choices: Sequence[object]) -> None:
    """``value`` one of ``choices`` (``adjust_lr_fn``).

    Anything else is a ``ValueError`` in the shared wording::

        ValueError: adjust_lr_fn must be one of None, 'original'; received adjust_lr_fn='x'
    """
    if value in choices and (value is None or isinstance(value, str)):
        return
    allowed = ", ".join(map(repr, choices))
    raise ValueError(f"{name} must be one of {allowed}; received {name}={value!r}")


def check_qhmuon(
    *,
    lr: object,
    momentum: object,
    nu: object,
    weight_decay: object,
    eps: object,
    ns_steps: object,
    ns_coefficients: object,
    adjust_lr_fn: object,
    adjustments: Sequence[str],
    names: dict[str, str] | None = None,
) -> None:
    """Validate a full QHMuon hyperparameter set (``names`` maps to backend spellings).

    ``adjust_lr_fn`` is ``None`` or one of ``adjustments`` (the backend's
    learning-rate adjustments, :data:`qhoptim.rules.MUON_LR_ADJUSTMENTS`).
    """
    n = {
        "ns_steps": "ns_steps",
        "ns_coefficients": "ns_coefficients",
        "adjust_lr_fn": "adjust_lr_fn",
        "eps": "eps",
    }
    n.update(names or {})
    check_qhm(lr=lr, momentum=momentum, nu=nu, weight_decay=weight_decay, names=names)
    check_eps(eps, n["eps"])
    check_ns_steps(ns_steps, n["ns_steps"])
    _check_ns_coefficients(ns_coefficients, n["ns_coefficients"])
    check_choice(adjust_lr_fn, n["adjust_lr_fn"], [None, *adjustments])


def optional(check: Callable[[Any, str], T]) -> Callable[[Any, str], T | None]:
    """``check`` for a hyperparameter that may also be ``None`` (Keras's ``weight_decay``)."""

    def checked(value: Any, name: str) -> T | None:
        return None if value is None else check(value, name)

    return checked


def _kept(value: Any) -> Any:
    """A checked value as constructors keep it: each concrete number of it a
    Python number (:func:`as_float`; a pair's elements each)."""
    if isinstance(value, tuple):
        return tuple(as_float(element) for element in value)
    return as_float(value)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` is ``b``, or equal to it and of its type (``1`` is not
    ``True`` here: the other would be kept in its place)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an array's comparison, say
        return False


class CheckedAttributes:
    """Hyperparameters set after construction (``opt.beta_1 = 1.5``) checked
    as the constructor checks them, where a framework's own optimizers take
    such a value unchecked and step by it (Keras's, MLX's). A refused value
    leaves the one before; an accepted one is kept as the constructor keeps
    it: a concrete number (a NumPy scalar, a one-element array or tensor) as
    a Python float, so that a step never computes with an array it was not
    built for. ``_CHECKS``: each attribute's check, a function of the value
    and its name (this module's) that returns the value checked (wrapped in
    :func:`optional` where ``None`` is allowed). The constructor's own first
    assignment is not checked again, but for being one number
    (:func:`check_one_number`), which the constructors' range checks pass."""

    _CHECKS: ClassVar[Mapping[str, Callable[[Any, str], Any]]] = {}
    #: Attributes the constructor alone sets (``state_dtype``: the state is
    #: made in it); set to another value later, refused.
    _FIXED: ClassVar[frozenset[str]] = frozenset({"state_dtype", "stochastic_rounding"})
    #: Attributes that may be zero-argument callables, called at each step
    #: (Keras's QHM and QHAdam); any other callable is refused.
    _CALLABLE: ClassVar[frozenset[str]] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._CHECKS and name not in self._FIXED:
            # The steps' own attributes (set on every step): nothing to check or record.
            super().__setattr__(name, value)
            return
        # The names assigned, kept apart from __dict__: TensorFlow's tracking
        # skips storing a value that is the class's default (None), which
        # would pass a later assignment off as the constructor's.
        assigned: set[str] = self.__dict__.setdefault("_qhoptim_assigned", set())
        if name in assigned:
            if name in self._FIXED and not _same(value, getattr(self, name)):
                raise ValueError(
                    f"{name} is set when the optimizer is made (its state is made in it); "
                    f"make another optimizer for another; received {name}={value!r}"
                )
            check = self._CHECKS.get(name)
            if check is not None:
                value = _kept(check(value, name))
        if name in self._CHECKS and not (name in self._CALLABLE and callable(value)):
            # The step folds each hyperparameter in as one number, from the
            # constructor's first assignment on (a pair's check takes its elements).
            check_one_number(value, name)
        super().__setattr__(name, value)
        assigned.add(name)
