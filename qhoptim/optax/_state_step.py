"""The C++ state step: a bfloat16 or 8-bit state's moving averages stepped and
stored in one XLA custom call on the CPU (``fused``; :mod:`qhoptim.optax._extension`),
XLA's operations elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qhoptim import rounding, validation
from qhoptim.optax import _extension
from qhoptim.optax._narrow import levels


def check_fused(fused: Any, state_dtype: Any, stochastic: bool) -> None:
    validation.check_optional_bool(fused, "fused")
    if fused and _fused_target_of(state_dtype, stochastic) is None:
        raise ValueError(
            "fused=True stores a bfloat16 state rounded stochastically, or an 8-bit "
            "state, in C++ (state_dtype=jnp.bfloat16 with stochastic_rounding None or "
            "True, or state_dtype=jnp.uint8); received "
            f"state_dtype={None if state_dtype is None else jnp.dtype(state_dtype).name!r}"
            f"{'' if state_dtype is None else f', rounded stochastically: {stochastic}'}"
        )


def _fused_target_of(state_dtype: Any, stochastic: bool) -> str | None:
    """The custom call that stores a state of ``state_dtype``, if one does."""
    if state_dtype == jnp.uint8:
        return _extension.EIGHT_BIT_TARGET
    if state_dtype == jnp.bfloat16 and stochastic:
        return _extension.TARGET
    return None


def state_target(fused: bool | None, state_dtype: Any, stochastic: bool) -> str | None:
    """The custom call that stores this step's narrow states on the CPU
    (:mod:`qhoptim.optax._extension`), or None for XLA's operations: under
    ``fused=True`` (built here, or an error), or ``fused=None`` where it builds,
    the CPU is JAX's default backend and the process has one CPU device."""
    target = _fused_target_of(state_dtype, stochastic)
    if fused is False or target is None:
        return None
    if fused:
        _extension.state_extension()
        return target
    # The call takes whole arrays: on a mesh of CPU devices XLA would gather a
    # sharded state into it and keep the new state replicated.
    # Only where the CPU is what the step runs on: a GPU or TPU host would
    # compile C++ it never runs.
    try:
        if jax.default_backend() != "cpu" or len(jax.devices("cpu")) > 1:
            return None
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS leaves it out)
        return None
    return target if _extension.state_extension_available() else None


def _varies_over_manual_axes(x: jax.Array) -> bool:
    """Whether ``x`` is a per-device value inside ``jax.shard_map``, where the
    custom call's results (no varying axes) would not match XLA's branch of
    :func:`jax.lax.platform_dependent`, which traces both."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # a JAX older than per-device types
        return False
    aval = typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return bool(manual.varying or manual.unreduced or manual.reduced)
    return bool(getattr(aval, "vma", ()))  # JAX 0.6 to 0.9


class Pending(NamedTuple):
    """A parameter whose narrow states the C++ step stores: its gradient,
    stored states and their seeds, and the same states stored by XLA's
    operations (``in_xla()``, the path off the CPU)."""

    grad: jax.Array
    stored: list[Any]
    seeds: list[jax.Array]
    in_xla: Callable[[], list[Any]]


def stepped_states(
    target: str, weights: tuple[Any, ...], pending: list[Pending], stochastic: bool
) -> list[list[Any]]:
    """The new narrow states of the ``pending`` parameters: stepped and
    stored by one call of the custom call ``target`` where the step runs on
    the CPU, else each parameter's ``in_xla()``.

    ``weights`` are each moving average's decay and the weight of what it
    averages (:func:`qhoptim.rules.qhadam_moment_weights`'s order), in
    float32 as the operations use them. The update itself stays with XLA,
    which fuses it into ``optax.apply_updates``; it reads the stored states
    too, so the new ones are written beside them, not over them (an in-place
    call would make XLA copy each state first). An 8-bit state
    (:class:`EightBitArray`) passes as its codes and scales, with the two
    ladders of :func:`qhoptim.rounding.eight_bit_levels`.
    """
    if not pending:
        return []
    if any(np.ndim(w) > 0 for w in weights):
        # A hyperparameter of several elements (broadcast against its leaf, as
        # optax allows): the call takes one number per weight.
        return [leaf.in_xla() for leaf in pending]
    stored = [x for leaf in pending for x in leaf.stored]
    eight_bit = target == _extension.EIGHT_BIT_TARGET
    if eight_bit and any(
        x.signed != (k == 0) for leaf in pending for k, x in enumerate(leaf.stored)
    ):
        # The call reads the first state (QHM's buffer, QHAdam's first
        # moment) as signed and the others as unsigned, as init makes them.
        return [leaf.in_xla() for leaf in pending]
    stored_arrays = jax.tree.leaves(stored)  # an 8-bit state's codes, then its scales
    grads = [leaf.grad for leaf in pending]
    if any(_varies_over_manual_axes(x) for x in (*grads, *stored_arrays)):
        return [leaf.in_xla() for leaf in pending]
    count = len(pending[0].stored)
    coefficients = jnp.stack([jnp.asarray(w, jnp.float32) for w in weights])
    seeds = jnp.stack([seed for leaf in pending for seed in leaf.seeds])
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in stored_arrays]  # type: ignore[no-untyped-call]
    attributes = {"states": np.int64(count)}
    constants = [coefficients, seeds]
    if eight_bit:
        constants += [jnp.asarray(levels(True)), jnp.asarray(levels(False))]
        attributes["per_octave"] = np.int64(rounding.EIGHT_BIT_PER_OCTAVE)
        attributes["stochastic"] = np.int64(stochastic)

    def on_cpu(*arrays: jax.Array) -> list[Any]:
        # A stored state has no derivative (XLA's branch makes a bfloat16 one
        # through a bit cast, an 8-bit one's scales stop it), and jax.grad
        # through an update differentiates both branches: the call, which has
        # no derivative rule, sees constants.
        operands = [jax.lax.stop_gradient(x) for x in (*constants, *arrays)]
        call = jax.ffi.ffi_call(target, shapes, vmap_method="sequential")
        results = list(call(*operands, **attributes))
        return jax.tree.unflatten(jax.tree.structure(stored), results)  # type: ignore[no-any-return]

    def elsewhere(*arrays: jax.Array) -> list[Any]:
        return [x for leaf in pending for x in leaf.in_xla()]

    flat = jax.lax.platform_dependent(*grads, *stored_arrays, cpu=on_cpu, default=elsewhere)
    return [flat[i * count : (i + 1) * count] for i in range(len(pending))]
