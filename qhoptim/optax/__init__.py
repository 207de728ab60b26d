r"""QHM, QHAdam and QHMuon as optax gradient transformations.

``scale_by_qhm``, ``scale_by_qhadam`` and ``scale_by_qhmuon`` are the scalings;
``qhm``, ``qhadam``, ``qhadamw`` and ``qhmuon`` compose them with the learning
rate exactly as ``optax.sgd``, ``optax.adam``, ``optax.adamw`` and
``optax.contrib.muon`` do, so they chain, inject and checkpoint like any optax
optimizer; ``from_params`` builds one from a :mod:`qhoptim.convert` result::

    import optax
    import qhoptim.optax as qho
    from qhoptim import convert

    tx = optax.chain(optax.clip_by_global_norm(1.0), qho.qhadam(1e-3, nu1=0.7))
    tx = qho.from_params(convert.from_nesterov(lr=0.01, momentum=0.9))  # sgd(nesterov=True)

The math of every step comes from :mod:`qhoptim.rules`; this module only maps it
over pytrees, keeps optax's state and dtype conventions, and lets XLA fuse it
-- but for a bfloat16 or 8-bit state's moving averages on the CPU, which one
C++ custom call per step steps and stores (``fused``;
:mod:`qhoptim.optax._extension`).

References:
  Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
  <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

try:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
except ImportError as error:  # pragma: no cover - exercised where JAX or optax is absent
    raise ImportError(
        f"qhoptim.optax needs JAX and optax ({error.name} is not installed). "
        'Install them with `pip install "qhoptim[jax]"`.'
    ) from error

from qhoptim import convert, rounding, rules, validation
from qhoptim.optax import _extension

__all__ = [
    "EightBitArray",
    "ScaleByQHAdamAmsgradState",
    "ScaleByQHAdamState",
    "ScaleByQHMCountState",
    "ScaleByQHMState",
    "ScaleByQHMuonState",
    "decoded_state",
    "from_params",
    "qhadam",
    "qhadamw",
    "qhm",
    "qhmuon",
    "scale_by_qhadam",
    "scale_by_qhm",
    "scale_by_qhmuon",
]

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


class ScaleByQHMState(NamedTuple):
    """State of :func:`scale_by_qhm`: the normalized momentum buffer ``g``."""

    momentum_buffer: optax.Updates


class ScaleByQHMCountState(NamedTuple):
    """State of :func:`scale_by_qhm` with a ``state_dtype``: the buffer, and the
    number of updates taken, which seeds the buffer's stochastic rounding."""

    count: jax.Array  # type: ignore[assignment]  # shape=(), int32
    momentum_buffer: optax.Updates


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


class ScaleByQHMuonState(NamedTuple):
    """State of :func:`scale_by_qhmuon`: the update count (for the bias
    corrections) and the normalized momentum buffer, as ``optax.contrib``'s
    ``MuonState`` keeps them (``count``, ``mu``)."""

    count: jax.Array  # type: ignore[assignment]
    momentum_buffer: optax.Updates


def _is_none(x: Any) -> bool:
    return x is None


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    # ``None`` leaves (frozen / absent params) are kept as leaves and skipped.
    return jax.tree.flatten(tree, is_leaf=_is_none)


def _leaves_like(treedef: Any, tree: Any, what: str) -> list[Any]:
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
_abs_sq = functools.partial(rules.abs_square, conj=jnp.conj, real=jnp.real)


def _cast(x: Any, dtype: Any) -> Any:
    # Python scalars stay weakly typed (no rounding of hyperparameters to a
    # low-precision dtype before 1 - beta is formed). Arrays -- traced
    # hyperparameters under inject_hyperparams -- follow the leaf's dtype, but
    # never below float32: in bfloat16, b2 = 0.999 is 1.0 and 1 - b2 is 0 (the
    # second moment would stay 0); the arithmetic then runs in float32 and the
    # results are cast back to the leaf's and the state's dtypes.
    return x.astype(jnp.promote_types(dtype, jnp.float32)) if isinstance(x, jax.Array) else x


def _real_dtype(dtype: Any) -> Any:
    """The real dtype of ``dtype``: itself if real, float32 for complex64 (``finfo``'s dtype)."""
    return jnp.finfo(dtype).dtype  # type: ignore[no-untyped-call]


def _canonical_dtype(dtype: Any) -> Any:
    return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


