r"""Stochastic rounding of optimizer state to bfloat16, defined once.

With ``state_dtype="bfloat16"`` every backend stores QHM's momentum buffer and
QHAdam's moments in bfloat16 and steps them in float32. Rounding the result to
nearest would freeze an EWMA once its increment falls below half a unit in
bfloat16's last place (bfloat16 keeps 8 significant bits: with
``beta2 = 0.999`` the second moment stops moving once ``(1 - beta2) g**2``
is below about ``2**-9`` of it). Stochastic rounding rounds up with
probability equal to the distance to the value below, so the stored state is
the float32 one on average.

A bfloat16 number is the top 16 bits of a float32: adding 16 random bits to
the bottom half of the float32's bits and cutting them off rounds up exactly
that often (:func:`round_bits`). Values bfloat16 holds exactly (zero, inf)
are unchanged, and a NaN stays a NaN of its sign (its top half, quiet): the
noise would carry a NaN whose payload fills the bottom half into the sign or
the exponent, making it 0 or an infinity.

The random bits are counter-based, the same numbers in every backend:

- the *seed* of a tensor's state after step ``t`` (counted from 1) is
  :func:`rounding_seed` of ``t`` and ``index = 4 * position + k``
  (:func:`state_index`) -- the
  parameter's position in the optimizer (its leaf in the pytree, its variable
  in Keras) and ``k`` the state (0: QHM's buffer or QHAdam's first moment,
  1: the second moment, 2: AMSGrad's maximum);
- the noise of the element at flat (row-major) position ``i`` is the low 16
  bits of :func:`mix32` of ``i * 0x9E3779B9 ^ seed`` (:func:`noise16`).

So a run resumed from a checkpoint rounds exactly as the uninterrupted one, no
framework's global generator is touched, and the same float32 state rounds to
the same bfloat16 bits in torch, JAX, Keras and MLX (each backend's tests hold
it to :func:`stochastic_round_reference`).

The functions are written once for any 32-bit integer arithmetic: Python ints,
unsigned 32-bit arrays of NumPy, JAX, TensorFlow or MLX, or torch's int64
tensors. :class:`Bits` says how a backend makes a constant, wraps a product
and shifts; this module imports no framework.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from qhoptim import validation

__all__ = [
    "EIGHT_BIT",
    "EIGHT_BIT_NON_FINITE",
    "EIGHT_BIT_RUNG_SHIFT",
    "EIGHT_BIT_SMALLEST",
    "PYTHON",
    "QUIET_NAN_BIT",
    "STATE_DTYPES",
    "Bits",
    "bfloat16_bits",
    "check_narrower",
    "check_real",
    "check_second_moment_dtype",
    "check_state_dtype",
    "check_stochastic_rounding",
    "eight_bit_code",
    "eight_bit_decode_reference",
    "eight_bit_encode_reference",
    "eight_bit_level_bits",
    "eight_bit_levels",
    "eight_bit_levels_around",
    "eight_bit_noise_source",
    "eight_bit_rung_offset",
    "eight_bit_value",
    "index_spread",
    "is_nan_bits",
    "mix32",
    "noise16",
    "round_bits",
    "rounding_seed",
    "rounding_seed_of_mixed_step",
    "rounding_seed_of_spread",
    "state_index",
    "stochastic",
    "stochastic_round_reference",
]

#: The dtypes ``state_dtype`` may name, by their name in every framework.
STATE_DTYPES = ("bfloat16", "float16", "float32", "float64")

#: The folder of ``rounding.h``: the rule's hash and bfloat16 rounding in C++,
#: which the CPU kernels of the torch, MLX and optax backends include.
CPP_INCLUDE_DIR = Path(__file__).with_name("csrc")

MASK32 = 0xFFFFFFFF
#: An element's position is spread by this odd constant (2**32 / golden ratio).
POSITION_MULTIPLIER = 0x9E3779B9
#: A state's index is spread by this odd constant (murmur3's finalizer's).
INDEX_MULTIPLIER = 0x85EBCA6B
#: lowbias32's multipliers (Wellons's 32-bit integer hash).
MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
#: The bits of a float32 a bfloat16 keeps.
BFLOAT16_MASK = 0xFFFF0000
#: A float32's bits without its sign.
MAGNITUDE_MASK = 0x7FFFFFFF
#: The largest magnitude bits that are not a NaN's: infinity's.
INFINITY_BITS = 0x7F800000
#: A float32 NaN's quiet bit, which the rounding sets in every NaN it stores
#: (the top half of a NaN with it set is a bfloat16 NaN).
QUIET_NAN_BIT = 0x00400000


def _same(x: Any) -> Any:
    return x


def _python_select(condition: Any, if_true: Any, if_false: Any) -> Any:
    return if_true if condition else if_false


class Bits(NamedTuple):
    """How a backend does unsigned 32-bit arithmetic.

    ``const(c)`` makes the constant ``c`` (``0 <= c < 2**32``) in the
    backend's integer type (JAX refuses a Python int above ``2**31 - 1``
    beside a uint32 array); ``wrap(x)`` reduces a sum or product to 32 bits
    (identity for uint32 arrays, which wrap; ``x & 0xFFFFFFFF`` for Python
    ints and int64 tensors); ``shift(x, n)`` is the logical right shift;
    ``select(c, a, b)`` is ``a`` where ``c`` holds, else ``b`` (``np.where``,
    ``jnp.where``, ...; a conditional expression for Python ints).
    """

    const: Callable[[int], Any] = _same
    wrap: Callable[[Any], Any] = _same
    shift: Callable[[Any, int], Any] = operator.rshift
    select: Callable[[Any, Any, Any], Any] = _python_select


#: Python ints (and int64 arrays holding values below 2**32).
PYTHON = Bits(wrap=lambda x: x & MASK32)


def mix32(x: Any, bits: Bits = PYTHON) -> Any:
    """lowbias32: a bijective 32-bit mixer (every input bit changes about half the output bits)."""
    m1, m2 = MIX_MULTIPLIERS
    x = x ^ bits.shift(x, 16)
    x = bits.wrap(x * bits.const(m1))
    x = x ^ bits.shift(x, 15)
    x = bits.wrap(x * bits.const(m2))
    return x ^ bits.shift(x, 16)


#: State indices a parameter takes (:func:`state_index`): QHM's buffer, or QHAdam's
#: two moments and AMSGrad's maximum, with room for one more.
STATES_PER_PARAMETER = 4


def state_index(position: Any, k: Any = 0) -> Any:
    """The index of state ``k`` of the parameter at ``position`` in the optimizer:
    ``4 * position + k`` (``k``: 0 QHM's buffer or QHAdam's first moment, 1 the
    second moment, 2 AMSGrad's maximum). ``k = 0`` gives a parameter's first
    index, from which its states count (``position`` may be a backend's
    integer array)."""
    return STATES_PER_PARAMETER * position + k


def rounding_seed(step: Any, index: Any, bits: Bits = PYTHON) -> Any:
    """The 32-bit seed of state ``index`` (:func:`state_index`) after step ``step`` (from 1).

    ``step`` and ``index`` are taken modulo ``2**32``; with :data:`PYTHON`
    they are Python ints, in a backend they may be its uint32 scalars (a
    traced step count under ``jit``).
    """
    # Reduced first: the mixer's shift would carry a Python int's bits above 32 in.
    return rounding_seed_of_mixed_step(mix32(bits.wrap(step), bits), index, bits)


def rounding_seed_of_mixed_step(mixed_step: Any, index: Any, bits: Bits = PYTHON) -> Any:
    """:func:`rounding_seed` from ``mix32(step)``, the half of it that every state
    of a step shares: a backend mixes a step number once for all its states."""
    return rounding_seed_of_spread(mixed_step, index_spread(index, bits), bits)


def index_spread(index: Any, bits: Bits = PYTHON) -> Any:
    """The half of :func:`rounding_seed` that a state index alone makes; a
    backend may keep it from step to step."""
    return bits.wrap(index * bits.const(INDEX_MULTIPLIER))


def rounding_seed_of_spread(mixed_step: Any, spread: Any, bits: Bits = PYTHON) -> Any:
    """:func:`rounding_seed` from both halves, ``mix32(step)`` and
    :func:`index_spread` of the state's index."""
    return mix32(mixed_step ^ spread, bits)


def noise16(positions: Any, seed: Any, bits: Bits = PYTHON, high: bool = False) -> Any:
    """The 16 random bits of the elements at flat ``positions`` under ``seed``:
    the low half of their hash, or with ``high`` its high half (an 8-bit
    second moment's, :func:`eight_bit_noise_source`)."""
    hashed = mix32(bits.wrap(positions * bits.const(POSITION_MULTIPLIER)) ^ seed, bits)
    return bits.shift(hashed, 16) if high else hashed & bits.const(0xFFFF)


def is_nan_bits(float32_bits: Any, bits: Bits = PYTHON) -> Any:
    """Where ``float32_bits`` are a NaN's (the backend's booleans): the
    magnitude's bits above infinity's."""
    return (float32_bits & bits.const(MAGNITUDE_MASK)) > bits.const(INFINITY_BITS)


def _carried(float32_bits: Any, noise: Any, bits: Bits) -> Any:
    # Adding ``noise`` (below ``2**16``) carries into the kept half with
    # probability equal to the dropped half's share of a unit in the last place.
    # A NaN takes no noise (a payload in the dropped half would carry into its
    # sign or exponent) and keeps its quiet bit set, so that its top half is a NaN.
    # Selections on one comparison, not products or masks of is_nan_bits: the
    # fewest operations per element in XLA's and MLX's loops (a product with
    # the noise made XLA's bfloat16 steps 15-30% slower on the CPU).
    nan = is_nan_bits(float32_bits, bits)
    carried = bits.wrap(float32_bits + bits.select(nan, bits.const(0), noise))
    return bits.select(nan, float32_bits | bits.const(QUIET_NAN_BIT), carried)


def round_bits(float32_bits: Any, noise: Any, bits: Bits = PYTHON) -> Any:
    """The float32 bits of the bfloat16 value ``float32_bits`` rounds to with
    ``noise`` (the kept top half, the dropped half cleared)."""
    return _carried(float32_bits, noise, bits) & bits.const(BFLOAT16_MASK)


def bfloat16_bits(float32_bits: Any, noise: Any, bits: Bits = PYTHON) -> Any:
    """The bits of the bfloat16 value ``float32_bits`` rounds to with ``noise``:
    :func:`round_bits`' top half, below ``2**16`` (a backend stores them as
    uint16 and reads them as bfloat16, where a float32-to-bfloat16 cast would
    run its own rounding on a value it leaves unchanged)."""
    return bits.shift(_carried(float32_bits, noise, bits), 16)


#: The name of the 8-bit blockwise state's dtype (``state_dtype=torch.uint8``,
#: ``jnp.uint8``): one byte per value, standing for a level of
#: :func:`eight_bit_levels`, and one float32 scale per block.
EIGHT_BIT = "uint8"
#: An 8-bit state reads magnitudes, and ratios to a block's scale, below
#: float32's smallest normal number (2**-126) as 0, so that its bytes do not
#: depend on whether the arithmetic flushes subnormals to zero (XLA's CPU
#: and GPU backends do; torch's does not).
EIGHT_BIT_SMALLEST = 2.0**-126
#: Values per block of an 8-bit state (one float32 scale per block).
EIGHT_BIT_BLOCK = 256
#: The largest block scale whose float32 reciprocal is normal. Above it (a block
#: within a factor 4 of float32's overflow) the rule takes ratios as the
#: magnitude times the reciprocal of ``scale / 4``, times ``1/4`` (exact), so
#: that no step of it is subnormal: XLA, and torch under
#: ``set_flush_denormal``, would flush such a reciprocal to 0 and store the
#: block as zeros.
EIGHT_BIT_LARGEST_PLAIN_SCALE = 2.0**126
#: Levels per octave of :func:`eight_bit_levels`' ladder (6.7% to 12.5% apart).
EIGHT_BIT_PER_OCTAVE = 8
#: The code of a non-finite value, by whether the state is signed: a signed
#: state's NaN or infinity takes its code of -0 (otherwise unused) and reads
#: back as NaN; an unsigned one's (a second moment that overflowed, or NaN)
#: takes the code of the ladder's lowest level and reads back as +inf, as a
#: float32 state holds it (the step divides by it: a zero step). Either leaves
#: its block's scale -- its largest *finite* magnitude -- and so the block's
#: other values alone.
EIGHT_BIT_NON_FINITE = {True: 128, False: 1}


def eight_bit_noise_source(k: int) -> tuple[int, bool]:
    """The state whose seed an 8-bit state ``k`` of a parameter (as in
    :func:`state_index`) draws its noise from, and whether from the high half
    of that hash (:func:`noise16`): QHAdam's second moment (``k = 1``) takes
    the high half of its first moment's hash at each position, ``(0, True)``;
    every other state the low half of its own, ``(k, False)``.

    One hash per value then rounds both moments: the hash is the costliest
    part of an 8-bit encoding, and its halves are independent bits. (A
    bfloat16 state draws the low half of its own hash, :func:`noise16`.)
    """
    return (0, True) if k == 1 else (k, False)


def eight_bit_levels(signed: bool) -> list[float]:
    """The magnitudes an 8-bit blockwise state's codes stand for, ascending,
    in units of its block's largest magnitude (the block's scale).

    A state is stored as one byte per value and one float32 scale per
    :data:`EIGHT_BIT_BLOCK` values: each value is its block's scale times one
    of these levels (times its sign, for a ``signed`` state). The levels are 0
    and a ladder up to 1 of :data:`EIGHT_BIT_PER_OCTAVE` levels per octave,
    spaced evenly within each: ``(1 + r / 8) * 2**q`` for ``k - top = 8 q + r``
    (``0 <= r < 8``), ``k = 1..top``; ``top = 127`` for a signed state (the
    first moment, QHM's buffer: a sign bit and 7 bits of magnitude, down to
    about ``2**-16`` of the scale), ``top = 255`` for an unsigned one (the
    second moment, down to ``2**-32``: it holds squares, so it needs twice the
    range in octaves to cover the gradients the first moment does).
    Neighbouring levels lie 6.7% (``r = 7``) to 12.5% (``r = 0``) apart. Each
    level is a float32 whose mantissa has three bits, so a ratio's level below
    it is its own exponent and the top three bits of its mantissa, and its
    place between two levels the mantissa's other 20 bits: encoding and
    decoding are shifts and masks on a float's bits, where a ladder of equal
    ratios (``2**(k / 8)``, 9% apart) takes a search or a table per value
    (such a ladder's encoding took 1.3-1.4x this one's time on a CPU). A
    value between two levels is rounded to one of them stochastically, with
    the probability of its distance to the other (unbiased), by the noise of
    :func:`noise16`; except that a positive unsigned value below the lowest
    level is stored as that level, never as 0, so that a second moment the
    denominator divides by cannot vanish under a first moment that does not.
    The codes of :data:`EIGHT_BIT_NON_FINITE` stand for NaN and inf instead
    of their levels (an unsigned state's lowest level is then its second,
    ``1.375 * 2**-32``; the first is never stored).
    """
    top = 127 if signed else 255
    n = EIGHT_BIT_PER_OCTAVE
    return [0.0] + [math.ldexp(1.0 + (k - top) % n / n, (k - top) // n) for k in range(1, top + 1)]


#: A level ``k >= 1`` of :func:`eight_bit_levels` is the float32 whose bits
#: are its *rung* ``k + eight_bit_rung_offset(signed)`` shifted left by this:
#: the exponent field and the mantissa's top three bits, the mantissa's other
#: bits 0 (each level's mantissa has three bits).
EIGHT_BIT_RUNG_SHIFT = 23 - 3


def eight_bit_rung_offset(signed: bool) -> int:
    """The rung (:data:`EIGHT_BIT_RUNG_SHIFT`) of a code's level less the code:
    the top level (``1.0``, code 127 or 255) is rung ``8 * 127``."""
    return EIGHT_BIT_PER_OCTAVE * 127 - (127 if signed else 255)


def eight_bit_level_bits(k: Any, signed: bool) -> Any:
    """The float32 bits of level ``k >= 1`` of :func:`eight_bit_levels` (Python
    ints or any backend's int32 arrays): the table's value without reading a
    table, which an accelerator's or a sharded array's gather would cost."""
    return (k + eight_bit_rung_offset(signed)) << EIGHT_BIT_RUNG_SHIFT


def eight_bit_levels_around(
    ratio_bits: Any, signed: bool, where: Callable[[Any, Any, Any], Any]
) -> tuple[Any, Any, Any]:
    """The levels around each ratio, from its float32 bits: ``(low, below_bits,
    above_bits)``, the index of the level ``below <= ratio < above`` and the
    two levels' bits -- what :func:`eight_bit_encode_reference`'s search of
    the table finds (its last pair at most), as integer arithmetic on any
    backend's int32 arrays (``where``: its select). ``ratio_bits`` are those
    of 0 or of a normal non-negative ratio, as the rule reads ratios.

    A ratio's rung (its bits shifted right by :data:`EIGHT_BIT_RUNG_SHIFT`)
    is that of the level below it, whose bits are the ratio's with the bits
    under the rung cleared; the level above is one rung further up. Below the
    first level (0 included) the pair is 0 and the first level; at or above
    the top, the last pair."""
    top = 127 if signed else 255
    one_rung = 1 << EIGHT_BIT_RUNG_SHIFT
    rung_bits = ratio_bits & ~(one_rung - 1)
    low = (ratio_bits >> EIGHT_BIT_RUNG_SHIFT) - eight_bit_rung_offset(signed)
    under = low < 1
    over = low > top - 1
    below_bits = where(under, 0, where(over, eight_bit_level_bits(top - 1, signed), rung_bits))
    above_bits = where(
        under,
        eight_bit_level_bits(1, signed),
        where(over, eight_bit_level_bits(top, signed), rung_bits + one_rung),
    )
    return where(under, 0, where(over, top - 1, low)), below_bits, above_bits


def stochastic(state_dtype: str | None, stochastic_rounding: bool | None) -> bool:
    """Whether a state stored in ``state_dtype`` is written back stochastically:
    ``stochastic_rounding=None`` means yes for bfloat16 and the 8-bit state
    (:data:`EIGHT_BIT`), and only for them."""
    return state_dtype in ("bfloat16", EIGHT_BIT) and stochastic_rounding is not False


def check_state_dtype(
    name: str | None, received: object, *, allowed: tuple[str, ...], spelled: str = ""
) -> None:
    """Refuse a ``state_dtype`` that is not one of ``allowed`` (names of
    :data:`STATE_DTYPES`); ``name`` is the backend's canonical name of the
    received value (None where it names no dtype), ``received`` the value as
    given. ``spelled``: how the backend writes a dtype before its name
    (``"torch."``, where the name alone, a string, is not a dtype)."""
    if received is None or name in allowed:
        return
    raise ValueError(
        f"state_dtype must be None or one of {', '.join(spelled + a for a in allowed)}; "
        f"received state_dtype={received!r}"
    )


def check_second_moment_dtype(name: str | None) -> None:
    """Refuse float16 for QHAdam's second moment (``name``: the state dtype's name).

    float16 holds ``|g|**2`` only from about 6e-8 (its smallest subnormal) to
    65504, i.e. gradients of magnitude about 2.4e-4 to 256: below, the second
    moment is stored as 0 and the step divides by ``eps`` alone (at ``|g|`` of
    1e-3 a trajectory ended 50x off the float32-state run); above, it is inf
    and the coordinate stops moving. bfloat16 has float32's range at the same
    two bytes. QHM's buffer (and QHAdam's first moment) hold gradients, not
    their squares, and take float16.
    """
    if name == "float16":
        raise ValueError(
            "state_dtype=float16 cannot hold QHAdam's second moment: float16 keeps "
            "|g|**2 only from 6e-08 to 65504 (|g| from 2.4e-04 to 256) and stores it "
            "as 0 or inf outside; use bfloat16 (float32's range in the same 2 bytes) "
            "or float32"
        )


def check_narrower(state_dtype: str, state_bytes: int, param_dtype: str, param_bytes: int) -> None:
    """Refuse a ``state_dtype`` wider than a parameter's dtype (itemsizes in
    bytes), or as wide and another (float16 beside bfloat16: such a state
    would step in the parameters' 16 bits, where ``0.999 * v`` is ``v``)."""
    if state_bytes > param_bytes:
        raise ValueError(
            f"state_dtype={state_dtype} is wider than a parameter's dtype {param_dtype}; "
            "state_dtype stores the state in a narrower dtype"
        )
    if state_bytes == param_bytes and state_dtype != param_dtype:
        raise ValueError(
            f"state_dtype={state_dtype} is as wide as a parameter's dtype {param_dtype}; "
            "state_dtype stores the state in a narrower dtype (or the parameters' own)"
        )


def check_real(is_complex: bool) -> None:
    """Refuse a complex parameter: a narrow state is a real dtype."""
    if is_complex:
        raise ValueError("state_dtype applies to real parameters; received a complex one")


#: The state dtypes that are rounded stochastically, as an error names them.
_ROUNDED_STATES = {"bfloat16": "bfloat16", EIGHT_BIT: "8-bit (uint8)"}


def check_stochastic_rounding(
    value: object, state_dtype: str | None, *, allowed: tuple[str, ...], spelled: str = ""
) -> None:
    """``stochastic_rounding`` must be None or a bool, and True only for a state
    stored in bfloat16 or 8 bits (``state_dtype``: the state dtype's name, None
    for none): no other state is rounded stochastically, and a True that
    changed nothing would read as if it did. ``allowed`` and ``spelled`` as
    :func:`check_state_dtype`'s: the message names the rounded ones of the
    backend's state dtypes, and the received one as the backend spells it."""
    validation.check_optional_bool(value, "stochastic_rounding")
    rounded = [name for name in allowed if name in _ROUNDED_STATES]
    if value and state_dtype not in rounded:
        received = "None" if state_dtype is None else spelled + state_dtype
        raise ValueError(
            "stochastic_rounding=True applies to a "
            f"{' or '.join(_ROUNDED_STATES[name] for name in rounded)} state_dtype; "
            f"received stochastic_rounding=True with state_dtype={received}"
        )


def stochastic_round_reference(values: Any, step: int, index: int) -> Any:
    """The bfloat16 bits (NumPy uint16) stochastic rounding stores for ``values``
    (read as float32) as state ``index`` after step ``step``: the NumPy
    statement of the rule every backend's tests compare with. Needs NumPy."""
    import numpy as np

    x = np.asarray(values, dtype=np.float32)
    # Flat, in row-major order (NumPy's 0-d arithmetic gives scalars, which
    # warn where arrays wrap), and back in the values' shape.
    flat = np.ascontiguousarray(x.reshape(-1))
    u32 = Bits(const=np.uint32, select=np.where)
    seed = np.uint32(rounding_seed(step, index))
    positions = np.arange(flat.size, dtype=np.uint32)
    top = bfloat16_bits(flat.view(np.uint32), noise16(positions, seed, u32), u32)
    return top.astype(np.uint16).reshape(x.shape)


def eight_bit_encode_reference(
    values: Any, signed: bool, seed: int, stochastic: bool, start: int = 0, high: bool = False
) -> tuple[Any, Any]:
    """The 8-bit state (NumPy codes, uint8, and block scales, float32) that
    ``values`` (read as float32, flattened) are stored as, with the noise of
    seed ``seed`` for the elements at positions ``start ..`` (the high half
    of its hash with ``high``: :func:`eight_bit_noise_source`), or to
    nearest: the NumPy statement of the rule every backend's tests compare
    with. Positions are taken modulo 2**32, as optax's uint32 positions are
    (torch folds those of a tensor past 2**32 values instead, as its
    bfloat16 rounding does).

    Each block of :data:`EIGHT_BIT_BLOCK` values is scaled by its largest
    finite magnitude: a value's ``ratio`` is its magnitude times the float32
    reciprocal of the scale (above :data:`EIGHT_BIT_LARGEST_PLAIN_SCALE`: of
    a quarter of the scale, the product then times 1/4; magnitudes and ratios
    below :data:`EIGHT_BIT_SMALLEST` read as 0). It lies between two levels
    ``below <= ratio < above`` of :func:`eight_bit_levels` (``searchsorted``
    on the right, the last pair at most) and is stored as ``above`` when
    ``ratio - below > u * (above - below)``, ``u`` the noise over 2**16 (0.5
    to nearest), in float32: up with probability ``(ratio - below) / (above -
    below)``, without a division per value. A negative value of a signed
    state sets bit 7; NaN and infinities take :data:`EIGHT_BIT_NON_FINITE`'s
    code; a positive value of an unsigned state is never stored below the
    code after that one. Needs NumPy.
    """
    import numpy as np

    x = np.asarray(values, dtype=np.float32).reshape(-1)
    n = x.size
    blocks = -(-n // EIGHT_BIT_BLOCK)
    finite = np.isfinite(x)
    smallest = np.float32(EIGHT_BIT_SMALLEST)
    magnitudes = np.where(finite & (np.abs(x) >= smallest), np.abs(x), np.float32(0))
    padded = np.zeros(blocks * EIGHT_BIT_BLOCK, np.float32)
    padded[:n] = magnitudes
    scales = padded.reshape(blocks, EIGHT_BIT_BLOCK).max(axis=1)
    large = scales > np.float32(EIGHT_BIT_LARGEST_PLAIN_SCALE)
    with np.errstate(invalid="ignore", divide="ignore"):
        inverse = np.where(large, np.float32(4), np.float32(1)) / scales  # once per block
        after = np.where(large, np.float32(0.25), np.float32(1))
        ratio = magnitudes * np.repeat(inverse, EIGHT_BIT_BLOCK)[:n]
        ratio = ratio * np.repeat(after, EIGHT_BIT_BLOCK)[:n]
    # 0 * inf in an all-zero block
    ratio = np.where(np.isnan(ratio) | (ratio < smallest), np.float32(0), ratio)
    levels = np.asarray(eight_bit_levels(signed), np.float32)
    low = np.clip(np.searchsorted(levels, ratio, side="right") - 1, 0, levels.size - 2)
    below, above = levels[low], levels[low + 1]
    if stochastic:
        u32 = Bits(const=np.uint32, select=np.where)
        positions = (np.arange(start, start + n, dtype=np.int64) & MASK32).astype(np.uint32)
        noise = noise16(positions, np.uint32(seed), u32, high)
        threshold = noise.astype(np.float32) / np.float32(65536)
    else:
        threshold = np.float32(0.5)
    code = eight_bit_code(x, finite, ratio, low, below, above, threshold, signed, np.where)
    return code.astype(np.uint8), scales


def eight_bit_code(
    x: Any,
    finite: Any,
    ratio: Any,
    low: Any,
    below: Any,
    above: Any,
    threshold: Any,
    signed: bool,
    where: Callable[[Any, Any, Any], Any],
) -> Any:
    """The code of each value ``x`` of an 8-bit state, from its ``ratio`` to
    its block's scale, the levels ``below <= ratio < above`` (the index of
    ``below``: ``low``) and its ``threshold`` (the noise over 2**16, or 0.5):
    the rule of :func:`eight_bit_encode_reference`, written once for the
    arrays of any backend (``where``: its select; integer codes, to be cast
    to uint8). Up with probability ``(ratio - below) / (above - below)``,
    compared as a product; a negative value of a signed state sets bit 7 (no
    -0: that code is the non-finite one); a positive value of an unsigned
    state is never stored as 0, nor as the code of inf."""
    code = low + (ratio - below > threshold * (above - below))
    non_finite = EIGHT_BIT_NON_FINITE[signed]
    if signed:
        code = where((x < 0) & (code > 0), code + 128, code)
    else:
        code = where((code <= non_finite) & (ratio > 0), non_finite + 1, code)
    return where(finite, code, non_finite)


def eight_bit_decode_reference(codes: Any, scales: Any, signed: bool) -> Any:
    """The float32 values (flat, NumPy) an 8-bit state's ``codes`` and block
    ``scales`` stand for (:func:`eight_bit_encode_reference`): level times
    scale, negated where bit 7 is set in a signed state; the non-finite code
    reads back as NaN (signed) or +inf (unsigned). Needs NumPy."""
    import numpy as np

    c = np.asarray(codes).reshape(-1).astype(np.int64)
    levels = np.asarray(eight_bit_levels(signed), np.float32)
    per_value = np.repeat(np.asarray(scales, np.float32), EIGHT_BIT_BLOCK)[: c.size]
    value = eight_bit_value(c, levels.__getitem__, signed, lambda m: m * per_value, np.where)
    return value.astype(np.float32)


def eight_bit_value(
    codes: Any,
    level_of: Callable[[Any], Any],
    signed: bool,
    scaled: Callable[[Any], Any],
    where: Callable[[Any, Any, Any], Any],
) -> Any:
    """The values an 8-bit state's integer ``codes`` stand for: the level
    (``level_of`` each code's magnitude: the :func:`eight_bit_levels` table's
    entry, by the backend's lookup or from :func:`eight_bit_level_bits`)
    a code names, negated where bit 7 is set in a ``signed`` state, times its
    block's scale (``scaled``: the backend's product of the magnitudes with
    their blocks' scales); the non-finite code reads back as NaN (signed) or
    +inf (unsigned). Written once for the arrays of any backend, as
    :func:`eight_bit_code` is."""
    magnitude = level_of(codes & 127 if signed else codes)
    if signed:
        magnitude = where(codes >= 128, -magnitude, magnitude)
    special = math.nan if signed else math.inf
    return where(codes == EIGHT_BIT_NON_FINITE[signed], special, scaled(magnitude))
