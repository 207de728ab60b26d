"""QHMuon as optax transformations: :func:`scale_by_qhmuon` and :func:`qhmuon`."""

from __future__ import annotations

import math
from collections.abc import Callable
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
from qhoptim.optax._tree import (
    ScalarOrSchedule,
    bias_correction,
    check_learning_rate,
    flatten,
    inexact_dtype,
    narrow_working_dtype,
    real_hyperparameters,
)


class ScaleByQHMuonState(NamedTuple):
    """State of :func:`scale_by_qhmuon`: the update count (for the bias
    corrections) and the normalized momentum buffer, as ``optax.contrib``'s
    ``MuonState`` keeps them (``count``, ``mu``)."""

    count: jax.Array  # type: ignore[assignment]
    momentum_buffer: optax.Updates


def _matmul_add(c: jax.Array, a: jax.Array, b: jax.Array, beta: Any, alpha: Any) -> jax.Array:
    # ``beta * c + alpha * a @ b`` as optax's Muon writes it: Python evaluates
    # ``alpha * a @ b`` as ``(alpha * a) @ b``.
    result: jax.Array = beta * c + alpha * a @ b
    return result


# Newton-Schulz as ``optax.contrib.muon`` runs it (its default "frobenius"
# preconditioning: the norm plus eps).
def _repeat(count: Any, f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``f`` applied ``count`` times by a ``fori_loop``: ``ns_steps`` under
    ``optax.inject_hyperparams`` is an array (a Python int unrolls in
    :func:`qhoptim.rules.newton_schulz`)."""
    looped: jax.Array = jax.lax.fori_loop(0, count, lambda _, y: f(y), x)
    return looped


def _to_float16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float16)


_JAX_MATRIX_OPS = rules.MatrixOps(
    matmul=jnp.matmul,
    matmul_add=_matmul_add,
    transpose=lambda x: x.T,
    norm=jnp.linalg.norm,
    clamp_min=jnp.maximum,
    repeat=_repeat,
)


def _check_muon_matrices(params: optax.Params) -> None:
    for p in jax.tree.leaves(params):
        if p.ndim != 2:
            raise ValueError(
                "scale_by_qhmuon takes matrices only (qhmuon routes other arrays to "
                f"AdamW); received an array of shape {tuple(p.shape)}"
            )


@real_hyperparameters
def scale_by_qhmuon(
    ns_coeffs: tuple[float, float, float] = rules.MUON_NS_COEFFICIENTS,
    ns_steps: int = rules.MUON_NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Any | None = None,
    *,
    nu: float = 0.95,
    ns_dtype: Any | None = None,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformation:
    r"""Rescale updates by Muon with quasi-hyperbolic momentum (matrices only).

    .. math::

        g_t &= \beta g_{t-1} + (1 - \beta) u_t \\
        u'_t &= \mathrm{NS}\Big(\nu \frac{g_t}{1 - \min(\nu, 1)\beta^t}
            + (1 - \nu) \frac{u_t}{1 - \beta^t}\Big)

    ``optax.contrib.scale_by_muon``'s step with its Nesterov switch replaced by
    ``nu`` (:func:`qhoptim.rules.qhm_bias_corrected_direction`): ``nu=beta`` is
    ``nesterov=True`` (optax's :math:`\beta \hat m_t + (1 - \beta) \hat u_t`,
    the buffer corrected by :math:`1 - \beta^{t+1}`), ``nu=1``
    ``nesterov=False``. :math:`\mathrm{NS}` is
    :func:`qhoptim.rules.newton_schulz` with optax's
    :math:`\lVert U \rVert_F + \epsilon`; its "frobenius" preconditioning
    only, no weight dimension numbers, not ``adaptive``.

    Args:
      ns_coeffs: Newton-Schulz coefficients :math:`(a, b, c)`.
      ns_steps: Newton-Schulz steps, in ``[0, 100)``.
      beta: :math:`\beta`, the buffer's discount factor, in ``[0, 1)``.
      eps: added to the norm Newton-Schulz divides by.
      mu_dtype: optional dtype of the momentum buffer, as optax's.
      nu: :math:`\nu`, any finite real (default optax's Nesterov, ``0.95``).
      ns_dtype: optional dtype Newton-Schulz runs in (None: the update's, as
        optax's Muon).
      state_dtype, stochastic_rounding: store the buffer in a narrower dtype,
        as :func:`scale_by_qhm` does (stepped in the update's dtype, written
        back with :mod:`qhoptim.rounding`'s stochastic rounding for bfloat16
        and 8 bits, seeded by the update count); not with ``mu_dtype``.

    Returns:
      A :class:`optax.GradientTransformation` with state :class:`ScaleByQHMuonState`.
    """
    validation.check_qhmuon(
        lr=0.0, momentum=beta, nu=nu, weight_decay=0.0, eps=eps, ns_steps=ns_steps,
        ns_coefficients=ns_coeffs, adjust_lr_fn=None, adjustments=rules.MUON_LR_ADJUSTMENTS,
        names={"momentum": "beta", "ns_coefficients": "ns_coeffs"},
    )  # fmt: skip
    beta, nu, eps = validation.as_float(beta), validation.as_float(nu), validation.as_float(eps)
    mu_dtype, ns_dtype = inexact_dtype(mu_dtype, "mu_dtype"), inexact_dtype(ns_dtype, "ns_dtype")
    state_dtype = checked_state_dtype(state_dtype, stochastic_rounding, mu_dtype=mu_dtype)
    stochastic = rounding.stochastic(
        None if state_dtype is None else jnp.dtype(state_dtype).name, stochastic_rounding
    )
    a, b, c = (float(x) for x in ns_coeffs)
    coefficients = (a, b, c)

    def init_fn(params: optax.Params) -> ScaleByQHMuonState:
        _check_muon_matrices(params)
        if state_dtype is not None:
            check_narrow_params(params, state_dtype)
            buffers = zeros_state(params, state_dtype, signed=True)
        else:
            buffers = optax.tree.zeros_like(params, dtype=mu_dtype)
        return ScaleByQHMuonState(count=jnp.zeros([], jnp.int32), momentum_buffer=buffers)

    def update_fn(
        updates: optax.Updates, state: ScaleByQHMuonState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleByQHMuonState]:
        del params
        grads, treedef = flatten(updates)
        buffers = stored_leaves(treedef, state.momentum_buffer, "momentum_buffer", True)
        count = optax.safe_increment(state.count)
        grad_correction = bias_correction(beta, count)
        buffer_correction = rules.qhmuon_buffer_correction(nu, grad_correction, minimum=jnp.minimum)
        new_updates: list[Any] = []
        new_buffers: list[Any] = []
        for position, (g, buf) in enumerate(zip(grads, buffers, strict=True)):
            if g is None:
                new_updates.append(None)
                new_buffers.append(buf)
                continue
            # A narrow buffer steps in narrow_working_dtype, then is stored narrow.
            working = buf if state_dtype is None else load(buf, narrow_working_dtype(g.dtype))
            b = rules.ewma(working, g, beta)
            # In float32 where float16 would overflow: the first step's bias
            # correction multiplies by 1 / (1 - beta), 20 at beta = 0.95.
            wide = [x.astype(jnp.float32) if x.dtype == jnp.float16 else x for x in (g, b)]
            direction = rules.qhm_bias_corrected_direction(
                wide[0], wide[1], nu=nu, grad_correction=grad_correction.astype(wide[0].dtype),
                buffer_correction=buffer_correction.astype(wide[1].dtype),
            )  # fmt: skip
            # float16 is normalized in float32 first (rules.newton_schulz's ``narrow``).
            half = jnp.dtype(g.dtype if ns_dtype is None else ns_dtype) == jnp.float16
            if half:
                direction = direction.astype(jnp.float32)
            elif ns_dtype is not None:
                direction = direction.astype(ns_dtype)
            rows, columns = direction.shape
            orthogonal = rules.newton_schulz(
                direction, rows=rows, columns=columns, ops=_JAX_MATRIX_OPS,
                coefficients=coefficients, steps=ns_steps, eps=eps, norm_guard="add",
                narrow=_to_float16 if half else None,
            )  # fmt: skip
            new_updates.append(orthogonal.astype(g.dtype))
            if state_dtype is not None:
                seed = rounding_seed(count, rounding.state_index(position))
                new_buffers.append(store(b, buf, seed, stochastic))
            else:
                new_buffers.append(b if mu_dtype is None else b.astype(mu_dtype))
        new_state = ScaleByQHMuonState(count, jax.tree.unflatten(treedef, new_buffers))
        return jax.tree.unflatten(treedef, new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _scale_by_muon_shape(consistent_rms: float | None) -> optax.GradientTransformation:
    """Each matrix's update times :func:`qhoptim.rules.muon_lr_ratio`; optax's
    ``(fan_in, fan_out)`` layout, as its ``scale_by_shape``."""
    adjust = None if consistent_rms is None else "match_rms_adamw"
    rms = 0.2 if consistent_rms is None else consistent_rms

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params

        def scaled(u: jax.Array) -> jax.Array:
            fan_in, fan_out = u.shape
            return rules.muon_lr_ratio(adjust, fan_out, fan_in, rms=rms) * u

        return jax.tree.map(scaled, updates), state

    # optax.EmptyState() rather than optax.init_empty_state, which optax 0.2.5 lacks.
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


@real_hyperparameters
def qhmuon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: tuple[float, float, float] = rules.MUON_NS_COEFFICIENTS,
    ns_steps: int = rules.MUON_NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any | Callable[[optax.Params], Any] | None = None,
    mu_dtype: Any | None = None,
    *,
    nu: float = 0.95,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: ScalarOrSchedule | None = None,
    adam_nesterov: bool = True,
    consistent_rms: float | None = None,
    ns_dtype: Any | None = None,
    state_dtype: Any | None = None,
    stochastic_rounding: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Muon with quasi-hyperbolic momentum: ``optax.contrib.muon`` plus ``nu``.

    Matrices step by :func:`scale_by_qhmuon`, scaled by their shape
    (:math:`\sqrt{\max(1, \text{fan\_out}/\text{fan\_in})}`, or
    ``consistent_rms`` :math:`\cdot \sqrt{\max(\text{fan\_in}, \text{fan\_out})}`),
    with decoupled ``weight_decay`` and the learning rate; every other array
    steps by ``optax.adamw`` with the ``adam_*`` settings, as optax's Muon
    routes them. The arguments are ``optax.contrib.muon``'s with ``nesterov``
    replaced by ``nu`` (and ``adam_nesterov`` for AdamW's, which optax ties to
    ``nesterov``): ``nu=beta`` is ``muon(nesterov=True)``, ``nu=1``
    ``muon(nesterov=False)`` (:func:`qhoptim.convert.from_muon`).
    ``state_dtype`` and ``stochastic_rounding`` store the matrices' buffers
    narrower (:func:`scale_by_qhmuon`); AdamW's moments follow ``mu_dtype``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import qhoptim.optax as qho
      >>> solver = qho.qhmuon(0.02, beta=0.999, nu=0.7)
      >>> params = {"w": jnp.eye(3), "b": jnp.zeros(3)}
      >>> state = solver.init(params)
      >>> updates, state = solver.update({"w": jnp.eye(3), "b": jnp.ones(3)}, state, params)
      >>> print(updates["w"].shape, updates["b"].shape)
      (3, 3) (3,)
    """
    learning_rate = check_learning_rate(learning_rate)
    validation.check_weight_decay(weight_decay)
    validation.check_bool(adam_nesterov, "adam_nesterov")
    # AdamW's settings for the other arrays: optax.adamw takes them unchecked.
    validation.check_beta(adam_b1, "adam_b1")
    validation.check_beta(adam_b2, "adam_b2")
    validation.check_eps(adam_eps_root, "adam_eps_root")
    validation.check_weight_decay(adam_weight_decay, "adam_weight_decay")
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    elif not callable(adam_learning_rate):
        validation.check_lr(adam_learning_rate, "adam_learning_rate")
    if consistent_rms is not None:
        # A scale of the update's RMS: a negative one would turn the step around.
        validation.check_interval(consistent_rms, "consistent_rms", 0.0, math.inf)

    def labels(params: optax.Params) -> Any:
        return jax.tree.map(lambda x: "qhmuon" if x.ndim == 2 else "adam", params)

    return optax.partition(
        {
            "qhmuon": optax.chain(
                scale_by_qhmuon(
                    ns_coeffs,
                    ns_steps,
                    beta,
                    eps,
                    mu_dtype if state_dtype is None else None,  # the buffers': state_dtype's
                    nu=nu,
                    ns_dtype=ns_dtype,
                    state_dtype=state_dtype,
                    stochastic_rounding=stochastic_rounding,
                ),
                _scale_by_muon_shape(consistent_rms),
                optax.add_decayed_weights(validation.as_float(weight_decay), weight_decay_mask),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(
                learning_rate=adam_learning_rate,
                b1=adam_b1,
                b2=adam_b2,
                eps=eps,
                eps_root=adam_eps_root,
                weight_decay=adam_weight_decay,
                mu_dtype=mu_dtype,
                nesterov=adam_nesterov,
            ),
        },
        labels,
    )