def _inexact_dtype(dtype: Any, name: str) -> Any:
    """``dtype`` (``accumulator_dtype``, ``mu_dtype``, ``ns_dtype``) canonical,
    None kept, refused unless floating-point or complex: an integer state
    would be truncated at every step (the 8-bit state is ``state_dtype``'s)."""
    dtype = _canonical_dtype(dtype)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
        hint = "" if name == "ns_dtype" else " (an 8-bit state is state_dtype=jnp.uint8)"
        raise ValueError(
            f"{name} must be None or a floating-point dtype; received "
            f"{name}={jnp.dtype(dtype).name}{hint}"
        )
    return dtype


def _bias_correction(beta: float | jax.Array, count: jax.Array) -> jax.Array:
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


# ------------------------------------------------------------- narrow state
# JAX's uint32 arrays wrap; a Python int above 2**31 - 1 beside one is refused.
_BITS = rounding.Bits(const=lambda c: jnp.asarray(c, jnp.uint32))


@jax.tree_util.register_pytree_node_class
class EightBitArray:
    """An array's state stored in 8 bits (``state_dtype=jnp.uint8``): a pytree
    of ``codes`` (uint8, the array's shape: one byte per value) and ``scales``
    (float32, one per block of 256 values in row-major order: the block's
    largest finite magnitude).

    A value is its block's scale times the level of
    :func:`qhoptim.rounding.eight_bit_levels` its code names (bit 7 its sign,
    for a ``signed`` state: QHM's buffer, QHAdam's first moment; the second
    moment is unsigned); :func:`decoded_state` reads it as float32. The codes
    are torch's ``state_dtype=torch.uint8`` codes for the same values and
    noise (one rule, :func:`qhoptim.rounding.eight_bit_encode_reference`).
    ``signed`` is static (the pytree's auxiliary data), so a checkpoint
    restores into an ``init``'s structure as any optax state does.
    """

    def __init__(self, codes: jax.Array, scales: jax.Array, signed: bool) -> None:
        self.codes = codes
        self.scales = scales
        self.signed = signed

    def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array], bool]:
        return (self.codes, self.scales), self.signed

    @classmethod
    def tree_unflatten(cls, signed: bool, children: Any) -> EightBitArray:
        codes, scales = children
        return cls(codes, scales, signed)

    def __repr__(self) -> str:
        return f"EightBitArray(codes={self.codes!r}, scales={self.scales!r}, signed={self.signed})"

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the array this state is of."""
        return tuple(self.codes.shape)


_flax_knows_eight_bit = False


def _tell_flax_of_eight_bit() -> None:
    """Register :class:`EightBitArray` with ``flax.serialization`` (a state dict
    of its codes and scales; ``signed`` comes from the target, as a pytree's
    auxiliary data does), where flax is imported: ``to_bytes`` of an 8-bit
    state, as of any optax state. Called on import and by every 8-bit
    ``init``, so that flax is never imported here."""
    global _flax_knows_eight_bit
    serialization = sys.modules.get("flax.serialization")
    if _flax_knows_eight_bit or serialization is None:
        return

    def to_state_dict(x: EightBitArray) -> dict[str, Any]:
        return {"codes": x.codes, "scales": x.scales}

    def from_state_dict(target: EightBitArray, state: dict[str, Any]) -> EightBitArray:
        return EightBitArray(
            jnp.asarray(state["codes"]), jnp.asarray(state["scales"]), target.signed
        )

    serialization.register_serialization_state(EightBitArray, to_state_dict, from_state_dict)
    _flax_knows_eight_bit = True


_tell_flax_of_eight_bit()


def _state_dtype(state_dtype: Any, stochastic_rounding: Any, **others: Any) -> Any:
    """The checked ``state_dtype`` (canonical), alone among the dtype arguments ``others``."""
    rounding.check_stochastic_rounding(stochastic_rounding)
    if state_dtype is None:
        return None
    try:
        name: str | None = jnp.dtype(state_dtype).name
    except TypeError:
        name = None
    allowed = (*rounding.STATE_DTYPES, rounding.EIGHT_BIT)
    rounding.check_state_dtype(name, state_dtype, allowed=allowed)
    for other, value in others.items():
        if value is not None:
            raise ValueError(
                f"state_dtype and {other} both set the state's dtype; give one "
                f"(received state_dtype={state_dtype!r}, {other}={value!r})"
            )
    return _canonical_dtype(state_dtype)


def _check_narrow_params(params: optax.Params, state_dtype: Any) -> None:
    """Refuse parameters a narrow state cannot follow: complex or narrower than it."""
    for p in jax.tree.leaves(params):
        dtype = jnp.dtype(p.dtype)
        rounding.check_real(jnp.issubdtype(dtype, jnp.complexfloating))
        state = jnp.dtype(state_dtype)
        rounding.check_narrower(state.name, state.itemsize, dtype.name, dtype.itemsize)


def _zeros_state(params: optax.Params, state_dtype: Any, signed: bool) -> Any:
    """A fresh state of each of ``params`` stored in ``state_dtype``: zeros,
    or the zero 8-bit state (codes and scales 0); each keeps its parameter's
    sharding (``zeros_like``)."""
    if state_dtype != jnp.uint8:
        return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=state_dtype), params)
    _tell_flax_of_eight_bit()

    def zeros(p: jax.Array) -> EightBitArray:
        blocks = -(-p.size // rounding.EIGHT_BIT_BLOCK)
        scales = jnp.zeros((blocks,), jnp.float32)
        return EightBitArray(jnp.zeros_like(p, dtype=jnp.uint8), scales, signed)

    return jax.tree.map(zeros, params)


def _rounding_seed(count: jax.Array, index: int) -> jax.Array:
    """The rounding seed (:func:`qhoptim.rounding.rounding_seed`) of state ``index``
    after update ``count`` (traced under ``jit``)."""
    return rounding.rounding_seed(count.astype(jnp.uint32), jnp.uint32(index), _BITS)  # type: ignore[no-any-return]


def _noise16(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
    """The noise of each element of an array of ``shape`` (its row-major position).

    The position is summed from one iota per dimension times its stride, which
    XLA computes inside the loop from the element's index; an iota reshaped
    to ``shape`` would cost a division and a remainder per element and
    dimension, and flattening the array would regroup a sharded one.
    """
    position = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = jax.lax.broadcasted_iota(jnp.uint32, shape, dim)
        position = position + index * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[dim]
    return rounding.noise16(position, seed, _BITS)  # type: ignore[no-any-return]


@functools.cache
def _levels(signed: bool) -> np.ndarray:
    # NumPy, not JAX: a module-level JAX array would be made on import.
    return np.asarray(rounding.eight_bit_levels(signed), np.float32)


def _as_float32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _blocked(x: jax.Array) -> jax.Array:
    """``x`` flattened, padded with zeros to whole blocks, one row per block."""
    flat = x.reshape(-1)
    blocks = -(-flat.size // rounding.EIGHT_BIT_BLOCK)
    padded = jnp.pad(flat, (0, blocks * rounding.EIGHT_BIT_BLOCK - flat.size))
    rows: jax.Array = padded.reshape(blocks, rounding.EIGHT_BIT_BLOCK)
    return rows


def _explicit_axes(x: jax.Array) -> tuple[Any, Any] | None:
    """The (abstract) mesh and partition spec of ``x`` where it is split over
    a mesh's *explicit* axes (``jax.make_mesh``'s default in newer JAX), whose
    sharding every operation must type; None otherwise."""
    typeof = getattr(jax, "typeof", None)
    axis_type = getattr(jax.sharding, "AxisType", None)
    if typeof is None or axis_type is None or not hasattr(jax.sharding, "auto_axes"):
        return None  # a JAX without explicit axes
    sharding = getattr(typeof(x), "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or all(axes is None for axes in spec):
        return None
    if axis_type.Explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    return mesh, spec


def _block_spec(mesh: Any, spec: Any, shape: tuple[int, ...]) -> Any:
    """How an 8-bit state's block scales are split, for a value of ``shape``
    split by ``spec``: as the value's first axis where each of its parts is
    whole blocks of the flattened value; otherwise on every device."""
    P: Any = jax.sharding.PartitionSpec
    first = spec[0] if len(spec) else None
    if first is None or any(axes is not None for axes in spec[1:]):
        return P()
    parts = math.prod(mesh.shape[a] for a in ((first,) if isinstance(first, str) else first))
    size = math.prod(shape)
    return P(first) if size % (parts * rounding.EIGHT_BIT_BLOCK) == 0 else P()


def _on_auto_axes(f: Callable[..., Any], out_specs: Callable[..., Any], *arrays: jax.Array) -> Any:
    """``f(*arrays)``; where the first is split over explicit mesh axes, with
    the mesh's axes automatic inside ``f`` (its results split by
    ``out_specs(mesh, spec)``, the first array's): an 8-bit state's blocks
    run across the parts of a split array, and a flattened array's reshape
    into blocks has no sharding of its own there. ``f`` takes every array it
    reads as an argument."""
    explicit = _explicit_axes(arrays[0])
    if explicit is None:
        return f(*arrays)
    mesh, spec = explicit
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(f, out_sharding=out_specs(mesh, spec))(*arrays)


def _decode(stored: EightBitArray) -> jax.Array:
    """:func:`_decode_here` of ``stored``, on a mesh of explicit axes too."""

    def decode(codes: jax.Array, scales: jax.Array) -> jax.Array:
        return _decode_here(EightBitArray(codes, scales, stored.signed))

    def out_spec(mesh: Any, spec: Any) -> Any:
        return spec

    return _on_auto_axes(decode, out_spec, stored.codes, stored.scales)  # type: ignore[no-any-return]


def _encode(value: jax.Array, signed: bool, seed: jax.Array, stochastic: bool) -> EightBitArray:
    """:func:`_encode_here` of ``value``, on a mesh of explicit axes too."""

    def encode(value: jax.Array, seed: jax.Array) -> tuple[jax.Array, jax.Array]:
        stored = _encode_here(value, signed, seed, stochastic)
        return stored.codes, stored.scales

    def out_specs(mesh: Any, spec: Any) -> tuple[Any, Any]:
        return spec, _block_spec(mesh, spec, value.shape)

    codes, scales = _on_auto_axes(encode, out_specs, value, seed)
    return EightBitArray(codes, scales, signed)


def _decode_here(stored: EightBitArray) -> jax.Array:
    """The float32 values an 8-bit state stands for
    (:func:`qhoptim.rounding.eight_bit_decode_reference`). Each level is made
    from its code's bits (:func:`qhoptim.rounding.eight_bit_level_bits`), not
    read from a table: XLA fuses that arithmetic into the step, and a gather
    of a replicated table by a sharded index fails on a mesh of explicit axes."""
    codes = stored.codes.astype(jnp.int32)

    def level_of(k: jax.Array) -> jax.Array:
        level = _as_float32(rounding.eight_bit_level_bits(k, stored.signed))
        return jnp.where(k == 0, jnp.float32(0), level)

    def scaled(magnitude: jax.Array) -> jax.Array:
        rows = _blocked(magnitude) * stored.scales[:, None]
        value: jax.Array = rows.reshape(-1)[: codes.size].reshape(codes.shape)
        return value

    value: jax.Array = rounding.eight_bit_value(codes, level_of, stored.signed, scaled, jnp.where)
    return value


def _encode_here(
    value: jax.Array, signed: bool, seed: jax.Array, stochastic: bool
) -> EightBitArray:
    """``value`` in 8 bits (:func:`qhoptim.rounding.eight_bit_encode_reference`):
    each block's scale its largest finite magnitude, each value one of the two
    levels around it, chosen by the noise of ``seed`` (or to nearest); NaN and
    infinities take the non-finite code and leave their block alone."""
    x = value.astype(jnp.float32).reshape(-1)  # flat: blocks of 256 in row-major order
    finite = jnp.isfinite(x)
    # Subnormals read as 0 (XLA flushes them; the rule does so everywhere).
    smallest = rounding.EIGHT_BIT_SMALLEST
    magnitudes = jnp.where(finite & (jnp.abs(x) >= smallest), jnp.abs(x), 0.0)
    # The stored state has no derivative (a bfloat16 one goes through a bit
    # cast; the C++ step takes constants): neither have the blocks' scales.
    scales = jax.lax.stop_gradient(_blocked(magnitudes).max(axis=1))
    # Once per block: ratios are products; above EIGHT_BIT_LARGEST_PLAIN_SCALE
    # with the reciprocal of a quarter of the scale, which XLA would otherwise
    # flush to 0 (a subnormal), then times 1/4.
    large = scales > rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE
    inverse = (jnp.where(large, jnp.float32(4), jnp.float32(1)) / scales)[:, None]
    after = jnp.where(large, jnp.float32(0.25), jnp.float32(1))[:, None]
    ratio = (_blocked(magnitudes) * inverse * after).reshape(-1)[: x.size]
    ratio = jnp.where(jnp.isnan(ratio) | (ratio < smallest), 0.0, ratio)  # 0 * inf: all zeros
    # The levels around each ratio from its bits, with no table (see _decode).
    low, below, above = rounding.eight_bit_levels_around(
        jax.lax.bitcast_convert_type(ratio, jnp.int32), signed, jnp.where
    )
    if stochastic:
        threshold = _noise16(x.shape, seed).astype(jnp.float32) * 2.0**-16
    else:
        threshold = jnp.float32(0.5)
    code = rounding.eight_bit_code(
        x, finite, ratio, low, _as_float32(below), _as_float32(above), threshold, signed, jnp.where
    )
    return EightBitArray(code.astype(jnp.uint8).reshape(value.shape), scales, signed)


def _load(stored: jax.Array | EightBitArray, dtype: Any) -> jax.Array:
    """A stored state in ``dtype``, to step in: decoded, or cast."""
    if isinstance(stored, EightBitArray):
        return _decode(stored).astype(dtype)
    return stored.astype(dtype)


def _store(
    value: jax.Array, like: jax.Array | EightBitArray, seed: jax.Array, stochastic: bool
) -> jax.Array | EightBitArray:
    """``value`` (a step's new state) stored as ``like`` is: in 8 bits
    (:func:`_encode`), to bfloat16 rounded stochastically with ``seed``
    (:mod:`qhoptim.rounding`), otherwise cast to ``like``'s dtype.

    The noise of each element is the hash of its flat position, so XLA makes it
    inside the update's fused loop, never as an array of its own.
    """
    if isinstance(like, EightBitArray):
        return _encode(value, like.signed, seed, stochastic)
    dtype = like.dtype
    if not (stochastic and dtype == jnp.bfloat16 and value.dtype != jnp.bfloat16):
        return value.astype(dtype)
    x = value.astype(jnp.float32)
    top = rounding.bfloat16_bits(
        jax.lax.bitcast_convert_type(x, jnp.uint32), _noise16(x.shape, seed), _BITS
    )
    return jax.lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def decoded_state(state: Any) -> Any:
    """``state`` with each 8-bit array (:class:`EightBitArray`, ``state_dtype=jnp.uint8``)
    read as the float32 array it stands for; every other leaf as it is.

    For logging, debugging, or a checkpoint to carry on in another ``state_dtype``
    (put the decoded arrays in that optimizer's ``init`` structure). Reading
    changes nothing: the state steps on as before.

    Example:
      >>> import jax.numpy as jnp
      >>> import qhoptim.optax as qho
      >>> tx = qho.qhadam(1e-3, nu1=0.7, state_dtype=jnp.uint8)
      >>> params = {"w": jnp.ones((2, 3))}
      >>> _, state = tx.update({"w": jnp.full((2, 3), 0.5)}, tx.init(params), params)
      >>> mu = qho.decoded_state(state)[0].mu["w"]  # (1 - b1) * 0.5, to 8 bits
      >>> print(mu.dtype, mu.shape, bool(abs(mu[0, 0] - 0.05) < 0.005))
      float32 (2, 3) True
    """

    def read(x: Any) -> Any:
        return _decode(x) if isinstance(x, EightBitArray) else x

    return jax.tree.map(read, state, is_leaf=lambda x: isinstance(x, EightBitArray))


# ------------------------------------------------------ the C++ state step
def _check_fused(fused: Any, state_dtype: Any, stochastic: bool) -> None:
    if fused is not None:
        validation.check_bool(fused, "fused")
    if fused and _fused_target_of(state_dtype, stochastic) is None:
        raise ValueError(
            "fused=True stores a bfloat16 state rounded stochastically, or an 8-bit "
            "state, in C++ (state_dtype=jnp.bfloat16 with stochastic_rounding None or "
            "True, or state_dtype=jnp.uint8); received "
            f"state_dtype={None if state_dtype is None else jnp.dtype(state_dtype).name!r}, "
            f"stochastic_rounding={stochastic}"
        )


def _fused_target_of(state_dtype: Any, stochastic: bool) -> str | None:
    """The custom call that stores a state of ``state_dtype``, if one does."""
    if state_dtype == jnp.uint8:
        return _extension.EIGHT_BIT_TARGET
    if state_dtype == jnp.bfloat16 and stochastic:
        return _extension.TARGET
    return None


def _state_target(fused: bool | None, state_dtype: Any, stochastic: bool) -> str | None:
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


class _Pending(NamedTuple):
    """A parameter whose narrow states the C++ step stores: its gradient,
    stored states and their seeds, and the same states stored by XLA's
    operations (``in_xla()``, the path off the CPU)."""

    grad: jax.Array
    stored: list[Any]
    seeds: list[jax.Array]
    in_xla: Callable[[], list[Any]]


def _stepped_states(
    target: str, weights: tuple[Any, ...], pending: list[_Pending], stochastic: bool
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
        constants += [jnp.asarray(_levels(True)), jnp.asarray(_levels(False))]
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


def _check_learning_rate(learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
    """The checked learning rate; a concrete scalar (a one-element array) as a float."""
    if callable(learning_rate):
        return learning_rate
    validation.check_lr(learning_rate, "learning_rate")
    return validation.as_float(learning_rate)


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
    validation.check_beta(momentum, "momentum")
    validation.check_nu(nu, "nu")
    # Concrete scalars (one-element NumPy or JAX arrays) as the floats they hold;
    # traced values (jit, inject_hyperparams) stay arrays.
    momentum, nu = validation.as_float(momentum), validation.as_float(nu)
    accumulator_dtype = _inexact_dtype(accumulator_dtype, "accumulator_dtype")
    state_dtype = _state_dtype(
        state_dtype, stochastic_rounding, accumulator_dtype=accumulator_dtype
    )
    stochastic = rounding.stochastic(
        None if state_dtype is None else jnp.dtype(state_dtype).name, stochastic_rounding
    )
    _check_fused(fused, state_dtype, stochastic)

    def _stored(value: jax.Array, like: Any, seed: jax.Array) -> list[Any]:
        return [_store(value, like, seed, stochastic)]

    def init_fn(params: optax.Params) -> ScaleByQHMState | ScaleByQHMCountState:
        if state_dtype is None:
            return ScaleByQHMState(optax.tree.zeros_like(params, dtype=accumulator_dtype))
        _check_narrow_params(params, state_dtype)
        buffers = _zeros_state(params, state_dtype, signed=True)
        return ScaleByQHMCountState(count=jnp.zeros([], jnp.int32), momentum_buffer=buffers)

    def update_fn(
        updates: optax.Updates,
        state: ScaleByQHMState | ScaleByQHMCountState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ScaleByQHMState | ScaleByQHMCountState]:
        del params
        grads, treedef = _flatten(updates)
        buffers = _leaves_like(treedef, state.momentum_buffer, "momentum_buffer")
        count = None
        if state_dtype is not None:
            if not isinstance(state, ScaleByQHMCountState):
                raise TypeError(
                    "scale_by_qhm(state_dtype=...) needs its own state, ScaleByQHMCountState "
                    f"(from its init); received {type(state).__name__}"
                )
            count = optax.safe_increment(state.count)
        target = _state_target(fused, state_dtype, stochastic)
        pending: list[_Pending] = []  # the parameters the C++ step stores
        slots: list[int] = []  # their positions
        new_updates: list[Any] = []
        new_buffers: list[Any] = []
        for position, (g, buf) in enumerate(zip(grads, buffers, strict=True)):
            if g is None:
                new_updates.append(None)
                new_buffers.append(buf)
                continue
            # A narrow buffer steps in the gradient's dtype, then is stored narrow.
            dtype = buf.dtype if state_dtype is None else _real_dtype(g.dtype)
            b, direction = rules.qhm_update(
                g, _load(buf, dtype), momentum=_cast(momentum, dtype), nu=_cast(nu, dtype)
            )
            new_updates.append(direction.astype(g.dtype))
            if count is None:
                new_buffers.append(b.astype(dtype))
            else:
                seed = _rounding_seed(count, rounding.state_index(position))
                if target is None or g.dtype != jnp.float32:
                    new_buffers.append(_store(b, buf, seed, stochastic))
                    continue
                slots.append(len(new_buffers))
                new_buffers.append(None)
                pending.append(_Pending(g, [buf], [seed], functools.partial(_stored, b, buf, seed)))
        if pending and target is not None:
            c = rules.qhm_coefficients(_cast(momentum, jnp.float32), _cast(nu, jnp.float32))
            weights = (c.buffer_decay, c.grad_to_buffer, 0.0, 0.0)
            for slot, (stepped,) in zip(
                slots, _stepped_states(target, weights, pending, stochastic), strict=True
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
    mu_dtype = _inexact_dtype(mu_dtype, "mu_dtype")
    state_dtype = _state_dtype(state_dtype, stochastic_rounding, mu_dtype=mu_dtype)
    state_name = None if state_dtype is None else jnp.dtype(state_dtype).name
    rounding.check_second_moment_dtype(state_name)
    stochastic = rounding.stochastic(state_name, stochastic_rounding)
    _check_fused(fused, state_dtype, stochastic)

    def init_fn(params: optax.Params) -> ScaleByQHAdamState | ScaleByQHAdamAmsgradState:
        count = jnp.zeros([], jnp.int32)
        if state_dtype is not None:
            _check_narrow_params(params, state_dtype)
            exp_avg = _zeros_state(params, state_dtype, signed=True)
            exp_avg_sq = _zeros_state(params, state_dtype, signed=False)
        else:
            exp_avg = optax.tree.zeros_like(params, dtype=mu_dtype)
            # zeros_like, not zeros: the moment keeps the parameter's sharding (a
            # sharded model's moments would otherwise all land on one device).
            exp_avg_sq = jax.tree.map(
                lambda p: jnp.zeros_like(p, dtype=_real_dtype(p.dtype)), params
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
        bc1, bc2 = _bias_correction(b1, count), _bias_correction(b2, count)
        grads, treedef = _flatten(updates)
        exp_avgs = _leaves_like(treedef, state.mu, "mu")
        exp_avg_sqs = _leaves_like(treedef, state.nu, "nu")
        if amsgrad:
            if not isinstance(state, ScaleByQHAdamAmsgradState):
                raise TypeError(
                    "scale_by_qhadam(amsgrad=True) needs its own state, "
                    f"ScaleByQHAdamAmsgradState (from its init); received {type(state).__name__}"
                )
            maxes = _leaves_like(treedef, state.nu_max, "nu_max")
        else:
            maxes = [None] * len(grads)
        target = _state_target(fused, state_dtype, stochastic)
        pending: list[_Pending] = []  # the parameters the C++ step stores
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
            # The parameters' real dtype; a narrow state steps in the gradient's.
            dtype = exp_avg_sq.dtype if state_dtype is None else _real_dtype(g.dtype)
            stored = (exp_avg, exp_avg_sq, max_sq)
            if state_dtype is not None:
                exp_avg, exp_avg_sq = _load(exp_avg, dtype), _load(exp_avg_sq, dtype)
                max_sq = None if max_sq is None else _load(max_sq, dtype)
            hparams = {
                "beta1": _cast(b1, dtype),
                "beta2": _cast(b2, dtype),
                "nu1": _cast(nu1, dtype),
                "nu2": _cast(nu2, dtype),
                "eps": _cast(eps, dtype),
                "bias_correction1": bc1.astype(dtype),
                "bias_correction2": bc2.astype(dtype),
                "sqrt": jnp.sqrt,
                "square": _abs_sq,
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
                _rounding_seed(count, rounding.state_index(position, k))
                for k in range(3 if amsgrad else 2)
            ]
            nexts = [next_exp_avg, next_exp_avg_sq, *([next_max] if amsgrad else [])]

            def in_xla(
                nexts: list[Any] = nexts, stored: Any = stored, seeds: Any = seeds
            ) -> list[Any]:
                return [
                    _store(x, like, seed, stochastic)
                    for x, like, seed in zip(nexts, stored[: len(nexts)], seeds, strict=True)
                ]

            if target is None or g.dtype != jnp.float32:
                stepped: list[Any] = in_xla()
            else:
                slots.append(len(new_exp_avgs))
                pending.append(_Pending(g, [x for x in stored if x is not None], seeds, in_xla))
                stepped = [None] * 3
            new_exp_avgs.append(stepped[0])
            new_exp_avg_sqs.append(stepped[1])
            if amsgrad:
                new_maxes.append(stepped[2])
        if pending and target is not None:
            weights = tuple(
                rules.qhadam_moment_weights(_cast(b1, jnp.float32), _cast(b2, jnp.float32))
            )
            stepped_states = _stepped_states(target, weights, pending, stochastic)
            for slot, states in zip(slots, stepped_states, strict=True):
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
    learning_rate = _check_learning_rate(learning_rate)
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
    learning_rate = _check_learning_rate(learning_rate)
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
    learning_rate = _check_learning_rate(learning_rate)
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


# ------------------------------------------------------------------- QHMuon
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
    mu_dtype, ns_dtype = _inexact_dtype(mu_dtype, "mu_dtype"), _inexact_dtype(ns_dtype, "ns_dtype")
    state_dtype = _state_dtype(state_dtype, stochastic_rounding, mu_dtype=mu_dtype)
    stochastic = rounding.stochastic(
        None if state_dtype is None else jnp.dtype(state_dtype).name, stochastic_rounding
    )
    a, b, c = (float(x) for x in ns_coeffs)
    coefficients = (a, b, c)

    def init_fn(params: optax.Params) -> ScaleByQHMuonState:
        _check_muon_matrices(params)
        if state_dtype is not None:
            _check_narrow_params(params, state_dtype)
            buffers = _zeros_state(params, state_dtype, signed=True)
        else:
            buffers = optax.tree.zeros_like(params, dtype=mu_dtype)
        return ScaleByQHMuonState(count=jnp.zeros([], jnp.int32), momentum_buffer=buffers)

    def update_fn(
        updates: optax.Updates, state: ScaleByQHMuonState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleByQHMuonState]:
        del params
        grads, treedef = _flatten(updates)
        buffers = _leaves_like(treedef, state.momentum_buffer, "momentum_buffer")
        count = optax.safe_increment(state.count)
        grad_correction = _bias_correction(beta, count)
        buffer_correction = rules.qhmuon_buffer_correction(nu, grad_correction, minimum=jnp.minimum)
        new_updates: list[Any] = []
        new_buffers: list[Any] = []
        for position, (g, buf) in enumerate(zip(grads, buffers, strict=True)):
            if g is None:
                new_updates.append(None)
                new_buffers.append(buf)
                continue
            # A narrow buffer steps in the gradient's dtype, then is stored narrow.
            b = rules.ewma(buf if state_dtype is None else _load(buf, g.dtype), g, beta)
            direction = rules.qhm_bias_corrected_direction(
                g, b, nu=nu, grad_correction=grad_correction.astype(g.dtype),
                buffer_correction=buffer_correction.astype(b.dtype),
            )  # fmt: skip
            if ns_dtype is not None:
                direction = direction.astype(ns_dtype)
            rows, columns = direction.shape
            orthogonal = rules.newton_schulz(
                direction, rows=rows, columns=columns, ops=_JAX_MATRIX_OPS,
                coefficients=coefficients, steps=ns_steps, eps=eps, norm_guard="add",
            )  # fmt: skip
            new_updates.append(orthogonal.astype(g.dtype))
            if state_dtype is not None:
                seed = _rounding_seed(count, rounding.state_index(position))
                new_buffers.append(_store(b, buf, seed, stochastic))
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
    learning_rate = _check_learning_rate(learning_rate)
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
                    mu_dtype,
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


def from_params(
    params: convert.QHMParams | convert.QHAdamParams | convert.QHMuonParams, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """Build :func:`qhm`, :func:`qhadam` or :func:`qhmuon` from a :mod:`qhoptim.convert` result.

    A :class:`qhoptim.convert.QHMParams` gives :func:`qhm`, a
    :class:`qhoptim.convert.QHAdamParams` gives :func:`qhadam`, a
    :class:`qhoptim.convert.QHMuonParams` (:func:`qhoptim.convert.from_muon`)
    gives :func:`qhmuon`, whose ``learning_rate`` is then a keyword; keyword
    arguments (``accumulator_dtype``, ``mu_dtype``, ``state_dtype``, ...) are passed on. This is
    the optax counterpart of Keras's ``QHM.from_params`` /
    ``QHAdam.from_params``.

    Args:
      params: the hyperparameters, e.g. ``convert.from_nesterov(lr, momentum)``.
      **kwargs: further keyword arguments of :func:`qhm` or :func:`qhadam`.

    Returns:
      The corresponding :class:`optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError: ``params`` is none of ``QHMParams``, ``QHAdamParams``, ``QHMuonParams``.

    Example:
      ``optax.sgd(0.1, momentum=0.9, nesterov=True)`` is QHM with
      ``learning_rate = 0.1 / (1 - 0.9)`` and ``nu = momentum``:

      >>> import jax.numpy as jnp, optax
      >>> import qhoptim.optax as qho
      >>> from qhoptim import convert
      >>> solver = qho.from_params(convert.from_nesterov(lr=0.1, momentum=0.9))
      >>> sgd = optax.sgd(0.1, momentum=0.9, nesterov=True)
      >>> params, grads = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])
      >>> s1, s2 = solver.init(params), sgd.init(params)
      >>> for _ in range(3):
      ...     u1, s1 = solver.update(grads, s1, params)
      ...     u2, s2 = sgd.update(grads, s2, params)
      >>> print(", ".join(f"{x:.3f}" for x in u1), bool(jnp.allclose(u1, u2, rtol=1e-6)))
      -0.172, 0.344 True
    """
    validation.check_conversion(
        "from_params", params, convert.QHMParams, convert.QHAdamParams, convert.QHMuonParams
    )
    if isinstance(params, convert.QHMuonParams):
        return qhmuon(**{"beta": params.momentum, "nu": params.nu, **kwargs})
    if isinstance(params, convert.QHMParams):
        return qhm(learning_rate=params.lr, momentum=params.momentum, nu=params.nu, **kwargs)
    (b1, b2), (nu1, nu2) = params.betas, params.nus
    return qhadam(learning_rate=params.lr, b1=b1, b2=b2, nu1=nu1, nu2=nu2, eps=params.eps, **kwargs)
