"""The stochastic rounding rule of narrow optimizer state (:mod:`qhoptim.rounding`).

Every backend's tests hold its rounding to :func:`rounding.stochastic_round_reference`;
these tests hold that reference to what stochastic rounding means: unbiased,
exact where bfloat16 is exact, and noise that differs per step, state and element.
"""

from __future__ import annotations

import numpy as np
import pytest

from qhoptim import rounding

U32 = rounding.Bits(const=np.uint32)


def _bfloat16_neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values below and above positive float32 ``x``, as float64."""
    bits = x.astype(np.float32).view(np.uint32)
    below = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    above = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    return below, above.astype(np.float64)


def _as_float(bfloat16_bits: np.ndarray) -> np.ndarray:
    return (bfloat16_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def test_python_ints_and_uint32_arrays_give_the_same_numbers() -> None:
    # The rule is written once for any integer arithmetic (rounding.Bits); the
    # same positions and seed give the same noise as ints and as uint32 arrays.
    positions = [0, 1, 2, 12345, 2**31 - 1, 2**32 - 1]
    seed = rounding.rounding_seed(7, 4 * 3 + 1)
    one = np.ones(1, dtype=np.uint32)  # arrays wrap silently; NumPy scalars warn
    seed_u32 = rounding.rounding_seed(7 * one, 13 * one, U32)
    assert int(seed_u32[0]) == seed
    as_array = rounding.noise16(np.array(positions, dtype=np.uint32), np.uint32(seed), U32)
    assert [int(v) for v in as_array] == [rounding.noise16(i, seed) for i in positions]


def test_rounding_seed_takes_the_step_modulo_2_32() -> None:
    # As its docstring and the backends' masked step counts: step 2**32 + s is step s.
    for step in (1, 5, 123456):
        for index in (0, 13):
            seed = rounding.rounding_seed(step, index)
            assert rounding.rounding_seed(2**32 + step, index) == seed
            assert rounding.rounding_seed(step, 2**32 + index) == seed


def test_mix32_is_a_bijection_on_a_sample() -> None:
    # lowbias32 is invertible: distinct inputs never collide.
    x = np.arange(1 << 20, dtype=np.uint32) * np.uint32(2654435761)
    assert np.unique(rounding.mix32(x, U32)).size == x.size


def test_stochastic_rounding_is_unbiased() -> None:
    # Each value lies between two bfloat16 neighbours; it must round up with
    # probability equal to its distance from the lower one, in units of the gap.
    # 2**16 copies of each value: the frequency's standard error is at most
    # 1/512, the tolerance six of them.
    rng = np.random.default_rng(0)
    values = rng.uniform(0.5, 4.0, size=8).astype(np.float32)
    copies = 1 << 16
    for step, value in enumerate(values, start=1):
        x = np.full(copies, value, dtype=np.float32)
        rounded = _as_float(rounding.stochastic_round_reference(x, step, 0)).astype(np.float64)
        below, above = _bfloat16_neighbours(x[:1])
        assert set(np.unique(rounded)) <= {below[0], above[0]}
        share = (float(value) - below[0]) / (above[0] - below[0])
        assert abs(np.mean(rounded == above[0]) - share) < 6 / 512
        # The mean of the stored values is the float32 value.
        assert abs(rounded.mean() - float(value)) < 6 / 512 * (above[0] - below[0])


def test_values_bfloat16_holds_are_kept() -> None:
    # Float32 values whose low 16 bits are zero, bfloat16's largest finite included.
    exact = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf], dtype=np.float32)
    exact = np.append(exact, np.array([0x7F7F0000], dtype=np.uint32).view(np.float32))
    rounded = _as_float(rounding.stochastic_round_reference(exact, 3, 5))
    assert np.array_equal(rounded.view(np.uint32), exact.view(np.uint32))


def test_a_nan_stays_a_nan_of_its_sign_whatever_its_payload() -> None:
    # Arithmetic's NaNs (0x7FC00000, x86's 0xFFC00000) have nothing in the
    # dropped half; NaNs made from bits may fill it, and the noise then carried
    # into the sign (0x7FFFFFFF -> -0) or left an infinity (0x7F800001 -> inf).
    patterns = [0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF80FFFF, 0x7FBFFFFF]
    payloads = np.array(patterns, dtype=np.uint32)
    x = np.tile(payloads, 512).view(np.float32)  # many noises for each
    for step in (1, 2, 3):
        top = rounding.stochastic_round_reference(x, step, 4)
        stored = (top.astype(np.uint32) << 16).view(np.float32)
        assert np.isnan(stored).all()
        assert np.array_equal(np.signbit(stored), np.signbit(x))
        # The top half of the NaN, its quiet bit set: the same NaN at every step.
        assert np.array_equal(top, ((x.view(np.uint32) >> 16) | 0x0040).astype(np.uint16))
    assert not rounding.is_nan_bits(0x7F800000) and rounding.is_nan_bits(0x7F800001)
    assert not rounding.is_nan_bits(0xFF800000) and rounding.is_nan_bits(0xFFFFFFFF)


def test_the_noise_differs_between_steps_states_and_elements() -> None:
    x = np.full(4096, 1.0 + 2.0**-8, dtype=np.float32)  # halfway: rounds up half the time
    draws = {
        (step, index): rounding.stochastic_round_reference(x, step, index).tobytes()
        for step in (1, 2, 3)
        for index in (0, 1, 4)
    }
    assert len(set(draws.values())) == len(draws)
    # Within one draw, elements round independently: about half of them up
    # (to 1 + 2**-7, bits 0x3F81); the standard error is 1/128.
    up = np.mean(rounding.stochastic_round_reference(x, 1, 0) == np.uint16(0x3F81))
    assert abs(up - 0.5) < 6 / 128


def test_the_low_noise_bits_are_uniform() -> None:
    # Each of the 16 noise bits is set about half the time over a tensor.
    noise = rounding.noise16(
        np.arange(1 << 16, dtype=np.uint32), np.uint32(rounding.rounding_seed(1, 0)), U32
    )
    for bit in range(16):
        share = np.mean((noise >> np.uint32(bit)) & np.uint32(1))
        assert abs(share - 0.5) < 6 / 512  # standard error 1/512


@pytest.mark.parametrize(
    ("name", "rounds"),
    [("bfloat16", True), ("uint8", True), ("float16", False), ("float32", False), (None, False)],
)
def test_stochastic_means_bfloat16_unless_turned_off(name: str | None, rounds: bool) -> None:
    assert rounding.stochastic(name, None) is rounds
    assert rounding.stochastic(name, False) is False


def test_a_state_dtype_outside_the_allowed_is_refused_with_the_values() -> None:
    with pytest.raises(ValueError, match=r"one of bfloat16, float32; received state_dtype='int8'"):
        rounding.check_state_dtype(None, "int8", allowed=("bfloat16", "float32"))
    rounding.check_state_dtype("bfloat16", "bfloat16", allowed=("bfloat16",))
    with pytest.raises(TypeError, match=r"received stochastic_rounding=1"):
        rounding.check_stochastic_rounding(1, "bfloat16", allowed=rounding.STATE_DTYPES)
    every = (*rounding.STATE_DTYPES, rounding.EIGHT_BIT)
    for name in ("bfloat16", "uint8"):
        for value in (None, True, False):
            rounding.check_stochastic_rounding(value, name, allowed=every)
    for name in (None, "float16", "float32"):
        rounding.check_stochastic_rounding(None, name, allowed=every)
        rounding.check_stochastic_rounding(False, name, allowed=every)
        with pytest.raises(
            ValueError,
            match=r"applies to a bfloat16 or 8-bit \(uint8\) state_dtype; "
            rf"received stochastic_rounding=True with state_dtype={name}$",
        ):
            rounding.check_stochastic_rounding(True, name, allowed=every)
    # A backend without 8-bit state names bfloat16 alone, and the received
    # dtype as it spells dtypes.
    with pytest.raises(
        ValueError, match=r"applies to a bfloat16 state_dtype; .* state_dtype=mx\.float16$"
    ):
        rounding.check_stochastic_rounding(
            True, "float16", allowed=rounding.STATE_DTYPES, spelled="mx."
        )


# ----------------------------------------------------------- the 8-bit statement
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8_bit_levels_are_floats_of_three_mantissa_bits(signed: bool) -> None:
    # Level k >= 1 is (1 + r/8) * 2**q for k - top = 8 q + r: a float32 whose
    # bits are (k - top + 8 * 127) << 20, the property the C++ loops read
    # levels by (eight_bit.h's Ladder). Neighbours lie 1/15 to 1/8 apart.
    levels = rounding.eight_bit_levels(signed)
    top = len(levels) - 1
    assert top == (127 if signed else 255) and levels[0] == 0.0 and levels[top] == 1.0
    bits = np.asarray(levels[1:], np.float32).view(np.uint32).astype(np.int64)
    assert np.array_equal(bits, (np.arange(1, top + 1) - top + 8 * 127) << 20)
    for k in range(1, top + 1):
        q, r = divmod(k - top, rounding.EIGHT_BIT_PER_OCTAVE)
        assert levels[k] == (1 + r / 8) * 2.0**q
    gaps = np.diff(levels[1:]) / np.asarray(levels[1:-1])
    assert np.isclose(gaps.min(), 1 / 15) and np.isclose(gaps.max(), 1 / 8)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8_bit_levels_read_off_a_ratio_s_bits_are_the_table_s(signed: bool) -> None:
    # eight_bit_levels_around's arithmetic against the reference's search of
    # the table: every level, its float32 neighbours, the midpoints, 0, the
    # smallest normal, 1 and just past it, and random ratios over all the
    # octaves (the rule's ratios: 0 or normal, non-negative).
    levels = np.asarray(rounding.eight_bit_levels(signed), np.float32)
    top = levels.size - 1
    ks = np.arange(1, top + 1)
    assert np.array_equal(
        rounding.eight_bit_level_bits(ks, signed), levels[1:].view(np.int32).astype(np.int64)
    )
    rng = np.random.default_rng(3)
    normal = levels[1:]
    ratios = np.concatenate(
        [
            levels,
            np.nextafter(normal, np.float32(0)),
            np.nextafter(normal, np.float32(2)),
            (levels[:-1] + levels[1:]) / 2,
            np.float32([0, rounding.EIGHT_BIT_SMALLEST, 1e-30, 1.0, np.nextafter(1, 2)]),
            np.exp2(rng.uniform(-40, 0.01, 100_000)).astype(np.float32),
        ]
    ).astype(np.float32)
    low, below, above = rounding.eight_bit_levels_around(
        ratios.view(np.int32).astype(np.int64), signed, np.where
    )
    want = np.clip(np.searchsorted(levels, ratios, side="right") - 1, 0, top - 1)
    assert np.array_equal(low, want)
    assert np.array_equal(np.asarray(below).astype(np.int32).view(np.float32), levels[want])
    assert np.array_equal(np.asarray(above).astype(np.int32).view(np.float32), levels[want + 1])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8_bit_encoding_is_unbiased_between_two_neighbouring_levels(signed: bool) -> None:
    # 255 copies of 0.3 per block of scale 1: each is stored as one of the two
    # levels around it, on average itself (6 standard errors of a step of at
    # most 12.5% of the value); to nearest, every copy takes the same level.
    blocks = 256
    x = np.full((blocks, 256), 0.3, np.float32)
    x[:, 0] = 1.0
    codes, scales = rounding.eight_bit_encode_reference(x, signed, seed=11, stochastic=True)
    assert np.array_equal(scales, np.ones(blocks, np.float32))
    rest = rounding.eight_bit_decode_reference(codes, scales, signed).reshape(blocks, 256)[:, 1:]
    assert len(np.unique(rest)) == 2
    assert abs(float(rest.mean()) - 0.3) < 6 * 0.125 * 0.3 / 255
    nearest, _ = rounding.eight_bit_encode_reference(x, signed, seed=11, stochastic=False)
    assert len(np.unique(nearest.reshape(blocks, 256)[:, 1:])) == 1


def test_an_8_bit_second_moment_rounds_with_the_high_half_of_its_first_moments_hash() -> None:
    # rounding.eight_bit_noise_source: state 1 (QHAdam's second moment) draws
    # the high 16 bits of state 0's hash at each position, the others the low
    # 16 bits of their own; the halves are independent of each other (over
    # 2**16 positions the pairs of their top four bits fill 256 cells evenly,
    # 256 each within 6 standard errors), and the high half stays unbiased in
    # the rounding.
    assert rounding.eight_bit_noise_source(0) == (0, False)
    assert rounding.eight_bit_noise_source(1) == (0, True)
    assert rounding.eight_bit_noise_source(2) == (2, False)
    positions = np.arange(1 << 16, dtype=np.uint32)
    seed = np.uint32(rounding.rounding_seed(3, rounding.state_index(5, 0)))
    hashed = rounding.mix32(positions * np.uint32(rounding.POSITION_MULTIPLIER) ^ seed, U32)
    low = rounding.noise16(positions, seed, U32)
    high = rounding.noise16(positions, seed, U32, high=True)
    assert np.array_equal(low, hashed & np.uint32(0xFFFF))
    assert np.array_equal(high, hashed >> np.uint32(16))
    assert [rounding.noise16(int(i), int(seed), high=True) for i in positions[:9]] == [
        int(v) for v in high[:9]
    ]
    cells = np.bincount(((low >> np.uint32(12)) << np.uint32(4)) | (high >> np.uint32(12)))
    assert cells.size == 256 and cells.min() > 256 - 96 and cells.max() < 256 + 96
    assert abs(float(np.corrcoef(low, high)[0, 1])) < 0.02
    # Stored with the high half, a value between two levels is still stored
    # as itself on average, and the codes differ from the low half's.
    x = np.full((256, 256), 0.3, np.float32)
    x[:, 0] = 1.0
    codes, scales = rounding.eight_bit_encode_reference(x, False, 11, True, high=True)
    rest = rounding.eight_bit_decode_reference(codes, scales, False).reshape(256, 256)[:, 1:]
    assert abs(float(rest.mean()) - 0.3) < 6 * 0.125 * 0.3 / 255
    low_codes, _ = rounding.eight_bit_encode_reference(x, False, 11, True)
    assert not np.array_equal(codes, low_codes)


def test_8_bit_special_values() -> None:
    # NaN and infinities take their own code and leave the block's scale to
    # the finite values; a negative value sets bit 7; a positive value of an
    # unsigned state far below the ladder is stored as its lowest level,
    # never 0; a subnormal reads as 0, as under a flush-to-zero mode.
    x = np.float32([2.0, -1.0, np.nan, np.inf, -np.inf, 1e-30, 1e-40, 0.0])
    signed, _ = rounding.eight_bit_encode_reference(x, True, seed=0, stochastic=False)
    unsigned, scales = rounding.eight_bit_encode_reference(
        np.abs(x), False, seed=0, stochastic=False
    )
    assert scales.tolist() == [2.0]
    assert signed.tolist() == [127, 128 + 119, 128, 128, 128, 0, 0, 0]
    assert unsigned.tolist()[:6] == [255, 247, 1, 1, 1, 2]
    assert unsigned.tolist()[6:] == [0, 0]  # the subnormal and the zero
    values = rounding.eight_bit_decode_reference(signed, scales, True)
    assert values[0] == 2.0 and values[1] == -1.0 and np.isnan(values[2:5]).all()
    assert rounding.eight_bit_decode_reference(unsigned, scales, False)[3] == np.inf
