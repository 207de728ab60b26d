"""Pytrees, dtypes, hyperparameters and bias corrections as every optax
transformation of :mod:`qhoptim.optax` takes them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from qhoptim import rules, validation

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]
Factory = TypeVar("Factory", bound=Callable[..., Any])


def is_none(x: Any) -> bool:
    return x is None


def flatten(tree: Any) -> tuple[list[Any], Any]:
    # ``None`` leaves (frozen / absent params) are kept as leaves and skipped.
    return jax.tree.flatten(tree, is_leaf=is_none)


def leaves_like(treedef: Any, tree: Any, what: str) -> list[Any]:
    """The leaves of ``tree`` (a state field), which must have the updates' structure.

    ``optax.adam`` pairs updates and state with ``jax.tree.map``, which raises
    on a structure mismatch; so does this. Flattening each tree on its own would
    pair leaves by position: gradients ``[x, y]`` for a state of ``{"a": x,
    "b": y}`` would be accepted, and leaves in another order would be given
    another parameter's moments.
    """
    try:
        return treedef.flatten_up_to(tree)  # type: ignore[no-any-return]
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"pytree structure error: the updates do not have the structure of the "
            f"optimizer state's {what} (the parameters it was initialised for): {error}"
        ) from error


# |x|**2 of JAX's real and complex arrays
abs_sq = functools.partial(rules.abs_square, conj=jnp.conj, real=jnp.real)


def hyperparameter_in(x: Any, dtype: Any) -> Any:
    # Python scalars stay weakly typed (no rounding of hyperparameters to a
    # low-precision dtype before 1 - beta is formed). Arrays -- traced
    # hyperparameters under inject_hyperparams -- follow the leaf's dtype, but
    # never below float32: in bfloat16, b2 = 0.999 is 1.0 and 1 - b2 is 0 (the
    # second moment would stay 0); the arithmetic then runs in float32 and the
    # results are cast back to the leaf's and the state's dtypes.
    return x.astype(jnp.promote_types(dtype, jnp.float32)) if isinstance(x, jax.Array) else x


def real_dtype(dtype: Any) -> Any:
    """The real dtype of ``dtype``: itself if real, float32 for complex64 (``finfo``'s dtype)."""
    return jnp.finfo(dtype).dtype  # type: ignore[no-untyped-call]


def narrow_working_dtype(grad_dtype: Any) -> Any:
    """The dtype a narrow (bfloat16 or 8-bit) state steps in: float32, or the
    gradient's real dtype where wider. Not the gradient's alone: bfloat16
    gradients of float32 parameters (after a bfloat16 all-reduce) would step
    the state in bfloat16, where beta * state rounds back to the state and the
    averages never decay; torch steps an 8-bit state of 16-bit parameters in
    float32 too."""
    return jnp.promote_types(real_dtype(grad_dtype), jnp.float32)


def canonical_dtype(dtype: Any) -> Any:
    return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


def inexact_dtype(dtype: Any, name: str) -> Any:
    """``dtype`` (``accumulator_dtype``, ``mu_dtype``, ``ns_dtype``) canonical,
    None kept, refused unless floating-point or complex: an integer state
    would be truncated at every step (the 8-bit state is ``state_dtype``'s)."""
    dtype = canonical_dtype(dtype)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
        hint = "" if name == "ns_dtype" else " (an 8-bit state is state_dtype=jnp.uint8)"
        raise ValueError(
            f"{name} must be None or a floating-point dtype; received "
            f"{name}={jnp.dtype(dtype).name}{hint}"
        )
    return dtype


def bias_correction(beta: float | jax.Array, count: jax.Array) -> jax.Array:
    """``1 - beta**count`` under :func:`qhoptim.rules.bias_correction`'s float32 policy.

    With ``jax_enable_x64`` and a float64 (or Python) ``beta`` the correction is
    computed in float64 as ``1 - beta**count``, as the float64 reference does.
    Otherwise -- the default float32 JAX, or a lower-precision array ``beta`` --
    it is ``-expm1(count * log(beta))``, which keeps float32's relative
    precision near ``beta = 1`` where ``1 - beta**count`` cancels. ``log`` of a
    concrete ``beta`` is taken in float64 (:func:`math.log`); a traced one
    (``optax.inject_hyperparams``) uses :func:`jax.numpy.log`.
    """
    beta_value = validation.concrete_float(beta)
    x64 = jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64
    if x64 and (beta_value is not None or jnp.result_type(beta) == jnp.float64):
        # A float exponent: XLA raises to an integer power by repeated squaring,
        # tens of ulps off Python's ``beta ** step`` after a thousand steps.
        t = count.astype(jnp.float64)
        return jnp.asarray(rules.bias_correction(beta if beta_value is None else beta_value, t))
    if beta_value is None:
        return jnp.asarray(rules.bias_correction(beta, count, expm1=jnp.expm1, log=jnp.log))
    return jnp.asarray(rules.bias_correction(beta_value, count, expm1=jnp.expm1))


def real_hyperparameters(factory: Factory) -> Factory:
    """``factory`` taking a complex array hyperparameter as its real part.

    ``optax.inject_hyperparams`` casts the hyperparameters to the parameters'
    dtype, complex64 for complex parameters (``optax.adam`` takes them so): a
    traced one's real part is taken, as is a concrete one's whose imaginary
    part is 0; any other is passed on, for the checks to refuse. It casts
    them to bfloat16 for bfloat16 parameters, where ``b2 = 0.999`` is 1.0: the
    check's error then says so.
    """

    def real(x: Any) -> Any:
        if not (isinstance(x, jax.Array) and jnp.iscomplexobj(x)):
            return x
        try:
            imaginary = np.asarray(jnp.imag(x))
        except jax.errors.TracerArrayConversionError:
            return jnp.real(x)
        return x if imaginary.any() else jnp.real(x)

    def narrow(x: Any) -> bool:
        return isinstance(x, jax.Array) and x.dtype in (jnp.bfloat16, jnp.float16)

    @functools.wraps(factory)
    def made(*args: Any, **kwargs: Any) -> Any:
        try:
            return factory(*map(real, args), **{k: real(v) for k, v in kwargs.items()})
        except ValueError as error:
            said = "inject_hyperparams" in str(error)  # by a factory this one calls
            if not said and any(map(narrow, (*args, *kwargs.values()))):
                # b2 = 0.999 is 1.0 in bfloat16: the user gave none of it.
                raise ValueError(
                    f"{error} (a hyperparameter in {_narrow_names(args, kwargs)}: "
                    "optax.inject_hyperparams casts them to the parameters' dtype; "
                    "give it hyperparam_dtype=jnp.float32)"
                ) from error
            raise

    return cast(Factory, made)


def _narrow_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    dtypes = {str(x.dtype) for x in (*args, *kwargs.values()) if isinstance(x, jax.Array)}
    return " or ".join(sorted(d for d in dtypes if d in ("bfloat16", "float16")))


def check_learning_rate(learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
    """The checked learning rate; a concrete scalar (a one-element array) as a float."""
    if callable(learning_rate):
        return learning_rate
    validation.check_lr(learning_rate, "learning_rate")
    return validation.as_float(learning_rate)
