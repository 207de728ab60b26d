"""What the optimizers of :mod:`qhoptim.mlx` share: the narrow state and its
rounding, the checked learning rate and state, a failing step put back, and
the step's coefficients computed once per step (:class:`_QHOptimizer`)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from qhoptim import rounding, rules, validation
from qhoptim.mlx import _extension

LearningRate = float | mx.array | Callable[[mx.array], mx.array]


# MLX's uint32 arrays wrap; the constants are made as uint32 arrays.
_BITS = rounding.Bits(const=lambda c: mx.array(c, dtype=mx.uint32), select=mx.where)

#: What a parameter's stochastic rounding reads (_NarrowState._noise): its
#: elements' flat positions and the seed of each of its states.
_Noise = tuple[mx.array, tuple[mx.array, ...]]


class _Store(enum.Enum):
    """How the C++ step stores a state (``csrc/fused_cpu.cpp``'s ``Store``)."""

    FLOAT32 = 0
    BFLOAT16_STOCHASTIC = 1
    BFLOAT16_NEAREST = 2


#: The C++ step's number of each denominator form (``csrc/fused_cpu.cpp``).
_DENOMINATORS = {
    rules.Denominator.EXP_AVG_SQ: 0,
    rules.Denominator.GRAD: 1,
    rules.Denominator.MIX: 2,
}

#: The dtypes ``state_dtype`` may be (None: the parameter's own).
STATE_DTYPES = (mx.bfloat16, mx.float16, mx.float32, mx.float64)


def _dtype_name(dtype: Any) -> str | None:
    return str(dtype).rsplit(".", 1)[-1] if isinstance(dtype, mx.Dtype) else None


def _pair(
    first: Callable[[Any, str], Any], second: Callable[[Any, str], Any]
) -> Callable[[Any, str], tuple[Any, Any]]:
    """The checks of ``betas`` and ``nus``, each element by its name (``betas[0]``)."""

    def checked(value: Any, name: str) -> tuple[Any, Any]:
        elements = validation.check_pair(value, name)
        names = (f"{name}[0]", f"{name}[1]")
        return (
            first(validation.check_one_number(elements[0], names[0]), names[0]),
            second(validation.check_one_number(elements[1], names[1]), names[1]),
        )

    return checked


def _one_number_each(learning_rate: Any, **hyperparameters: Any) -> None:
    """The compiled steps take each hyperparameter as one Python number (as
    MLX's own optimizers do, which accept an array and fail at the step); a
    learning rate may also be a schedule, which is called."""
    if not callable(learning_rate):
        validation.check_one_number(learning_rate, "learning_rate")
    for name, value in hyperparameters.items():
        validation.check_one_number(value, name)


def _working(state: mx.array, param: mx.array) -> mx.array:
    """A stored state in the parameter's dtype, the dtype of the step's arithmetic."""
    return state if state.dtype == param.dtype else state.astype(param.dtype)


def _stored(value: mx.array, dtype: mx.Dtype, noise: _Noise | None, k: int = 0) -> mx.array:
    """A step's new state ``k`` of a parameter in the state's ``dtype``: to
    bfloat16 with :mod:`qhoptim.rounding`'s stochastic rounding (``noise``: the
    parameter's positions and its states' seeds), or cast (``noise`` None: to
    nearest). Inside a compiled step the noise is made in the step's fused
    kernel, and the kept half of each float32 is written as bfloat16's bits:
    MLX does not fuse across a ``view``, and its own conversion to bfloat16
    would be one more pass over the state."""
    if value.dtype == dtype:
        return value
    if noise is None:
        return value.astype(dtype)
    positions, seeds = noise
    bits = value.astype(mx.float32).view(mx.uint32)
    top: mx.array = rounding.bfloat16_bits(
        bits, rounding.noise16(positions, seeds[k], _BITS), _BITS
    )
    return top.astype(mx.uint16).view(mx.bfloat16)


def _sqrt(x: Any) -> Any:
    """A number's square root as a number (``mx.sqrt`` would make it a float32
    array, and round it so for float64 parameters), an array's as an array."""
    return math.sqrt(x) if isinstance(x, (int, float)) else mx.sqrt(x)


def _is_number(x: Any, value: float) -> bool:
    return isinstance(x, (int, float)) and x == value


def _scaled(param: mx.array, factor: Any) -> mx.array:
    """``param * factor``; ``param`` itself for the number 1 (no decoupled decay)."""
    return param if _is_number(factor, 1) else param * factor


def _materialized(x: Any) -> Any:
    """An array as its own computation (a number as it is): inside an
    ``mx.compile``-d training step MLX would otherwise fuse a scalar chain into
    each parameter's element-wise kernel and evaluate it once per element."""
    return mx.contiguous(x) if isinstance(x, mx.array) else x


def _check_real(parameter: mx.array) -> None:
    if not mx.issubdtype(parameter.dtype, mx.floating):
        raise TypeError(f"qhoptim.mlx optimizes real floating-point arrays; got {parameter.dtype}")


def _containers_of(tree: Any) -> list[tuple[Any, Any]]:
    """Each dictionary and list of a state's tree with a copy of its items,
    for :func:`_restore` (the arrays themselves are immutable). Arrays are
    passed over where their container is read: a step's Python time."""
    found: list[tuple[Any, Any]] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            found.append((node, node.copy()))
            pending += [x for x in node.values() if type(x) is not mx.array]
        elif isinstance(node, (list, tuple)):
            if isinstance(node, list):
                found.append((node, node.copy()))
            pending += [x for x in node if type(x) is not mx.array]
    return found


def _restore(containers: list[tuple[Any, Any]]) -> None:
    """Put back the items :func:`_containers_of` copied, in place."""
    for container, items in containers:
        if isinstance(container, dict):
            container.clear()
            container.update(items)
        else:
            container[:] = items


def _check_learning_rate(value: Any) -> None:
    """A ``learning_rate`` set or restored: as the constructors check it, in
    range and one number (an array of several would broadcast each parameter
    against it: a ``(2, 1)`` one made a ``(3,)`` parameter ``(2, 3)``)."""
    _one_number_each(validation.check_lr(value, "learning_rate"))


#: MLX's ``Optimizer.learning_rate`` and ``Optimizer.state`` properties, which
#: _NarrowState's wrap.
_MLX_LEARNING_RATE: Any = vars(optim.Optimizer)["learning_rate"]
_MLX_STATE: Any = vars(optim.Optimizer)["state"]


class _DtypeName(NamedTuple):
    """An MLX dtype in a copy or a pickle, by its name (``"bfloat16"``)."""

    name: str


class _NarrowState(validation.CheckedAttributes, optim.Optimizer):
    """What every optimizer here shares: the state's dtype (``state_dtype``),
    its rounding seeds, the conversion of a state loaded in another dtype, and
    a ``learning_rate`` set after construction, or restored with a state
    (``optimizer.state = ...``), checked as the constructor checks it (MLX's
    optimizers take a negative one and step uphill)."""

    @property
    def learning_rate(self) -> mx.array:
        value: mx.array = _MLX_LEARNING_RATE.fget(self)
        return value

    @learning_rate.setter
    def learning_rate(self, value: float | mx.array) -> None:
        _check_learning_rate(value)
        _MLX_LEARNING_RATE.fset(self, value)

    @property
    def state(self) -> dict[str, Any]:
        value: dict[str, Any] = _MLX_STATE.fget(self)
        return value

    @state.setter
    def state(self, value: dict[str, Any]) -> None:
        # A scheduled learning rate is the schedule's at the next step, not
        # the one the state holds.
        scheduled = "learning_rate" in self._schedulers
        if isinstance(value, dict) and "learning_rate" in value and not scheduled:
            _check_learning_rate(value["learning_rate"])
        _MLX_STATE.fset(self, value)

    def __getstate__(self) -> dict[str, Any]:
        # MLX's dtypes do not pickle (MLX's own optimizers hold none): a copy
        # or a pickle carries their names.
        return {
            k: _DtypeName(_dtype_name(v) or "") if isinstance(v, mx.Dtype) else v
            for k, v in self.__dict__.items()
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            {k: getattr(mx, v.name) if isinstance(v, _DtypeName) else v for k, v in state.items()}
        )

    def _start(self, learning_rate: Any, **hyperparameters: Any) -> None:
        """What every constructor does once its range checks pass: each
        hyperparameter one number (:func:`_one_number_each`), MLX's optimizer
        made, and the learning rate (or its schedule) kept."""
        _one_number_each(learning_rate, **hyperparameters)
        optim.Optimizer.__init__(self)  # type: ignore[no-untyped-call]
        self._maybe_schedule("learning_rate", learning_rate)

    def _set_state_dtype(self, state_dtype: Any, stochastic_rounding: Any) -> None:
        name = _dtype_name(state_dtype)
        allowed = tuple(_dtype_name(d) or "" for d in STATE_DTYPES)
        rounding.check_state_dtype(name, state_dtype, allowed=allowed, spelled="mx.")
        rounding.check_stochastic_rounding(
            stochastic_rounding, name, allowed=allowed, spelled="mx."
        )
        self.state_dtype, self.stochastic_rounding = state_dtype, stochastic_rounding
        self._stochastic = rounding.stochastic(name, stochastic_rounding)

    def _zeros(self, parameter: mx.array) -> mx.array:
        """A state array for ``parameter``, in ``state_dtype`` if one is set."""
        if self.state_dtype is None:
            return mx.zeros_like(parameter)
        name = _dtype_name(self.state_dtype) or ""
        param_name = _dtype_name(parameter.dtype) or str(parameter.dtype)
        rounding.check_narrower(name, self.state_dtype.size, param_name, parameter.dtype.size)
        return mx.zeros(parameter.shape, dtype=self.state_dtype)

    def apply_gradients(self, gradients: dict[str, Any], parameters: dict[str, Any]) -> Any:
        # A parameter's position, for the seeds of its state's rounding: its
        # place in the gradients' tree, in which order ``apply_single`` is called.
        self._position = 0
        # Counted only when a state is rounded (_noise); not kept past the step.
        self._gradients: Any = gradients
        self._step_seeds: mx.array | None = None
        self._positions: dict[tuple[int, ...], mx.array] = {}
        # MLX steps the parameters one by one, writing each one's state as it
        # goes: a step that fails part-way (a gradient of the wrong shape) puts
        # the state back as it was, in the same dictionaries (which a caller
        # may hold). Under mx.compile what it puts back are the trace's arrays.
        before, initialized = _containers_of(self.state), self._initialized
        try:
            return super().apply_gradients(gradients, parameters)
        except BaseException:
            _restore(before)
            self._initialized = initialized
            raise
        finally:
            self._gradients, self._step_seeds, self._positions = None, None, {}

    def _held(self, stored: list[mx.array], parameter: mx.array) -> list[mx.array]:
        """``stored`` in the dtype this optimizer keeps its state in (``state_dtype``,
        else the parameter's): a state loaded from a checkpoint of another
        ``state_dtype`` is converted to it at its first step, as torch's
        ``load_state_dict`` converts it."""
        dtype = parameter.dtype if self.state_dtype is None else self.state_dtype
        return [x if x.dtype == dtype else x.astype(dtype) for x in stored]

    def _noise(self, stored: list[mx.array], parameter: mx.array) -> _Noise | None:
        """What the rounding of this parameter's ``stored`` states reads (None
        where none is rounded stochastically): its elements' flat positions and
        each state's seed. The position in the tree moves on.

        Every state's seed of the step is computed at once, on the first call
        (one small array: a few operations per step, not per parameter), and
        the positions once per shape: each array is one more operation, and
        MLX's CPU operations cost microseconds each, which many small
        parameters add up.
        """
        position = self._next_position()
        if not self._stochastic or all(x.dtype == parameter.dtype for x in stored):
            return None
        step_seeds = self._seeds_of_step()
        shape = tuple(parameter.shape)
        if shape not in self._positions:
            count = math.prod(shape)
            self._positions[shape] = mx.arange(count, dtype=mx.uint32).reshape(shape)
        first = rounding.state_index(position)
        # Shape (1,), which broadcasts, where it keeps the state's shape (an
        # index is two operations); a 0-d parameter's seeds are 0-d.
        if parameter.ndim == 0:
            seeds = tuple(step_seeds[first + k] for k in range(len(stored)))
        else:
            seeds = tuple(step_seeds[first + k : first + k + 1] for k in range(len(stored)))
        return self._positions[shape], seeds

    def _next_position(self) -> int:
        """This parameter's position in the tree; the next one's after it."""
        position, self._position = self._position, self._position + 1
        return position

    def _seeds_of_step(self) -> mx.array:
        """Every state's rounding seed of this step, indexed by
        :func:`qhoptim.rounding.state_index` (computed on the first call of a step)."""
        if self._step_seeds is None:
            count = len(tree_flatten(self._gradients))
            indices = mx.arange(rounding.state_index(count), dtype=mx.uint32)
            seeds = rounding.rounding_seed(self.step.astype(mx.uint32), indices, _BITS)
            self._step_seeds = _materialized(seeds)
        return self._step_seeds


class _QHOptimizer(_NarrowState):
    """What QHM and QHAdam share: the step's scalar coefficients, computed once
    per step and dtype for all parameters (:meth:`_step_coefficients`)."""

    weight_decay: float
    decoupled_weight_decay: bool

    def apply_gradients(self, gradients: dict[str, Any], parameters: dict[str, Any]) -> Any:
        # The step's coefficients by dtype, and what the C++ step reads that is
        # the same for every parameter of a step (_kernel_step): made on first
        # need, and of this step only.
        self._coefficients: dict[Any, Any] = {}
        self._kernel_step: dict[str, Any] = {}
        try:
            return super().apply_gradients(gradients, parameters)
        finally:
            self._coefficients, self._kernel_step = {}, {}

    def _coefficients_for(self, dtype: mx.Dtype) -> Any:
        if dtype not in self._coefficients:
            self._coefficients[dtype] = self._step_coefficients(dtype)
        return self._coefficients[dtype]

    def _step_coefficients(self, dtype: mx.Dtype) -> Any:
        raise NotImplementedError

    def _decay_factor(self, lr: mx.array) -> Any:
        """The decoupled decay factor ``1 - lr * weight_decay``, or the number 1."""
        if self.decoupled_weight_decay and self.weight_decay != 0:
            return _materialized(rules.decoupled_decay_factor(lr, self.weight_decay))
        return 1

    def _coupled_weight_decay(self) -> float:
        return 0.0 if self.decoupled_weight_decay else self.weight_decay

    def _set_fused(self, fused: Any) -> None:
        self._check_fused(fused)
        self.fused = fused

    def _check_fused(self, fused: Any) -> None:
        if fused is not None:
            validation.check_bool(fused, "fused")
        if fused and _dtype_name(self.state_dtype) not in (None, "float32", "bfloat16"):
            raise ValueError(
                "fused=True stores the state in float32 or bfloat16; "
                f"received state_dtype={self.state_dtype!r}"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "fused" and name in self.__dict__:  # set later: as the constructor checks it
            self._check_fused(value)
        super().__setattr__(name, value)

    def _kernel_store(self, gradient: mx.array, parameter: mx.array, stored: list[mx.array]) -> Any:
        """How the C++ step (:mod:`qhoptim.mlx._extension`) stores this
        parameter's state, or None where MLX's operations step it: a float32
        parameter with float32 or bfloat16 state, under ``fused=True``; under
        ``fused=None`` a bfloat16 state on MLX's CPU, where the step is built; a
        gradient of the parameter's shape."""
        if self.fused is False or parameter.dtype != mx.float32 or gradient.dtype != mx.float32:
            return None
        if gradient.shape != parameter.shape or any(x.shape != parameter.shape for x in stored):
            return None  # one that broadcasts: MLX's operations take it
        dtypes = {x.dtype for x in stored}
        if dtypes == {mx.bfloat16}:
            store = _Store.BFLOAT16_STOCHASTIC if self._stochastic else _Store.BFLOAT16_NEAREST
        elif dtypes == {mx.float32} and self.fused:
            store = _Store.FLOAT32
        else:
            return None
        if self.fused is None:
            if "by default" not in self._kernel_step:  # asked once a step, and only here
                self._kernel_step["by default"] = (
                    mx.default_device() == mx.cpu and _extension.fused_extension_available()
                )
            if not self._kernel_step["by default"]:
                return None
        return store

    def _kernel_inputs(self) -> tuple[list[Any], dict[str, Any]]:
        """The step's coefficients in the C++ step's layout (``csrc/fused_cpu.cpp``),
        numbers or float32 arrays, and its form (which terms the loop computes)."""
        raise NotImplementedError

    def _fused_step(
        self, gradient: mx.array, parameter: mx.array, stored: list[mx.array], store: _Store
    ) -> list[mx.array]:
        """The new states and parameter from the C++ step (``store``: from
        :meth:`_kernel_store`). Its coefficients are one array, made once per step."""
        position = self._next_position()
        if "coefficients" not in self._kernel_step:
            values, self._kernel_step["form"] = self._kernel_inputs()
            # A value of shape (1,) (a learning rate so given) is one number too.
            self._kernel_step["coefficients"] = mx.stack(
                [
                    (x if x.ndim == 0 else x.reshape(()))
                    if isinstance(x, mx.array)
                    else mx.array(x, dtype=mx.float32)
                    for x in values
                ]
            )
        if store is _Store.BFLOAT16_STOCHASTIC:
            seeds = self._seeds_of_step()
        else:  # read by no step
            seeds = self._kernel_step.setdefault("no seeds", mx.zeros((0,), dtype=mx.uint32))
        outputs: list[mx.array] = _extension.fused_extension().fused_step(
            parameter, gradient, stored, self._kernel_step["coefficients"], seeds,
            store=store.value, first_seed=rounding.state_index(position),
            **self._kernel_step["form"],
        )  # fmt: skip
        return outputs
