"""QHAdam and QHAdamW as optax transformations: :func:`scale_by_qhadam`,
:func:`qhadam` and :func:`qhadamw`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from qhoptim import rounding, rules, validation
from qhoptim.optax._narrow import (
    EightBitArray,
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
    abs_sq,
    bias_correction,
    check_learning_rate,
    flatten,
    hyperparameter_in,
    inexact_dtype,
    narrow_working_dtype,
    real_dtype,
    real_hyperparameters,
)


class ScaleByQHAdamState(NamedTuple):
    """State of :func:`scale_by_qhadam`."""

    # ``count`` shadows ``tuple.count``, as in optax's own ``ScaleByAdamState``,
    # whose field name tools such as ``optax.tree.get(state, "count")`` expect.
    count: jax.Array  # type: ignore[assignment]  # shape=(), int32: number of updates taken
    mu: optax.Updates  # first-moment EWMA g (torch's exp_avg)
    # The second-moment EWMA s (torch's exp_avg_sq; real dtype, also for complex
    # params). The field keeps optax's name ``nu``, as in ``ScaleByAdamState``;
    # it is unrelated to QHAdam's immediate discounts nu1, nu2.
    nu: optax.Updates


class ScaleByQHAdamAmsgradState(NamedTuple):
    """State of :func:`scale_by_qhadam` with ``amsgrad=True``.

    :class:`ScaleByQHAdamState`'s fields and ``nu_max``, as in optax's
    ``ScaleByAmsgradState``: the running maximum of the *uncorrected* second
    moment ``nu`` (torch's ``max_exp_avg_sq``; ``optax.amsgrad``'s ``nu_max``
    holds the maximum of the bias-corrected one instead).
    """

    count: jax.Array  # type: ignore[assignment]  # shape=(), int32: number of updates taken
    mu: optax.Updates
    nu: optax.Updates
    nu_max: optax.Updates


@real_hyperparameters
def scale_by_qhadam(
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    nu1: float | jax.Array = 1.0,
    nu2: float | jax.Array = 1.0,
    eps: float | jax.Array = 1e-8,
    *,
    mu_dtype: Any | None = None,
    amsgrad: bool = False,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
    fused: bool | None = None,
) -> optax.GradientTransformation:
    r"""Rescale updates according to QHAdam.

    .. math::

        g_t &= \beta_1 g_{t-1} + (1 - \beta_1) u_t, &
        \hat g_t &= g_t / (1 - \beta_1^t) \\
        s_t &= \beta_2 s_{t-1} + (1 - \beta_2) |u_t|^2, &
        \hat s_t &= s_t / (1 - \beta_2^t) \\
        u'_t &= \frac{(1 - \nu_1) u_t + \nu_1 \hat g_t}
                    {\sqrt{(1 - \nu_2) |u_t|^2 + \nu_2 \hat s_t} + \epsilon}

    with :math:`\beta_1, \beta_2` = ``b1, b2``, :math:`\nu_1, \nu_2` = ``nu1,
    nu2`` and :math:`\epsilon` = ``eps``. ``nu1 = nu2 = 1`` is Adam
    (``optax.scale_by_adam`` with ``eps_root=0``). :math:`\epsilon` is added
    after the bias-corrected square root, as in the paper and in optax's Adam.
    The state keeps optax's field names: ``mu`` is the first moment :math:`g`
    (torch's ``exp_avg``), ``nu`` the second moment :math:`s` (``exp_avg_sq``).

    Bias corrections follow :func:`qhoptim.rules.bias_correction`: in float32
    (JAX's default) they are ``-expm1(t * log(beta))``, accurate to float32's
    relative precision even for ``beta`` within ``1e-7`` of 1, where
    ``1 - beta**t`` -- what ``optax.scale_by_adam`` computes -- loses most of
    its digits; with ``jax_enable_x64`` they are ``1 - beta**t`` in float64.

    ``amsgrad=True`` is the AMSGrad variant
    (:func:`qhoptim.rules.qhadam_amsgrad_update`) with torch's and Keras's
    convention: the running maximum :math:`\hat s_t = \max(\hat s_{t-1}, s_t)`
    of the *uncorrected* second moment replaces :math:`s_t` and is divided by
    this step's :math:`1 - \beta_2^t`. ``optax.scale_by_amsgrad`` instead keeps
    the maximum of the bias-corrected :math:`s_t / (1 - \beta_2^t)`, which
    differs while the bias correction still changes; so ``nu1 = nu2 = 1`` with
    ``amsgrad=True`` is ``torch.optim.Adam(amsgrad=True)``, not ``optax.amsgrad``.

    Args:
      b1: decay of the first-moment EWMA, in ``[0, 1)``.
      b2: decay of the second-moment EWMA, in ``[0, 1)``.
      nu1: immediate discount of the first moment; any finite real.
      nu2: immediate discount of the second moment, in ``[0, 1]``; values
        below 1 tighten the worst-case step on spiky gradients.
      eps: term added to the denominator, ``>= 0``.
      mu_dtype: optional dtype of the first moment; ``None`` uses the
        parameters' dtype. As in ``optax.adam``, the moment is cast to it
        (rounded to nearest) after each step.
      amsgrad: the AMSGrad variant (above); its state is
        :class:`ScaleByQHAdamAmsgradState`, with the running maximum ``nu_max``.
      state_dtype: optional dtype to *store* both moments (and ``nu_max``) in,
        e.g. ``jnp.bfloat16``: 4 bytes of state per float32 parameter instead
        of 8. The step is computed in the parameters' dtype and written back
        with :mod:`qhoptim.rounding`'s stochastic rounding (bfloat16), so the
        moments follow the float32 ones on average where rounding to nearest
        would freeze them. ``jnp.uint8`` stores them in 8 bits
        (:class:`EightBitArray`: about 2.03 bytes of state per parameter).
        Not with ``mu_dtype``; not wider than the parameters.
      stochastic_rounding: with ``state_dtype``: ``None`` (stochastic for
        bfloat16 and 8 bits) or a bool; ``False`` rounds to nearest.
      fused: where bfloat16 or 8-bit moments are stepped on the CPU, as in
        :func:`scale_by_qhm`.

    Returns:
      A :class:`optax.GradientTransformation` with state
      :class:`ScaleByQHAdamState` (:class:`ScaleByQHAdamAmsgradState` with
      ``amsgrad``).

    References:
      Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
      <https://arxiv.org/abs/1810.06801>`_, ICLR 2019, section 5.
    """
    validation.check_qhadam(
        lr=0.0,
        beta1=b1,
        beta2=b2,
        nu1=nu1,
        nu2=nu2,
        eps=eps,
        names={"beta1": "b1", "beta2": "b2"},
    )
    validation.check_bool(amsgrad, "amsgrad")
    b1, b2, nu1, nu2, eps = map(validation.as_float, (b1, b2, nu1, nu2, eps))
    mu_dtype = inexact_dtype(mu_dtype, "mu_dtype")
    state_dtype = checked_state_dtype(state_dtype, stochastic_rounding, mu_dtype=mu_dtype)
    state_name = None if state_dtype is None else jnp.dtype(state_dtype).name
    rounding.check_second_moment_dtype(state_name)
    stochastic = rounding.stochastic(state_name, stochastic_rounding)
    check_fused(fused, state_dtype, stochastic)

    def init_fn(params: optax.Params) -> ScaleByQHAdamState | ScaleByQHAdamAmsgradState:
        count = jnp.zeros([], jnp.int32)
        if state_dtype is not None:
            check_narrow_params(params, state_dtype)
            exp_avg = zeros_state(params, state_dtype, signed=True)
            exp_avg_sq = zeros_state(params, state_dtype, signed=False)
        else:
            exp_avg = optax.tree.zeros_like(params, dtype=mu_dtype)
            # zeros_like, not zeros: the moment keeps the parameter's sharding (a
            # sharded model's moments would otherwise all land on one device).
            exp_avg_sq = jax.tree.map(
                lambda p: jnp.zeros_like(p, dtype=real_dtype(p.dtype)), params
            )
        if amsgrad:
            nu_max = jax.tree.map(jnp.zeros_like, exp_avg_sq)
            return ScaleByQHAdamAmsgradState(count=count, mu=exp_avg, nu=exp_avg_sq, nu_max=nu_max)
        return ScaleByQHAdamState(count=count, mu=exp_avg, nu=exp_avg_sq)

    def update_fn(
        updates: optax.Updates,
        state: ScaleByQHAdamState | ScaleByQHAdamAmsgradState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ScaleByQHAdamState | ScaleByQHAdamAmsgradState]:
        del params
        count = optax.safe_increment(state.count)
        bc1, bc2 = bias_correction(b1, count), bias_correction(b2, count)
        grads, treedef = flatten(updates)
        exp_avgs = stored_leaves(treedef, state.mu, "mu", True)
        exp_avg_sqs = stored_leaves(treedef, state.nu, "nu", False)
        if amsgrad:
            if not isinstance(state, ScaleByQHAdamAmsgradState):
                raise TypeError(
                    "scale_by_qhadam(amsgrad=True) needs its own state, "
                    f"ScaleByQHAdamAmsgradState (from its init); received {type(state).__name__}"
                )
            maxes = stored_leaves(treedef, state.nu_max, "nu_max", False)
        else:
            maxes = [None] * len(grads)
        target = state_target(fused, state_dtype, stochastic)
        pending: list[Pending] = []  # the parameters the C++ step stores
        slots: list[int] = []  # their positions
        new_updates: list[Any] = []
        new_exp_avgs: list[Any] = []
        new_exp_avg_sqs: list[Any] = []
        new_maxes: list[Any] = []
        leaves = zip(grads, exp_avgs, exp_avg_sqs, maxes, strict=True)
        for position, (g, exp_avg, exp_avg_sq, max_sq) in enumerate(leaves):
            if g is None:
                new_updates.append(None)
                new_exp_avgs.append(exp_avg)
                new_exp_avg_sqs.append(exp_avg_sq)
                new_maxes.append(max_sq)
                continue
            # The parameters' real dtype; a narrow state steps in narrow_working_dtype.
            dtype = exp_avg_sq.dtype if state_dtype is None else narrow_working_dtype(g.dtype)
            stored = (exp_avg, exp_avg_sq, max_sq)
            if state_dtype is not None:
                exp_avg, exp_avg_sq = load(exp_avg, dtype), load(exp_avg_sq, dtype)
                max_sq = None if max_sq is None else load(max_sq, dtype)
            hparams = {
                "beta1": hyperparameter_in(b1, dtype),
                "beta2": hyperparameter_in(b2, dtype),
                "nu1": hyperparameter_in(nu1, dtype),
                "nu2": hyperparameter_in(nu2, dtype),
                "eps": hyperparameter_in(eps, dtype),
                "bias_correction1": bc1.astype(dtype),
                "bias_correction2": bc2.astype(dtype),
                "sqrt": jnp.sqrt,
                "square": abs_sq,
            }
            if amsgrad:
                next_exp_avg, next_exp_avg_sq, next_max, update = rules.qhadam_amsgrad_update(
                    g, exp_avg, exp_avg_sq, max_sq, maximum=jnp.maximum, **hparams
                )
            else:
                next_exp_avg, next_exp_avg_sq, update = rules.qhadam_update(
                    g, exp_avg, exp_avg_sq, **hparams
                )
            new_updates.append(update.astype(g.dtype))
            if state_dtype is None:
                new_exp_avgs.append(next_exp_avg.astype(exp_avg.dtype))
                new_exp_avg_sqs.append(next_exp_avg_sq.astype(dtype))
                if amsgrad:
                    new_maxes.append(next_max.astype(dtype))
                continue
            seeds = [
                rounding_seed(count, rounding.state_index(position, k))
                for k in range(3 if amsgrad else 2)
            ]
            nexts = [next_exp_avg, next_exp_avg_sq, *([next_max] if amsgrad else [])]

            def in_xla(
                nexts: list[Any] = nexts, stored: Any = stored, seeds: Any = seeds
            ) -> list[Any]:
                states = []
                for k, (x, like) in enumerate(zip(nexts, stored[: len(nexts)], strict=True)):
                    # An 8-bit state draws the noise eight_bit_noise_source names.
                    source, high = (
                        rounding.eight_bit_noise_source(k)
                        if isinstance(like, EightBitArray)
                        else (k, False)
                    )
                    states.append(store(x, like, seeds[source], stochastic, high))
                return states

            # The C++ step takes a float32 gradient of its state's shape (one that
            # broadcasts against its parameter takes XLA's, as optax.adam takes it).
            if target is None or g.dtype != jnp.float32 or g.shape != stored[0].shape:
                stepped: list[Any] = in_xla()
            else:
                slots.append(len(new_exp_avgs))
                pending.append(Pending(g, [x for x in stored if x is not None], seeds, in_xla))
                stepped = [None] * 3
            new_exp_avgs.append(stepped[0])
            new_exp_avg_sqs.append(stepped[1])
            if amsgrad:
                new_maxes.append(stepped[2])
        if pending and target is not None:
            weights = tuple(
                rules.qhadam_moment_weights(
                    hyperparameter_in(b1, jnp.float32), hyperparameter_in(b2, jnp.float32)
                )
            )
            stepped = stepped_states(target, weights, pending, stochastic)
            for slot, states in zip(slots, stepped, strict=True):
                new_exp_avgs[slot], new_exp_avg_sqs[slot] = states[0], states[1]
                if amsgrad:
                    new_maxes[slot] = states[2]
        mu = jax.tree.unflatten(treedef, new_exp_avgs)
        nu = jax.tree.unflatten(treedef, new_exp_avg_sqs)
        new_state: ScaleByQHAdamState | ScaleByQHAdamAmsgradState
        if amsgrad:
            nu_max = jax.tree.unflatten(treedef, new_maxes)
            new_state = ScaleByQHAdamAmsgradState(count=count, mu=mu, nu=nu, nu_max=nu_max)
        else:
            new_state = ScaleByQHAdamState(count=count, mu=mu, nu=nu)
        return jax.tree.unflatten(treedef, new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@real_hyperparameters
def qhadam(
    learning_rate: ScalarOrSchedule,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    nu1: float | jax.Array = 1.0,
    nu2: float | jax.Array = 1.0,
    eps: float | jax.Array = 1e-8,
    *,
    mu_dtype: Any | None = None,
    amsgrad: bool = False,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""QHAdam: Adam with quasi-hyperbolic moment estimators.

    .. math::

        \theta_t = \theta_{t-1} - \alpha \,
            \frac{(1 - \nu_1) \nabla_t + \nu_1 \hat g_t}
                 {\sqrt{(1 - \nu_2) |\nabla_t|^2 + \nu_2 \hat s_t} + \epsilon}

    with the bias-corrected moments of :func:`scale_by_qhadam`,
    :math:`\alpha` = ``learning_rate``. ``nu1 = nu2 = 1`` is ``optax.adam``.
    The paper's sweeps use ``nu1 = 0.7, b1 = 0.999`` as the QH default; when
    replacing a stable Adam it suggests ``nu2 = 1`` with ``b2`` unchanged, and
    ``nu2 < 1`` when Adam training is unstable. For L2 weight decay,
    chain ``optax.add_decayed_weights(wd)`` before; for decoupled decay use
    :func:`qhadamw`.

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2: moment decays, in ``[0, 1)``.
      nu1: any finite real. nu2: in ``[0, 1]``.
      eps: added to the denominator after the square root.
      mu_dtype: optional dtype of the first moment.
      amsgrad: the AMSGrad variant, with torch's convention (see
        :func:`scale_by_qhadam`; not ``optax.amsgrad``'s).
      state_dtype, stochastic_rounding, fused: store the moments in a
        narrower dtype, and where bfloat16 or 8-bit ones are stepped (see
        :func:`scale_by_qhadam`).

    Returns:
      The corresponding :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import qhoptim.optax as qho
      >>> f = lambda x: jnp.sum(x**2)
      >>> solver = qho.qhadam(learning_rate=0.1, nu1=0.7)
      >>> params = jnp.array([1.0, 2.0, 3.0])
      >>> state = solver.init(params)
      >>> for _ in range(3):
      ...     updates, state = solver.update(jax.grad(f)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(f"{f(params):.4f}")  # qhoptim.reference.QHAdam gives 10.69798
      10.6980

    References:
      Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
      <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
    """
    learning_rate = check_learning_rate(learning_rate)
    return optax.chain(
        scale_by_qhadam(
            b1,
            b2,
            nu1,
            nu2,
            eps,
            mu_dtype=mu_dtype,
            amsgrad=amsgrad,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            fused=fused,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


@real_hyperparameters
def qhadamw(
    learning_rate: ScalarOrSchedule,
    b1: float | jax.Array = 0.9,
    b2: float | jax.Array = 0.999,
    nu1: float | jax.Array = 1.0,
    nu2: float | jax.Array = 1.0,
    eps: float | jax.Array = 1e-8,
    weight_decay: float | jax.Array = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    mu_dtype: Any | None = None,
    amsgrad: bool = False,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""QHAdam with decoupled weight decay (as ``optax.adamw``).

    .. math::

        \theta_t = \theta_{t-1} - \alpha \left( u'_t + \lambda \theta_{t-1} \right)
                 = (1 - \alpha\lambda)\, \theta_{t-1} - \alpha u'_t

    where :math:`u'_t` is the :func:`scale_by_qhadam` update and
    :math:`\lambda` = ``weight_decay``. As in ``optax.adamw`` and PyTorch, the
    decay is multiplied by the learning rate.

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2, nu1, nu2, eps: as in :func:`qhadam`.
      weight_decay: :math:`\lambda`, ``>= 0``.
      mask: a pytree of booleans (or a callable returning one) selecting the
        parameters to decay, as in ``optax.add_decayed_weights``.
      mu_dtype: optional dtype of the first moment.
      amsgrad: the AMSGrad variant, as in :func:`qhadam`.
      state_dtype, stochastic_rounding, fused: as in :func:`qhadam`.

    Returns:
      The corresponding :class:`optax.GradientTransformationExtraArgs`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import qhoptim.optax as qho
      >>> solver = qho.qhadamw(learning_rate=0.1, nu1=0.7, weight_decay=0.01)
      >>> params = {"w": jnp.ones(3), "b": jnp.zeros(1)}
      >>> state = solver.init(params)
      >>> grads = {"w": jnp.ones(3), "b": jnp.ones(1)}
      >>> updates, state = solver.update(grads, state, params)
      >>> print(jnp.round(updates["w"], 4))  # -lr * (1 + weight_decay * 1) at step 1
      [-0.101 -0.101 -0.101]

    References:
      Loshchilov & Hutter, `Decoupled weight decay regularization
      <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    learning_rate = check_learning_rate(learning_rate)
    validation.check_weight_decay(weight_decay)
    weight_decay = validation.as_float(weight_decay)
    return optax.chain(
        scale_by_qhadam(
            b1,
            b2,
            nu1,
            nu2,
            eps,
            mu_dtype=mu_dtype,
            amsgrad=amsgrad,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            fused=fused,
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
