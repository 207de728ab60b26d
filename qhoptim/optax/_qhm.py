"""QHM as optax transformations: :func:`scale_by_qhm` and :func:`qhm`."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qhoptim import rounding, rules, validation
from qhoptim.optax._narrow import (
    check_narrow_params,
    checked_state_dtype,
    load,
    rounding_seed,
    store,
    stored_leaves,
    zeros_state,
)
from qhoptim.optax._state_step import Pending, check_fused, state_target, stepped_states
from qhoptim.optax._tree import (
    ScalarOrSchedule,
    check_learning_rate,
    flatten,
    hyperparameter_in,
    inexact_dtype,
    narrow_working_dtype,
    real_hyperparameters,
)


class ScaleByQHMState(NamedTuple):
    """State of :func:`scale_by_qhm`: the normalized momentum buffer ``g``."""

    momentum_buffer: optax.Updates


class ScaleByQHMCountState(NamedTuple):
    """State of :func:`scale_by_qhm` with a ``state_dtype``: the buffer, and the
    number of updates taken, which seeds the buffer's stochastic rounding."""

    count: jax.Array  # type: ignore[assignment]  # shape=(), int32
    momentum_buffer: optax.Updates


@real_hyperparameters
def scale_by_qhm(
    momentum: float | jax.Array = 0.999,
    nu: float | jax.Array = 0.7,
    *,
    accumulator_dtype: Any | None = None,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
    fused: bool | None = None,
) -> optax.GradientTransformation:
    r"""Rescale updates by quasi-hyperbolic momentum (QHM).

    .. math::

        g_t &= \beta g_{t-1} + (1 - \beta) u_t \\
        u'_t &= (1 - \nu) u_t + \nu g_t

    where :math:`u_t` are the incoming updates (gradients), :math:`\beta` is
    ``momentum`` and :math:`\nu` is ``nu``. The momentum buffer is normalized
    (an average of past gradients), unlike ``optax.trace``: ``nu = 1`` is
    momentum with learning rate ``lr / (1 - beta)`` in ``optax.sgd`` terms,
    ``nu = beta`` is Nesterov's accelerated gradient, ``nu = 0`` plain SGD.

    Args:
      momentum: :math:`\beta`, the buffer's discount factor, in ``[0, 1)``.
      nu: :math:`\nu`, the immediate discount factor; any finite real.
      accumulator_dtype: optional dtype of the momentum buffer; ``None`` uses
        the parameters' dtype. As in ``optax.sgd``, the buffer is cast to it
        (rounded to nearest) after each step.
      state_dtype: optional dtype to *store* the buffer in, e.g.
        ``jnp.bfloat16`` (half a float32 model's state); the step is computed
        in the parameters' dtype and written back with
        :mod:`qhoptim.rounding`'s stochastic rounding (bfloat16), so the buffer
        follows the float32 one on average where rounding to nearest would
        freeze it. ``jnp.uint8`` stores it in 8 bits (:class:`EightBitArray`:
        a byte per value and a float32 scale per 256 values, rounded
        stochastically between levels by the same rule; a quarter of float32's
        bytes). Not with ``accumulator_dtype``; not wider than the parameters.
      stochastic_rounding: with ``state_dtype``: ``None`` (stochastic for
        bfloat16 and 8 bits) or a bool; ``False`` rounds to nearest.
      fused: where a bfloat16 state (rounded stochastically) or an 8-bit
        state of a float32 parameter is stepped on the CPU. ``None``
        (default): in one C++ pass, an XLA custom call built on first use
        (``csrc/state_cpu.cpp``; a C++ compiler is needed, else XLA's
        operations); ``True``: the same, and an error where it cannot be
        built; ``False``: XLA's operations. The update
        is XLA's on every path, and so is every other platform's step, and
        ``None``'s where the process has several CPU devices (the call takes
        whole arrays: under ``fused=True`` XLA gathers a sharded state into
        it, and the new state comes out replicated). The
        same rule, not always the same bits: XLA may contract a product and a
        sum into one fused multiply-add, the C++ step never does.

    Returns:
      A :class:`optax.GradientTransformation` with state :class:`ScaleByQHMState`
      (:class:`ScaleByQHMCountState` with a ``state_dtype``: its rounding is
      seeded by the update count).

    References:
      Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
      <https://arxiv.org/abs/1810.06801>`_, ICLR 2019, section 3.
    """
    validation.check_beta(validation.check_not_callable(momentum, "momentum"), "momentum")
    validation.check_nu(validation.check_not_callable(nu, "nu"), "nu")
    # Concrete scalars (one-element NumPy or JAX arrays) as the floats they hold;
    # traced values (jit, inject_hyperparams) stay arrays.
    momentum, nu = validation.as_float(momentum), validation.as_float(nu)
    accumulator_dtype = inexact_dtype(accumulator_dtype, "accumulator_dtype")
    state_dtype = checked_state_dtype(
        state_dtype, stochastic_rounding, accumulator_dtype=accumulator_dtype
    )
    stochastic = rounding.stochastic(
        None if state_dtype is None else jnp.dtype(state_dtype).name, stochastic_rounding
    )
    check_fused(fused, state_dtype, stochastic)

    def _stored(value: jax.Array, like: Any, seed: jax.Array) -> list[Any]:
        return [store(value, like, seed, stochastic)]

    def init_fn(params: optax.Params) -> ScaleByQHMState | ScaleByQHMCountState:
        if state_dtype is None:
            return ScaleByQHMState(optax.tree.zeros_like(params, dtype=accumulator_dtype))
        check_narrow_params(params, state_dtype)
        buffers = zeros_state(params, state_dtype, signed=True)
        return ScaleByQHMCountState(count=jnp.zeros([], jnp.int32), momentum_buffer=buffers)

    def update_fn(
        updates: optax.Updates,
        state: ScaleByQHMState | ScaleByQHMCountState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ScaleByQHMState | ScaleByQHMCountState]:
        del params
        grads, treedef = flatten(updates)
        buffers = stored_leaves(treedef, state.momentum_buffer, "momentum_buffer", True)
        count = None
        if state_dtype is not None:
            if not isinstance(state, ScaleByQHMCountState):
                raise TypeError(
                    "scale_by_qhm(state_dtype=...) needs its own state, ScaleByQHMCountState "
                    f"(from its init); received {type(state).__name__}"
                )
            count = optax.safe_increment(state.count)
        target = state_target(fused, state_dtype, stochastic)
        pending: list[Pending] = []  # the parameters the C++ step stores
        slots: list[int] = []  # their positions
        new_updates: list[Any] = []
        new_buffers: list[Any] = []
        for position, (g, buf) in enumerate(zip(grads, buffers, strict=True)):
            if g is None:
                new_updates.append(None)
                new_buffers.append(buf)
                continue
            # A narrow buffer steps in narrow_working_dtype, then is stored narrow.
            dtype = buf.dtype if state_dtype is None else narrow_working_dtype(g.dtype)
            b, direction = rules.qhm_update(
                g,
                load(buf, dtype),
                momentum=hyperparameter_in(momentum, dtype),
                nu=hyperparameter_in(nu, dtype),
            )
            new_updates.append(direction.astype(g.dtype))
            if count is None:
                new_buffers.append(b.astype(dtype))
            else:
                seed = rounding_seed(count, rounding.state_index(position))
                # The C++ step takes a float32 gradient of its state's shape.
                if target is None or g.dtype != jnp.float32 or g.shape != buf.shape:
                    new_buffers.append(store(b, buf, seed, stochastic))
                    continue
                slots.append(len(new_buffers))
                new_buffers.append(None)
                pending.append(Pending(g, [buf], [seed], functools.partial(_stored, b, buf, seed)))
        if pending and target is not None:
            c = rules.qhm_coefficients(
                hyperparameter_in(momentum, jnp.float32), hyperparameter_in(nu, jnp.float32)
            )
            weights = (c.buffer_decay, c.grad_to_buffer, 0.0, 0.0)
            for slot, (stepped,) in zip(
                slots, stepped_states(target, weights, pending, stochastic), strict=True
            ):
                new_buffers[slot] = stepped
        buffer_tree = jax.tree.unflatten(treedef, new_buffers)
        new_state: ScaleByQHMState | ScaleByQHMCountState
        if count is None:
            new_state = ScaleByQHMState(buffer_tree)
        else:
            new_state = ScaleByQHMCountState(count=count, momentum_buffer=buffer_tree)
        return jax.tree.unflatten(treedef, new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@real_hyperparameters
def qhm(
    learning_rate: ScalarOrSchedule,
    momentum: float | jax.Array = 0.999,
    nu: float | jax.Array = 0.7,
    *,
    accumulator_dtype: Any | None = None,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Quasi-hyperbolic momentum.

    .. math::

        g_t &= \beta g_{t-1} + (1 - \beta) \nabla_t \\
        \theta_t &= \theta_{t-1} - \alpha \left[(1 - \nu) \nabla_t + \nu g_t\right]

    with :math:`\alpha` = ``learning_rate``, :math:`\beta` = ``momentum``,
    :math:`\nu` = ``nu``. The defaults are the paper's rule of thumb. To move
    from ``optax.sgd(lr, momentum=beta, nesterov=...)`` use
    ``learning_rate = lr / (1 - beta)`` (see :mod:`qhoptim.convert`). For L2
    weight decay, chain ``optax.add_decayed_weights(wd)`` *before* this
    optimizer.

    Args:
      learning_rate: a float or an optax schedule.
      momentum: :math:`\beta`, in ``[0, 1)``.
      nu: :math:`\nu`, any finite real (0: SGD, 1: momentum, beta: NAG).
      accumulator_dtype: optional dtype of the momentum buffer.
      state_dtype, stochastic_rounding, fused: store the buffer in a narrower
        dtype, and where a bfloat16 or 8-bit one is stepped (see
        :func:`scale_by_qhm`).

    Returns:
      The corresponding :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import qhoptim.optax as qho
      >>> f = lambda x: jnp.sum(x**2)
      >>> solver = qho.qhm(learning_rate=0.5)
      >>> params = jnp.array([1.0, 2.0, 3.0])
      >>> state = solver.init(params)
      >>> for _ in range(3):
      ...     updates, state = solver.update(jax.grad(f)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(f"{f(params):.4f}")  # qhoptim.reference.QHM gives 1.62121
      1.6212

    References:
      Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
      <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
    """
    learning_rate = check_learning_rate(learning_rate)
    return optax.chain(
        scale_by_qhm(
            momentum,
            nu,
            accumulator_dtype=accumulator_dtype,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            fused=fused,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )
