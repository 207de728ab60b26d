"""Narrow state (``state_dtype``): bfloat16 rounded by :mod:`qhoptim.rounding`'s
rule, and the 8-bit blockwise state (:class:`EightBitArray`), in XLA's operations."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qhoptim import rounding
from qhoptim.optax._tree import canonical_dtype, leaves_like

# JAX's uint32 arrays wrap; a Python int above 2**31 - 1 beside one is refused.
_BITS = rounding.Bits(const=lambda c: jnp.asarray(c, jnp.uint32), select=jnp.where)


@jax.tree_util.register_pytree_node_class
class EightBitArray:
    """An array's state stored in 8 bits (``state_dtype=jnp.uint8``): a pytree
    of ``codes`` (uint8, the array's shape: one byte per value) and ``scales``
    (float32, one per block of 256 values of its row-major order: the block's
    largest finite magnitude). The scales keep the array's leading axes: where
    its last axes from some axis ``k`` on hold whole blocks (the fewest such),
    they have the shape ``(*shape[:k], blocks of shape[k:])``, else one axis
    of all the blocks; so a split of the array along an axis can split its
    scales too. In row-major order they are the blocks' scales in order.

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
        if not _flax_knows_eight_bit:  # flax imported after init: told at the next update
            _tell_flax_of_eight_bit()
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
    state, as of any optax state. Called on import, by every 8-bit ``init``
    and as an update's state is put together, so that flax is never imported
    here."""
    global _flax_knows_eight_bit
    serialization = sys.modules.get("flax.serialization")
    if _flax_knows_eight_bit or serialization is None:
        return

    def to_state_dict(x: EightBitArray) -> dict[str, Any]:
        return {"codes": x.codes, "scales": x.scales}

    def from_state_dict(target: EightBitArray, state: dict[str, Any]) -> EightBitArray:
        scales = jnp.asarray(state["scales"])
        shape = tuple(getattr(target.scales, "shape", scales.shape))
        if scales.shape != shape and scales.size == math.prod(shape):
            scales = scales.reshape(shape)  # in one axis, as earlier development builds kept them
        return EightBitArray(jnp.asarray(state["codes"]), scales, target.signed)

    serialization.register_serialization_state(EightBitArray, to_state_dict, from_state_dict)
    _flax_knows_eight_bit = True


_tell_flax_of_eight_bit()


def checked_state_dtype(state_dtype: Any, stochastic_rounding: Any, **others: Any) -> Any:
    """The checked ``state_dtype`` (canonical), alone among the dtype arguments ``others``."""
    allowed = (*rounding.STATE_DTYPES, rounding.EIGHT_BIT)
    if state_dtype is None:
        rounding.check_stochastic_rounding(stochastic_rounding, None, allowed=allowed)
        return None
    if isinstance(state_dtype, jax.Array):
        # jnp.bfloat16 is callable: optax.inject_hyperparams calls it as a schedule.
        raise TypeError(
            "state_dtype must be a dtype, not an array; under optax.inject_hyperparams "
            "give static_args=('state_dtype',) (it calls a dtype as a schedule); "
            f"received state_dtype={state_dtype!r}"
        )
    try:
        name: str | None = jnp.dtype(state_dtype).name
    except TypeError:
        name = None
    rounding.check_state_dtype(name, state_dtype, allowed=allowed)
    rounding.check_stochastic_rounding(stochastic_rounding, name, allowed=allowed)
    for other, value in others.items():
        if value is not None:
            raise ValueError(
                f"state_dtype and {other} both set the state's dtype; give one "
                f"(received state_dtype={state_dtype!r}, {other}={value!r})"
            )
    return canonical_dtype(state_dtype)


def check_narrow_params(params: optax.Params, state_dtype: Any) -> None:
    """Refuse parameters a narrow state cannot follow: complex or narrower than it."""
    for p in jax.tree.leaves(params):
        dtype = jnp.dtype(p.dtype)
        rounding.check_real(jnp.issubdtype(dtype, jnp.complexfloating))
        state = jnp.dtype(state_dtype)
        rounding.check_narrower(state.name, state.itemsize, dtype.name, dtype.itemsize)


def zeros_state(params: optax.Params, state_dtype: Any, signed: bool) -> Any:
    """A fresh state of each of ``params`` stored in ``state_dtype``: zeros,
    or the zero 8-bit state (codes and scales 0); each keeps its parameter's
    sharding (``zeros_like``), an 8-bit state's scales split as its steps split
    them (:func:`_block_spec`)."""
    if state_dtype != jnp.uint8:
        return jax.tree.map(lambda p: jnp.zeros_like(p, dtype=state_dtype), params)
    _tell_flax_of_eight_bit()

    def zeros(p: jax.Array) -> EightBitArray:
        scales = jnp.zeros(scales_shape(tuple(p.shape)), jnp.float32)
        sharding = _concrete_sharding(p)
        if isinstance(sharding, jax.sharding.NamedSharding):  # split as the steps split them
            spec = _block_spec(sharding.mesh, sharding.spec, tuple(p.shape))
            scales = jax.device_put(scales, jax.sharding.NamedSharding(sharding.mesh, spec))
        return EightBitArray(jnp.zeros_like(p, dtype=jnp.uint8), scales, signed)

    return jax.tree.map(zeros, params)


def _concrete_sharding(x: Any) -> Any:
    """The sharding of a concrete array (None for a traced one: ``init`` under
    ``jit`` leaves the placement to XLA)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return getattr(x, "sharding", None)


def rounding_seed(count: jax.Array, index: int) -> jax.Array:
    """The rounding seed (:func:`qhoptim.rounding.rounding_seed`) of state ``index``
    after update ``count`` (traced under ``jit``)."""
    return rounding.rounding_seed(count.astype(jnp.uint32), jnp.uint32(index), _BITS)  # type: ignore[no-any-return]


def _noise16(shape: tuple[int, ...], seed: jax.Array, high: bool = False) -> jax.Array:
    """The noise of each element of an array of ``shape`` (its row-major
    position; the high halves of the hashes with ``high``).

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
    return rounding.noise16(position, seed, _BITS, high)  # type: ignore[no-any-return]


@functools.cache
def levels(signed: bool) -> np.ndarray:
    # NumPy, not JAX: a module-level JAX array would be made on import.
    return np.asarray(rounding.eight_bit_levels(signed), np.float32)


def _as_float32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _block_axis(shape: tuple[int, ...]) -> int | None:
    """The axis from which the last axes of an array of ``shape`` hold whole
    blocks of 256 values (the last such axis: the fewest axes), or None."""
    size = 1
    for k in reversed(range(len(shape))):
        size *= shape[k]
        if size % rounding.EIGHT_BIT_BLOCK == 0:
            return k
    return None


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scales of an 8-bit state of an array of ``shape``
    (:class:`EightBitArray`): its axes before :func:`_block_axis` and its
    blocks of the axes from there, else its blocks."""
    k = _block_axis(shape)
    if k is None:
        return (-(-math.prod(shape) // rounding.EIGHT_BIT_BLOCK),)
    return (*shape[:k], math.prod(shape[k:]) // rounding.EIGHT_BIT_BLOCK)


def _blocked(x: jax.Array) -> jax.Array:
    """``x`` as rows of whole blocks, each row one block of 256 values of
    its row-major order: of the shape ``(*scales_shape(x.shape), 256)``, the
    array padded with zeros to whole blocks where its last axes hold none.

    The leading axes stay as they are, so that XLA keeps an array split along
    any of them split in the blocks and in what is made of them (the codes
    and the scales): a flattened array's reshape into blocks has no sharding
    of its own, and XLA placed the codes of an array split along a later
    axis on every device."""
    rows = (*scales_shape(tuple(x.shape)), rounding.EIGHT_BIT_BLOCK)
    if math.prod(rows) == x.size:
        return x.reshape(rows)
    flat = x.reshape(-1)
    padded = jnp.pad(flat, (0, math.prod(rows) - flat.size))
    return padded.reshape(rows)


def _unblocked(rows: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Values of :func:`_blocked`'s ``rows`` back in an array of ``shape``."""
    size = math.prod(shape)
    if rows.size == size:
        return rows.reshape(shape)
    return rows.reshape(-1)[:size].reshape(shape)


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
    """How an 8-bit state's scales (:func:`scales_shape`) are split, for a
    value of ``shape`` split by ``spec``: along the value's axes before its
    blocks' axes as the value is; along the blocks where the value is split
    at their first axis only, into parts of whole blocks; otherwise on every
    device."""
    P: Any = jax.sharding.PartitionSpec
    spec = (*spec, *(None,) * (len(shape) - len(spec)))
    k = _block_axis(shape)
    if k is None:
        return P()
    axes = spec[k]
    if axes is not None and all(a is None for a in spec[k + 1 :]):
        parts = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        whole = shape[k] % parts == 0 and (
            shape[k] // parts * math.prod(shape[k + 1 :]) % rounding.EIGHT_BIT_BLOCK == 0
        )
        axes = axes if whole else None
    else:
        axes = None
    return P(*spec[:k], axes)


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


def _encode(
    value: jax.Array, signed: bool, seed: jax.Array, stochastic: bool, high: bool = False
) -> EightBitArray:
    """:func:`_encode_here` of ``value``, on a mesh of explicit axes too."""

    def encode(value: jax.Array, seed: jax.Array) -> tuple[jax.Array, jax.Array]:
        stored = _encode_here(value, signed, seed, stochastic, high)
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
        rows = _blocked(magnitude)
        return _unblocked(rows * stored.scales.reshape(rows.shape[:-1])[..., None], codes.shape)

    value: jax.Array = rounding.eight_bit_value(codes, level_of, stored.signed, scaled, jnp.where)
    return value


def _encode_here(
    value: jax.Array, signed: bool, seed: jax.Array, stochastic: bool, high: bool
) -> EightBitArray:
    """``value`` in 8 bits (:func:`qhoptim.rounding.eight_bit_encode_reference`):
    each block's scale its largest finite magnitude, each value one of the two
    levels around it, chosen by the noise of ``seed`` (the high halves of its
    hashes with ``high``), or to nearest; NaN and infinities take the
    non-finite code and leave their block alone."""
    x = value.astype(jnp.float32)
    finite = jnp.isfinite(x)
    # Subnormals read as 0 (XLA flushes them; the rule does so everywhere).
    smallest = rounding.EIGHT_BIT_SMALLEST
    magnitudes = jnp.where(finite & (jnp.abs(x) >= smallest), jnp.abs(x), 0.0)
    rows = _blocked(magnitudes)
    # The stored state has no derivative (a bfloat16 one goes through a bit
    # cast; the C++ step takes constants): neither have the blocks' scales.
    largest = jax.lax.stop_gradient(rows.max(axis=-1))
    # Once per block: ratios are products; above EIGHT_BIT_LARGEST_PLAIN_SCALE
    # with the reciprocal of a quarter of the scale, which XLA would otherwise
    # flush to 0 (a subnormal), then times 1/4.
    large = largest > rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE
    inverse = (jnp.where(large, jnp.float32(4), jnp.float32(1)) / largest)[..., None]
    after = jnp.where(large, jnp.float32(0.25), jnp.float32(1))[..., None]
    ratio = _unblocked(rows * inverse * after, x.shape)
    ratio = jnp.where(jnp.isnan(ratio) | (ratio < smallest), 0.0, ratio)  # 0 * inf: all zeros
    # The levels around each ratio from its bits, with no table (see _decode).
    low, below, above = rounding.eight_bit_levels_around(
        jax.lax.bitcast_convert_type(ratio, jnp.int32), signed, jnp.where
    )
    if stochastic:
        threshold = _noise16(x.shape, seed, high).astype(jnp.float32) * 2.0**-16
    else:
        threshold = jnp.float32(0.5)
    code = rounding.eight_bit_code(
        x, finite, ratio, low, _as_float32(below), _as_float32(above), threshold, signed, jnp.where
    )
    return EightBitArray(code.astype(jnp.uint8), largest, signed)


def stored_leaves(treedef: Any, tree: Any, what: str, signed: bool) -> list[Any]:
    """The leaves of the state field ``tree`` (:func:`leaves_like`), each as
    this module stores it. ``flax.nnx.Optimizer`` keeps each leaf in a
    variable, and from its second update on hands an 8-bit leaf back as the
    mapping of its two children (0: the codes, 1: the scales) that nnx's
    state made of it; it is read as the :class:`EightBitArray` it was
    (``signed``: the field's). Scales kept in one axis (earlier 2.0.0
    development builds) are read in :func:`scales_shape`'s shape, so that a
    step's new state has it on every path."""
    leaves = leaves_like(treedef, tree, what)
    read = [
        EightBitArray(x[0], x[1], signed) if isinstance(x, Mapping) and set(x) == {0, 1} else x
        for x in leaves
    ]
    return [_shaped_scales(x) if isinstance(x, EightBitArray) else x for x in read]


def _shaped_scales(stored: EightBitArray) -> EightBitArray:
    shape = scales_shape(tuple(stored.codes.shape))
    if stored.scales.shape == shape:
        return stored
    if stored.scales.size != math.prod(shape):
        raise _scales_error(stored, shape)
    return EightBitArray(stored.codes, stored.scales.reshape(shape), stored.signed)


def _scales_error(stored: EightBitArray, shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"an 8-bit state of shape {stored.codes.shape} has a scale per block of "
        f"{rounding.EIGHT_BIT_BLOCK} values, of shape {shape}; received scales of shape "
        f"{stored.scales.shape}"
    )


def load(stored: jax.Array | EightBitArray, dtype: Any) -> jax.Array:
    """A stored state in ``dtype``, to step in: decoded, or cast."""
    if isinstance(stored, EightBitArray):
        return _decode(stored).astype(dtype)
    return stored.astype(dtype)


def store(
    value: jax.Array,
    like: jax.Array | EightBitArray,
    seed: jax.Array,
    stochastic: bool,
    high: bool = False,
) -> jax.Array | EightBitArray:
    """``value`` (a step's new state) stored as ``like`` is: in 8 bits
    (:func:`_encode`, ``high``: with the high halves of ``seed``'s hashes), to
    bfloat16 rounded stochastically with ``seed`` (:mod:`qhoptim.rounding`),
    otherwise cast to ``like``'s dtype.

    The noise of each element is the hash of its flat position, so XLA makes it
    inside the update's fused loop, never as an array of its own.
    """
    if isinstance(like, EightBitArray):
        return _encode(value, like.signed, seed, stochastic, high)
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
        return _decoded_batch(x) if isinstance(x, EightBitArray) else x

    return jax.tree.map(read, state, is_leaf=lambda x: isinstance(x, EightBitArray))


def _decoded_batch(stored: EightBitArray) -> jax.Array:
    """:func:`_decode` of ``stored``, or of each of a batch of 8-bit states (from
    ``jax.vmap`` of ``init`` or ``update``: scales of the batch's leading axis
    and then each member's), each with its own scales."""
    codes, scales = stored.codes, stored.scales
    expected = scales_shape(tuple(codes.shape))
    # One axis of as many scales: the layout of earlier 2.0.0 development builds.
    if scales.shape == expected or scales.shape == (math.prod(expected),):
        return _decode(stored)
    if scales.ndim > 1:
        if codes.shape[:1] != scales.shape[:1]:
            raise ValueError(
                f"a batch of 8-bit states holds codes and scales of the same batch; "
                f"received codes of shape {codes.shape}, scales of shape {scales.shape}"
            )
        return jax.vmap(lambda c, s: _decoded_batch(EightBitArray(c, s, stored.signed)))(
            codes, scales
        )
    raise _scales_error(stored, expected)
