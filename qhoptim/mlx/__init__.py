r"""QHM, QHAdam, QHAdamW and QHMuon for Apple's MLX (``mlx.optimizers.Optimizer`` subclasses).

They are used like ``mlx.optimizers.SGD`` and ``Adam``: ``optimizer.update(model,
grads)`` after ``nn.value_and_grad``, a learning rate that is a number or one
of MLX's schedules, the state in ``optimizer.state`` (saved with
``mlx.utils.tree_flatten`` and ``mx.save_safetensors``), and a training step
that ``mx.compile`` compiles with ``inputs=`` / ``outputs=`` naming the state::

    import mlx.optimizers as optim
    import qhoptim.mlx as qhmlx

    optimizer = qhmlx.QHM(learning_rate=1.0, momentum=0.999, nu=0.7)  # the rule of thumb
    optimizer = qhmlx.QHAdam(optim.cosine_decay(1e-3, 10_000), betas=(0.999, 0.999), nus=(0.7, 1.0))

The math of every step comes from :mod:`qhoptim.rules`; this module only keeps
MLX's optimizer conventions. Each parameter's step is one ``mx.compile``\ d
function of the rule, so an eager step is one fused kernel per parameter and a
compiled training step inlines it. Hyperparameters other than the learning
rate are Python numbers and constants of that function (``1 - beta`` is formed
in float64 before it meets the array, as in every backend); the first step of
a configuration compiles its kernel, and changing one of them later compiles
again. Schedule only ``learning_rate``.

``fused=True`` steps each float32 parameter in one pass over memory: a C++
kernel, an MLX primitive (``csrc/fused_cpu.cpp``) that reads the parameter,
its gradient and its state once and writes them back (in place where MLX
donates the old arrays), float32 or bfloat16 state alike, with the same
coefficients and the same bits as the operations' step run one by one. It
has no gradient or ``vmap`` rule. It is built on first
use against the installed MLX (a C++ compiler and nanobind, which the ``mlx``
extra installs; ``$QHOPTIM_CACHE_DIR`` or ``~/.cache/qhoptim`` keeps the
build) and runs on MLX's CPU stream. A bfloat16 state steps there by default
(``fused=None``) where the default device is the CPU and the kernel builds:
MLX does not fuse its operations across the bit cast that rounding needs, and
its own step of a bfloat16 state takes three passes or more.

Dtypes: a Python float ``learning_rate`` becomes a float32 ``mx.array`` (MLX's
convention), so float64 parameters would step with a learning rate rounded to
float32. A float64 user passes ``learning_rate=mx.array(lr, dtype=mx.float64)``
or a schedule that returns float64 (float64 runs on MLX's CPU stream).

References:
  Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
  <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple

try:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
except ImportError as error:  # pragma: no cover - exercised where MLX is absent
    raise ImportError(
        f"qhoptim.mlx needs MLX ({error.name} is not installed). "
        'Install it with `pip install "qhoptim[mlx]"`.'
    ) from error

from qhoptim import convert, rounding, rules, validation
from qhoptim.mlx import _extension

__all__ = ["QHM", "QHAdam", "QHAdamW", "QHMuon"]

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


def _one_number_each(**hyperparameters: Any) -> None:
    """The compiled steps take each hyperparameter as one Python number (as
    MLX's own optimizers do, which accept an array and fail at the step)."""
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


# One parameter's step, compiled: MLX fuses it into one kernel (on the CPU it
# compiles C++ on first use and caches it; without a compiler it runs the ops
# one by one). Python-number hyperparameters are constants of the compiled
# function, so ``1 - beta`` is formed in float64 before it meets the array.


@mx.compile
def _qhm_step(
    grad: mx.array, param: mx.array, buf: mx.array, lr: mx.array, factor: Any,
    momentum: Any, nu: Any, coupled_wd: Any, noise: _Noise | None = None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """One parameter's step; ``lr`` (in the parameter's dtype) and the decoupled
    decay ``factor`` are this step's, computed once for all parameters. The
    weights stay Python numbers, constants of the kernel: each array scalar is
    one more broadcast input of the fused kernel, measurably slower on the CPU.
    A buffer stored narrower than the parameter steps in the parameter's dtype
    and is stored back with :func:`_stored` (``noise``: its seed and positions)."""
    if coupled_wd:
        grad = rules.coupled_weight_decay(grad, param, coupled_wd)
    new_buf, direction = rules.qhm_update(grad, _working(buf, param), momentum=momentum, nu=nu)
    return _stored(new_buf, buf.dtype, noise), rules.apply_update(param, direction, lr, factor)


def _sqrt(x: Any) -> Any:
    """A number's square root as a number (``mx.sqrt`` would make it a float32
    array, and round it so for float64 parameters), an array's as an array."""
    return math.sqrt(x) if isinstance(x, (int, float)) else mx.sqrt(x)


def _is_number(x: Any, value: float) -> bool:
    return isinstance(x, (int, float)) and x == value


def _scaled(param: mx.array, factor: Any) -> mx.array:
    """``param * factor``; ``param`` itself for the number 1 (no decoupled decay)."""
    return param if _is_number(factor, 1) else param * factor


@mx.compile
def _qhadam_step(
    grad: mx.array, param: mx.array, m: mx.array, v: mx.array, v_max: mx.array | None,
    form: Any, weights: tuple[Any, ...], factor: Any, b1: Any, b2: Any, coupled_wd: Any,
    noise: _Noise | None = None,
) -> tuple[mx.array, ...]:  # fmt: skip
    """One parameter's step in the folded form the fused kernels of every
    backend use (:func:`qhoptim.rules.folded_qhadam_step`): the step's scalar
    coefficients (``folded``, with the learning rate, and the decoupled decay
    ``factor``) are computed once per step for all parameters, so that the
    element-wise kernel does only the moments' and the update's arithmetic.
    ``form`` is the fold's :class:`~qhoptim.rules.Denominator` by value and
    ``weights`` its other fields (``mx.compile`` takes arrays and numbers)."""
    folded = rules.FoldedQHAdam(rules.Denominator(form), *weights)
    if coupled_wd:
        grad = rules.coupled_weight_decay(grad, param, coupled_wd)
    stored = [m, v] if v_max is None else [m, v, v_max]
    m, v, *rest = (_working(x, param) for x in stored)
    m = rules.ewma(m, grad, b1)
    v = rules.ewma(v, grad * grad, b2)
    if rest:
        rest = [rules.amsgrad_maximum(rest[0], v, maximum=mx.maximum)]
    delta = rules.folded_qhadam_step(folded, grad, m, rest[0] if rest else v, sqrt=mx.sqrt)
    param = _scaled(param, factor) + delta
    moments = [
        _stored(x, kept.dtype, noise, k)
        for k, (x, kept) in enumerate(zip([m, v, *rest], stored, strict=True))
    ]
    return (*moments, param)


def _bias_correction(beta: Any, step: mx.array, dtype: mx.Dtype) -> mx.array:
    """``1 - beta**step`` by :func:`qhoptim.rules.bias_correction`'s policy, in ``dtype``.

    float64 parameters: ``1 - beta**t`` in float64, as the reference computes
    it. Below float64: ``-expm1(t * log(beta))`` in float32 (``log`` of a
    Python ``beta`` taken in float64), which keeps float32's relative precision
    near ``beta = 1``, then rounded to the parameter's dtype.
    """
    if dtype == mx.float64:
        bc = rules.bias_correction(beta, step.astype(mx.float64))
    else:
        log = mx.log if isinstance(beta, mx.array) else math.log
        t = step.astype(mx.float32)
        bc = rules.bias_correction(beta, t, expm1=mx.expm1, log=log).astype(dtype)
    # Materialized (3x the step's time with a single large parameter otherwise,
    # expm1 or pow evaluated once per element).
    return mx.contiguous(bc)


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
        validation.check_lr(value, "learning_rate")
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
            validation.check_lr(value["learning_rate"], "learning_rate")
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


class QHM(_QHOptimizer):
    r"""Quasi-hyperbolic momentum.

    .. math::

        g_{t+1} &= \beta g_t + (1 - \beta) \nabla_t \\
        \theta_{t+1} &= \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]

    The buffer :math:`g` is normalized (an average of past gradients), unlike
    ``mlx.optimizers.SGD``'s velocity: ``SGD(lr, momentum=beta)`` is
    ``QHM(lr / (1 - beta), beta, nu=1.0)`` and ``nesterov=True`` is
    ``nu=beta`` (:meth:`from_params` with :func:`qhoptim.convert.from_nesterov`).

    Args:
      learning_rate: :math:`\alpha`, a number, an ``mx.array`` or a schedule
        (a callable of the step, as MLX's ``optimizers.cosine_decay``).
      momentum: :math:`\beta`, in ``[0, 1)``.
      nu: :math:`\nu`, any finite real (0: SGD, 1: momentum, beta: Nesterov).
      weight_decay: :math:`\lambda \ge 0`; coupled (L2, ``grad + lambda *
        param``) unless ``decoupled_weight_decay``.
      decoupled_weight_decay: multiply the parameter by ``1 - alpha * lambda``
        before the step instead (AdamW-style).
      state_dtype: store the buffer in this dtype (``mx.bfloat16``: half a
        float32 model's state); the step runs in the parameter's dtype and
        writes back with :mod:`qhoptim.rounding`'s stochastic rounding.
      stochastic_rounding: ``None`` (stochastic for bfloat16) or a bool;
        ``False`` rounds to nearest.
      fused: ``True``: each float32 parameter with a float32 or bfloat16
        state steps in the C++ kernel (see the module's notes; a
        ``RuntimeError`` says what is missing where it cannot be built), other
        parameters with MLX's operations. ``None``: only a bfloat16 state, and
        only where the default device is the CPU and the kernel builds.
        ``False``: MLX's operations always. The numbers are the same.

    State per parameter: ``momentum_buffer``.

    Example:
      >>> import mlx.core as mx
      >>> import qhoptim.mlx as qhmlx
      >>> optimizer = qhmlx.QHM(learning_rate=0.5)
      >>> params = {"x": mx.array([1.0, 2.0, 3.0])}
      >>> for _ in range(3):  # the gradient of sum(x**2)
      ...     params = optimizer.apply_gradients({"x": 2 * params["x"]}, params)
      >>> print(f"{mx.sum(params['x'] ** 2).item():.4f}")  # qhoptim.reference.QHM gives 1.62121
      1.6212
    """

    _CHECKS = MappingProxyType(
        {
            "momentum": validation.check_beta,
            "nu": validation.check_nu,
            "weight_decay": validation.check_weight_decay,
            "decoupled_weight_decay": validation.check_bool,
        }
    )

    def __init__(
        self,
        learning_rate: LearningRate,
        momentum: float = 0.999,
        nu: float = 0.7,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        validation.check_qhm(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=weight_decay,
            names={"lr": "learning_rate"},
        )
        validation.check_bool(decoupled_weight_decay, "decoupled_weight_decay")
        _one_number_each(momentum=momentum, nu=nu, weight_decay=weight_decay)
        super().__init__()  # type: ignore[no-untyped-call]
        self._maybe_schedule("learning_rate", learning_rate)  # type: ignore[arg-type]
        # Concrete scalars (a NumPy float, a 0-d array) as the Python floats they hold.
        self.momentum, self.nu = validation.as_float(momentum), validation.as_float(nu)
        self.weight_decay = validation.as_float(weight_decay)
        self.decoupled_weight_decay = decoupled_weight_decay
        self._set_state_dtype(state_dtype, stochastic_rounding)
        self._set_fused(fused)

    @classmethod
    def from_params(cls, params: convert.QHMParams, **kwargs: Any) -> QHM:
        """Build from a :class:`qhoptim.convert.QHMParams`, e.g. a conversion's result."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHMParams)
        return cls(params.lr, params.momentum, params.nu, **kwargs)

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["momentum_buffer"] = self._zeros(parameter)

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        (buf,) = self._held([state["momentum_buffer"]], parameter)
        store = self._kernel_store(gradient, parameter, [buf])
        if store is not None:
            buf, parameter = self._fused_step(gradient, parameter, [buf], store)
            state["momentum_buffer"] = buf
            return parameter
        lr, factor = self._coefficients_for(parameter.dtype)
        state["momentum_buffer"], parameter = _qhm_step(
            gradient, parameter, buf, lr, factor,
            self.momentum, self.nu, self._coupled_weight_decay(), self._noise([buf], parameter),
        )  # fmt: skip
        return parameter

    def _kernel_inputs(self) -> tuple[list[Any], dict[str, Any]]:
        lr, factor = self._coefficients_for(mx.float32)
        coupled_wd = self._coupled_weight_decay()
        values = [*rules.qhm_coefficients(self.momentum, self.nu), lr, factor, coupled_wd]
        form = {"qhadam": False, "denominator": 0, "grad_term": True}
        return values, {**form, "coupled": coupled_wd != 0, "decay": not _is_number(factor, 1)}

    def _step_coefficients(self, dtype: mx.Dtype) -> tuple[mx.array, Any]:
        """This step's learning rate and decoupled decay factor, in ``dtype``."""
        lr = _materialized(self.learning_rate.astype(dtype))
        return lr, self._decay_factor(lr)


class QHAdam(_QHOptimizer):
    r"""QHAdam: Adam with quasi-hyperbolic moment estimators.

    .. math::

        \theta_{t+1} = \theta_t - \alpha \,
            \frac{(1 - \nu_1) \nabla_t + \nu_1 \hat g_{t+1}}
                 {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 \hat s_{t+1}} + \epsilon}

    with bias-corrected moments :math:`\hat g, \hat s`. ``nus=(1, 1)`` is
    ``mlx.optimizers.Adam(..., bias_correction=True)``; the moments keep
    Adam's state names, ``m`` and ``v``. Bias correction is always on (it is
    the paper's QHAdam).

    Args:
      learning_rate: :math:`\alpha`, a number, an ``mx.array`` or a schedule.
      betas: :math:`(\beta_1, \beta_2)`, each in ``[0, 1)``.
      nus: :math:`(\nu_1, \nu_2)`: ``nu1`` any finite real, ``nu2`` in ``[0, 1]``.
      eps: added to the denominator after the square root, ``>= 0``.
      weight_decay: :math:`\lambda \ge 0`; coupled (L2) unless
        ``decoupled_weight_decay``.
      decoupled_weight_decay: decay as AdamW does (see :class:`QHAdamW`).
      amsgrad: the AMSGrad variant (:func:`qhoptim.rules.qhadam_amsgrad_update`,
        as ``torch.optim.Adam(amsgrad=True)``): the denominator reads the running
        maximum ``v_max`` of the uncorrected second moment, an extra state.
      state_dtype: store the moments in this dtype (``mx.bfloat16``: 4 bytes
        per float32 parameter instead of 8), as :class:`QHM`'s buffer.
      stochastic_rounding: as :class:`QHM`'s.
      fused: as :class:`QHM`'s.

    Example:
      >>> import mlx.core as mx
      >>> import qhoptim.mlx as qhmlx
      >>> optimizer = qhmlx.QHAdam(learning_rate=0.1, nus=(0.7, 1.0))
      >>> params = {"x": mx.array([1.0, 2.0, 3.0])}
      >>> for _ in range(3):
      ...     params = optimizer.apply_gradients({"x": 2 * params["x"]}, params)
      >>> print(f"{mx.sum(params['x'] ** 2).item():.4f}")  # qhoptim.reference.QHAdam gives 10.69798
      10.6980
    """

    _CHECKS = MappingProxyType(
        {
            "betas": _pair(validation.check_beta, validation.check_beta),
            "nus": _pair(validation.check_nu, validation.check_nu2),
            "eps": validation.check_eps,
            "weight_decay": validation.check_weight_decay,
            "decoupled_weight_decay": validation.check_bool,
            "amsgrad": validation.check_bool,
        }
    )

    def __init__(
        self,
        learning_rate: LearningRate,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        amsgrad: bool = False,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        validation.check_bool(amsgrad, "amsgrad")
        validation.check_bool(decoupled_weight_decay, "decoupled_weight_decay")
        b1, b2 = validation.check_pair(betas, "betas")
        nu1, nu2 = validation.check_pair(nus, "nus")
        validation.check_qhadam(
            lr=learning_rate,
            beta1=b1,
            beta2=b2,
            nu1=nu1,
            nu2=nu2,
            eps=eps,
            weight_decay=weight_decay,
            names={
                "lr": "learning_rate",
                "beta1": "betas[0]",
                "beta2": "betas[1]",
                "nu1": "nus[0]",
                "nu2": "nus[1]",
            },
        )
        _one_number_each(
            **{"betas[0]": b1, "betas[1]": b2, "nus[0]": nu1, "nus[1]": nu2},
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__()  # type: ignore[no-untyped-call]
        self._maybe_schedule("learning_rate", learning_rate)  # type: ignore[arg-type]
        # Concrete scalars (a NumPy float, a 0-d array) as the Python floats they hold.
        b1, b2, nu1, nu2, eps = map(validation.as_float, (b1, b2, nu1, nu2, eps))
        self.betas, self.nus, self.eps, self.amsgrad = (b1, b2), (nu1, nu2), eps, amsgrad
        self.weight_decay = validation.as_float(weight_decay)
        self.decoupled_weight_decay = decoupled_weight_decay
        self._set_state_dtype(state_dtype, stochastic_rounding)
        rounding.check_second_moment_dtype(_dtype_name(state_dtype))
        self._set_fused(fused)

    @classmethod
    def from_params(cls, params: convert.QHAdamParams, **kwargs: Any) -> QHAdam:
        """Build from a :class:`qhoptim.convert.QHAdamParams`, e.g. ``convert.from_nadam(...)``."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHAdamParams)
        return cls(params.lr, params.betas, params.nus, params.eps, **kwargs)

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["m"] = self._zeros(parameter)
        state["v"] = self._zeros(parameter)
        if self.amsgrad:
            state["v_max"] = self._zeros(parameter)

    def _step_coefficients(self, dtype: mx.Dtype) -> tuple[rules.FoldedQHAdam, Any]:
        """This step's folded coefficients and decoupled decay factor, in ``dtype``.

        :func:`qhoptim.rules.qhadam_coefficients` of the bias corrections,
        folded with the learning rate by :func:`qhoptim.rules.fold_qhadam`: the
        common factor comes out of the square root when the denominator has
        one term (with both, which term's weight to factor out depends on the
        values, so they stay as they are). Each array is materialized.
        """
        (b1, b2), (nu1, nu2) = self.betas, self.nus
        lr = self.learning_rate.astype(dtype)
        bc1 = _bias_correction(b1, self.step, dtype)
        bc2 = _bias_correction(b2, self.step, dtype)
        c = rules.qhadam_coefficients(nu1, nu2, bc1, bc2)
        form = rules.qhadam_denominator(nu2)
        one_term = form is not rules.Denominator.MIX
        folded = rules.fold_qhadam(c, lr, self.eps, form, factor_out=one_term, sqrt=_sqrt)
        return rules.FoldedQHAdam(*map(_materialized, folded)), self._decay_factor(lr)

    def _kernel_inputs(self) -> tuple[list[Any], dict[str, Any]]:
        folded, factor = self._coefficients_for(mx.float32)
        (b1, b2), coupled_wd = self.betas, self._coupled_weight_decay()
        values = [b1, 1 - b1, b2, 1 - b2, *folded[1:], factor, coupled_wd]
        form = {
            "qhadam": True,
            "denominator": _DENOMINATORS[folded.denominator],
            "grad_term": not _is_number(folded.grad_value, 0),
            "coupled": coupled_wd != 0,
            "decay": not _is_number(factor, 1),
        }
        return values, form

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        if self.amsgrad and "v_max" not in state:  # amsgrad switched on for a stepped state
            state["v_max"] = mx.zeros_like(state["v"])  # max(0, v) = v, as torch's (its dtype)
        keys = ("m", "v", "v_max") if self.amsgrad else ("m", "v")
        stored = self._held([state[k] for k in keys], parameter)
        store = self._kernel_store(gradient, parameter, stored)
        if store is not None:
            *moments, parameter = self._fused_step(gradient, parameter, stored, store)
            state.update(zip(keys, moments, strict=True))
            return parameter
        folded, factor = self._coefficients_for(parameter.dtype)
        *moments, parameter = _qhadam_step(
            gradient, parameter, stored[0], stored[1], stored[2] if self.amsgrad else None,
            folded.denominator.value, tuple(folded[1:]), factor, *self.betas,
            self._coupled_weight_decay(), self._noise(stored, parameter),
        )  # fmt: skip
        state.update(zip(keys, moments, strict=True))
        return parameter


class QHAdamW(QHAdam):
    r"""QHAdam with decoupled weight decay, as ``mlx.optimizers.AdamW``.

    :math:`\theta \leftarrow (1 - \alpha\lambda)\,\theta` before the QHAdam
    step. ``weight_decay`` defaults to ``0.01``, MLX ``AdamW``'s default.
    """

    def __init__(
        self,
        learning_rate: LearningRate,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        amsgrad: bool = False,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            learning_rate, betas, nus, eps, weight_decay, True, amsgrad=amsgrad,
            state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, fused=fused,
        )  # fmt: skip


def _matmul_add(c: mx.array, a: mx.array, b: mx.array, beta: float, alpha: float) -> mx.array:
    """``beta * c + alpha * (a @ b)`` as ``mlx.optimizers.Muon`` forms it:
    ``addmm(beta * c, a, b, alpha=alpha)``. ``addmm`` takes ``alpha`` as a
    float32, so in float64 the product is scaled as an array instead, keeping
    the coefficient's float64 value (the reference's numbers)."""
    if c.dtype == mx.float64:
        return beta * c + alpha * mx.matmul(a, b)
    return mx.addmm(beta * c, a, b, alpha=alpha, beta=1.0)


# Newton-Schulz on MLX as ``mlx.optimizers.Muon`` runs it; the norm keeps its
# dimensions.
_MLX_MATRIX_OPS = rules.MatrixOps(
    matmul=mx.matmul,
    matmul_add=_matmul_add,
    transpose=lambda x: x.T,
    norm=lambda x: mx.linalg.norm(x, keepdims=True),
    clamp_min=mx.maximum,
)

# The dtypes QHMuon's ns_dtype may be (None: the parameter's own).
_NS_DTYPES = (mx.bfloat16, mx.float16, mx.float32, mx.float64)


def _check_ns_dtype(value: Any, name: str) -> Any:
    """QHMuon's ``ns_dtype``: None or one of :data:`_NS_DTYPES`."""
    if value is not None and value not in _NS_DTYPES:
        names = ", ".join(f"mx.{_dtype_name(d)}" for d in _NS_DTYPES)  # a name is no dtype
        raise ValueError(f"{name} must be None or one of {names}; received {name}={value!r}")
    return value


class QHMuon(_NarrowState):
    r"""Muon with quasi-hyperbolic momentum: ``mlx.optimizers.Muon`` plus ``nu``.

    .. math::

        g_{t+1} &= \beta g_t + (1 - \beta) (\nabla_t + \lambda \theta_t) \\
        \theta_{t+1} &= \theta_t - \alpha\, r\, \mathrm{NS}\big((1 - \nu)
            (\nabla_t + \lambda \theta_t) + \nu g_{t+1}\big)

    MLX's Muon step, operation for operation, with its Nesterov switch replaced
    by ``nu``: ``nu=momentum`` is ``Muon(nesterov=True)``, ``nu=1``
    ``Muon(nesterov=False)`` (:func:`qhoptim.convert.from_muon`). As MLX's Muon:
    the weight decay is coupled (added to the gradient); an array of more than
    two dimensions is orthogonalized as the matrix ``(shape[0], -1)``; the
    learning rate is scaled by :math:`r = \sqrt{\max(1, A / B)}` for the last
    two dimensions :math:`A \times B`; arrays of fewer than two dimensions take
    QHM's direction as it is (MLX's advice stands: give them, the embedding and
    the output layer to AdamW). Newton-Schulz is :func:`qhoptim.rules.newton_schulz`
    with MLX's :math:`\lVert U \rVert_F + 10^{-7}`.

    Args:
      learning_rate: :math:`\alpha`, a number, an ``mx.array`` or a schedule.
      momentum: :math:`\beta`, in ``[0, 1)``.
      nu: :math:`\nu`, any finite real (default Muon's Nesterov, ``0.95``).
      weight_decay: :math:`\lambda \ge 0`, coupled, as MLX's Muon.
      ns_steps: Newton-Schulz steps, in ``[0, 100)``.
      ns_dtype: the dtype Newton-Schulz runs in (None: the parameter's, as
        MLX's Muon; ``mx.float64`` for the float64 reference's numbers).
      state_dtype, stochastic_rounding: store the buffer narrower, as
        :class:`QHM` does (the step in the parameter's dtype, the buffer
        written back with :mod:`qhoptim.rounding`'s stochastic rounding).

    State per parameter: ``momentum_buffer``.
    """

    _CHECKS = MappingProxyType(
        {
            "momentum": validation.check_beta,
            "nu": validation.check_nu,
            "weight_decay": validation.check_weight_decay,
            "ns_steps": validation.check_ns_steps,
            "ns_dtype": _check_ns_dtype,
        }
    )

    def __init__(
        self,
        learning_rate: LearningRate,
        momentum: float = 0.95,
        nu: float = 0.95,
        weight_decay: float = 0.01,
        ns_steps: int = rules.MUON_NS_STEPS,
        *,
        ns_dtype: mx.Dtype | None = None,
        state_dtype: mx.Dtype | None = None,
        stochastic_rounding: bool | None = None,
    ) -> None:
        validation.check_qhmuon(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=weight_decay,
            eps=rules.MUON_EPS,
            ns_steps=ns_steps,
            ns_coefficients=rules.MUON_NS_COEFFICIENTS,
            adjust_lr_fn=None,
            adjustments=rules.MUON_LR_ADJUSTMENTS,
            names={"lr": "learning_rate"},
        )
        _check_ns_dtype(ns_dtype, "ns_dtype")
        _one_number_each(momentum=momentum, nu=nu, weight_decay=weight_decay)
        super().__init__()  # type: ignore[no-untyped-call]
        self._maybe_schedule("learning_rate", learning_rate)  # type: ignore[arg-type]
        self.momentum, self.nu = validation.as_float(momentum), validation.as_float(nu)
        self.weight_decay = validation.as_float(weight_decay)
        self.ns_steps, self.ns_dtype = int(ns_steps), ns_dtype
        self._set_state_dtype(state_dtype, stochastic_rounding)

    @classmethod
    def from_params(cls, params: convert.QHMuonParams, **kwargs: Any) -> QHMuon:
        """Build from :func:`qhoptim.convert.from_muon`'s settings; ``kwargs``
        (``learning_rate`` first) go to the constructor."""
        validation.check_conversion(f"{cls.__name__}.from_params", params, convert.QHMuonParams)
        return cls(**{**params.as_kwargs(), **kwargs})

    def init_single(self, parameter: mx.array, state: dict[str, Any]) -> None:
        _check_real(parameter)
        state["momentum_buffer"] = self._zeros(parameter)

    def apply_single(
        self, gradient: mx.array, parameter: mx.array, state: dict[str, Any]
    ) -> mx.array:
        if self.weight_decay != 0:
            gradient = rules.coupled_weight_decay(gradient, parameter, self.weight_decay)
        (buf,) = self._held([state["momentum_buffer"]], parameter)
        noise = self._noise([buf], parameter)
        new_buf, direction = rules.qhm_update(
            gradient, _working(buf, parameter), momentum=self.momentum, nu=self.nu
        )
        state["momentum_buffer"] = _stored(new_buf, buf.dtype, noise)
        lr = self.learning_rate.astype(gradient.dtype)
        if direction.ndim < 2 or direction.size == 0:  # an empty matrix steps as nothing
            stepped: mx.array = rules.apply_update(parameter, direction, lr)
            return stepped
        matrix = direction.reshape(direction.shape[0], -1)
        if self.ns_dtype is not None:
            matrix = matrix.astype(self.ns_dtype)
        rows, columns = matrix.shape
        orthogonal = rules.newton_schulz(
            matrix, rows=rows, columns=columns, ops=_MLX_MATRIX_OPS,
            steps=self.ns_steps, norm_guard="add",
        )  # fmt: skip
        update = orthogonal.reshape(direction.shape).astype(direction.dtype)
        ratio = rules.muon_lr_ratio(None, direction.shape[-2], direction.shape[-1])
        stepped = rules.apply_update(parameter, update, lr * ratio)
        return stepped
