"""``state_dtype``: optimizer state stored narrower than the parameters (torch).

The bounds are measured ones: bfloat16 keeps 8 significant bits, so each
stored moment is off by less than 2**-7 relative after a step, and the
parameters drift from a float32-state run by the accumulated rounding.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conformance.cases import (
    eight_bit_tolerance,
    narrow_state_cases,
    narrow_state_tolerance,
    relative_state_distance,
    stored_state_tolerance,
)
from conformance.problems import get_problem
from qhoptim import rounding
from qhoptim.torch import QHM, QHAdam, QHAdamW, _state_dtype

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
# NaNs made from bits, whose payloads fill the half bfloat16 drops (as uint32).
NAN_PAYLOADS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF]
CLASSES = {"qhm": QHM, "qhadam": QHAdam, "qhadamw": QHAdamW}
CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7}),
    (QHAdam, {"lr": 1e-2, "nus": (0.7, 1.0), "weight_decay": 0.1}),
    (QHAdamW, {"lr": 1e-2, "nus": (0.7, 0.8), "amsgrad": True}),
]
IDS = ["QHM", "QHAdam", "QHAdamW-amsgrad"]
PATHS = {"per-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(64, 33), (33,), (7,)]]


def _grads(params: list[torch.Tensor], t: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for t in steps:
        for p, g in zip(params, _grads(params, t), strict=True):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_the_state_is_stored_in_bfloat16_at_half_the_bytes(
    cls: type, kwargs: dict[str, Any], path: str
) -> None:
    params = _params()
    opt = cls(params, **kwargs, **PATHS[path], state_dtype=BF16)
    wide = cls(_params(), **kwargs, **PATHS[path])
    _run(opt, params, range(2))
    _run(wide, wide.param_groups[0]["params"], range(2))

    def state_bytes(o: torch.optim.Optimizer) -> int:
        return sum(
            s[k].numel() * s[k].element_size()
            for s in o.state.values()
            for k in STATE_KEYS
            if k in s
        )

    for state in opt.state.values():
        assert {state[k].dtype for k in STATE_KEYS if k in state} == {BF16}
    assert state_bytes(opt) * 2 == state_bytes(wide)
    # QHAdam (without amsgrad): 4 bytes per parameter instead of 8.
    numel = sum(p.numel() for p in params)
    if cls is QHAdam:
        assert state_bytes(opt) == 4 * numel


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_a_resumed_run_rounds_as_the_uninterrupted_one(
    cls: type, kwargs: dict[str, Any], path: str
) -> None:
    # The rounding noise comes from the step and the parameter, not from a
    # global generator: a checkpoint loaded into a fresh optimizer continues
    # bit for bit, and the state keeps its dtype through torch's load.
    params = _params()
    opt = cls(params, **kwargs, **PATHS[path], state_dtype=BF16)
    _run(opt, params, range(5))
    saved = copy.deepcopy(opt.state_dict())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(copies, **kwargs, **PATHS[path], state_dtype=BF16)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["state_dtype"] is BF16
    for p, q in zip(params, copies, strict=True):
        for k in STATE_KEYS:
            if k in opt.state[p]:
                assert resumed.state[q][k].dtype is BF16
                assert torch.equal(resumed.state[q][k], opt.state[p][k])
    rng = torch.get_rng_state()
    _run(opt, params, range(5, 10))
    _run(resumed, copies, range(5, 10))
    assert torch.equal(torch.get_rng_state(), rng)  # torch's generator untouched
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_every_path_takes_the_same_steps(cls: type, kwargs: dict[str, Any]) -> None:
    # The same working copies and the same rounding seeds: the paths differ
    # only by their kernels' float32 rounding, which the stochastic rounding to
    # bfloat16 can carry to one bfloat16 unit now and then.
    runs = []
    for flags in PATHS.values():
        params = _params()
        _run(cls(params, **kwargs, **flags, state_dtype=BF16), params, range(20))
        runs.append(torch.cat([p.detach().ravel() for p in params]))
    for other in runs[1:]:
        torch.testing.assert_close(other, runs[0], rtol=1e-4, atol=1e-5)


def states_of(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> np.ndarray:
    """Every state of ``params``, read back as float64 (``decoded_state``), flat."""
    decoded = [opt.decoded_state(p) for p in params]  # type: ignore[attr-defined]
    return np.concatenate(
        [np.zeros(0)] + [v.double().numpy().ravel() for d in decoded for _, v in sorted(d.items())]
    )


def _deviation(case: Any, state_dtype: torch.dtype) -> tuple[float, float]:
    """How far 100 steps of ``case`` with ``state_dtype`` stray from the same
    steps with float32 state: the largest relative distance between the two
    trajectories, and between the two states after each step."""
    problem = get_problem(case.problem_name)
    hparams = {k: tuple(v) if isinstance(v, list) else v for k, v in case.hparams.items()}

    def run(state_dtype: torch.dtype | None) -> tuple[np.ndarray, list[np.ndarray]]:
        params = [torch.nn.Parameter(torch.tensor(a, dtype=F32)) for a in problem.split(problem.x0)]
        opt = CLASSES[case.optimizer](params, **hparams, state_dtype=state_dtype)
        out, states = [], []
        for t in range(100):
            x = problem.join([p.detach().numpy() for p in params])
            for p, g in zip(params, problem.split(problem.grad(x, t)), strict=True):
                p.grad = torch.tensor(g, dtype=F32)
            opt.step()
            out.append(problem.join([p.detach().numpy() for p in params]))
            states.append(states_of(opt, params))
        return np.array(out), states

    (wide, wide_states), (narrow, narrow_states) = run(None), run(state_dtype)
    trajectory = float((np.linalg.norm(narrow - wide, axis=1) / np.linalg.norm(wide, axis=1)).max())
    return trajectory, relative_state_distance(narrow_states, wide_states)


@pytest.mark.parametrize("case", narrow_state_cases(), ids=lambda c: c.name)
def test_bfloat16_state_follows_float32_state_on_the_conformance_problems(case: Any) -> None:
    trajectory, state = _deviation(case, BF16)
    assert trajectory <= narrow_state_tolerance(case)
    assert state <= stored_state_tolerance(case, eight_bit=False)


def test_stochastic_rounding_is_unbiased_and_nearest_rounding_is_not() -> None:
    # 1 + 2**-9 lies a quarter of the way from 1 to the next bfloat16, 1 + 2**-7:
    # rounded stochastically, a quarter of the values go up and the mean is the
    # value (to 4 standard deviations of the mean of n Bernoulli(1/4) steps);
    # rounded to nearest, every value becomes 1.
    n, value, ulp = 1 << 16, 1 + 2**-9, 2**-7
    src = torch.full((n,), value)
    dst = torch.empty(n, dtype=BF16)
    _state_dtype.stochastic_round_(dst, src, seed=7)
    assert set(dst.float().unique().tolist()) == {1.0, 1 + ulp}
    sigma = ulp * (0.25 * 0.75 / n) ** 0.5
    assert abs(dst.double().mean().item() - value) <= 4 * sigma
    _state_dtype.write_back_(dst, src, seed=7, stochastic=False)
    assert torch.equal(dst, torch.ones(n, dtype=BF16))


def test_stochastic_rounding_keeps_what_bfloat16_holds() -> None:
    src = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 3e38])
    src = src.to(BF16).float()  # each a bfloat16 value (3e38 as its nearest)
    dst = torch.empty(src.shape, dtype=BF16)
    for seed in range(20):
        _state_dtype.stochastic_round_(dst, src, seed)
        torch.testing.assert_close(dst, src.to(BF16), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dtype": torch.int8}, ValueError, r"state_dtype must be None or one of"),
        # A name is not a torch dtype: the allowed ones are written as torch's.
        (
            {"state_dtype": "bfloat16"},
            ValueError,
            r"one of torch\.bfloat16, .*torch\.uint8; received state_dtype='bfloat16'",
        ),
        ({"stochastic_rounding": 1}, TypeError, r"stochastic_rounding must be None or a bool"),
        # True would change nothing where nothing is rounded stochastically.
        (
            {"stochastic_rounding": True},
            ValueError,
            r"received stochastic_rounding=True with state_dtype=None",
        ),
        (
            {"state_dtype": F32, "stochastic_rounding": True},
            ValueError,
            r"applies to a bfloat16 or 8-bit \(uint8\) state_dtype; .*state_dtype=torch\.float32$",
        ),
        ({"state_dtype": BF16, "capturable": True}, ValueError, r"not supported with capturable"),
        (
            {"state_dtype": BF16, "differentiable": True},
            ValueError,
            r"not supported with differentiable",
        ),
        ({"state_dtype": F64}, ValueError, r"wider than a parameter's dtype float32"),
    ],
)
@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_invalid_state_dtype_settings_are_refused(
    cls: type, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        cls(_params(), lr=0.1, **kwargs)


def test_a_state_dtype_of_the_parameters_own_is_the_ordinary_step() -> None:
    params, plain_params = _params(), _params()
    opt = QHAdam(params, lr=1e-2, nus=(0.7, 1.0), state_dtype=F32)
    plain = QHAdam(plain_params, lr=1e-2, nus=(0.7, 1.0))
    _run(opt, params, range(5))
    _run(plain, plain_params, range(5))
    for p, q in zip(params, plain_params, strict=True):
        assert torch.equal(p, q)


def test_the_fused_kernel_and_the_other_paths_draw_the_same_noise() -> None:
    # QHM with momentum 0 stores the gradient itself in its buffer, so the fused
    # CPU kernel's buffer is its stochastic rounding of the gradient; the other
    # paths round with _state_dtype.stochastic_round_. Same seed, same bits.
    # Seeded: the 7 values drawn from torch's global generator made the check
    # depend on the tests run before it in the process.
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(5000, generator=gen) * 1e-3, torch.randn(7, generator=gen)]
    # NaNs the step's arithmetic carries through, to be stored as NaNs.
    grads[0].view(torch.int32)[[100, 200, 300]] = torch.tensor(NAN_PAYLOADS).to(torch.int32)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    opt = QHM(params, lr=0.0, momentum=0.0, nu=0.7, fused=True, state_dtype=BF16)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    for position, (p, g) in enumerate(zip(params, grads, strict=True)):
        want = torch.empty_like(g, dtype=BF16)
        _state_dtype.stochastic_round_(want, g, _state_dtype.rounding_seed(1, 4 * position))
        stored = opt.state[p]["momentum_buffer"]
        assert torch.equal(stored.view(torch.int16), want.view(torch.int16))  # NaNs' bits too
        assert not torch.equal(want, g.to(BF16))  # some values were rounded up
        # ... and both are the rule every backend follows (qhoptim.rounding).
        reference = rounding.stochastic_round_reference(g.numpy(), 1, 4 * position)
        assert torch.equal(want.view(torch.int16), torch.from_numpy(reference.view("int16")))


@pytest.mark.parametrize("kernel", [True, False], ids=["extension", "torch-ops"])
def test_both_roundings_are_the_rule_every_backend_follows(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The working-copy paths round with the fused extension's kernel on CPU, or
    # with torch operations where it cannot be had (and on other devices);
    # both give qhoptim.rounding's bits, slices counted from their start.
    if not kernel:
        monkeypatch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
    monkeypatch.setattr(_state_dtype, "NOISE_VALUES", 1000)
    g = torch.randn(5000, generator=torch.Generator().manual_seed(5)) * 1e-3
    # NaN's bits too: the rule's 0x7FC0, where a conversion wrote its own; and
    # NaNs whose payload fills the dropped half, which the noise must not carry
    # into the sign or the exponent.
    g[[10, 20, 30]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    g.view(torch.int32)[[40, 50, 60]] = torch.tensor(NAN_PAYLOADS).to(torch.int32)
    seed = _state_dtype.rounding_seed(7, 4 * 3 + 1)
    whole = torch.empty_like(g, dtype=BF16)
    _state_dtype.stochastic_round_(whole, g, seed)
    reference = rounding.stochastic_round_reference(g.numpy(), 7, 4 * 3 + 1)
    assert torch.equal(whole.view(torch.int16), torch.from_numpy(reference.view("int16")))
    tail = torch.empty(3000, dtype=BF16)
    _state_dtype.stochastic_round_(tail, g[2000:], seed, start=2000)
    assert torch.equal(tail, whole[2000:])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_the_seeds_of_many_parameters_are_the_rules_seeds(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From VECTOR_SEEDS parameters on, a step's seeds are computed as int64
    # tensors, below it one by one in Python, and where the fused CPU kernel
    # is loaded and the step number is one, by its own hash: each is
    # qhoptim.rounding's seeds, for step numbers and positions past 32 bits too
    # (taken modulo 2**32), and for each number of states a parameter has.
    from qhoptim.torch import _extension

    if kernel:
        _extension.cpu_extension()  # loaded
    else:
        monkeypatch.setattr(_extension, "loaded_cpu_extension", lambda: None)
    mask = (1 << 32) - 1
    n = _state_dtype.VECTOR_SEEDS + 5
    steps = [float(t) for t in range(1, n + 1)]
    steps[3], steps[4] = 2.0**32 + 5, 2.0**40 + 1
    positions = [7 * i for i in range(n)]
    positions[5] = 2**31 + 3  # 4 * position + k passes 2**32
    for states in (1, 2, 3):
        want = [
            [
                int(rounding.rounding_seed(int(t) & mask, rounding.state_index(p, k) & mask))
                for k in range(states)
            ]
            for t, p in zip(steps, positions, strict=True)
        ]
        assert _state_dtype.state_seeds(steps, positions, states) == want
        few = _state_dtype.VECTOR_SEEDS - 1
        assert _state_dtype.state_seeds(steps[:few], positions[:few], states) == want[:few]
        # One step number for every parameter (the usual step), twice: the
        # positions' half of the seeds is kept between calls, and stays as made.
        for t in (steps[4], 9.0):
            want = [
                [
                    int(rounding.rounding_seed(int(t) & mask, rounding.state_index(p, k) & mask))
                    for k in range(states)
                ]
                for p in positions
            ]
            assert _state_dtype.state_seeds([t] * n, positions, states) == want


def test_positions_past_two_to_the_32_draw_the_same_noise_in_both_roundings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tensor of more than 2**32 values counts its positions past 32 bits,
    # folded (hash32): the kernel's loops count keys in 32 bits below 2**32 and
    # fold each one past it; a slice across the boundary takes both. Both
    # roundings give the same bits there, which are not those of the
    # positions' low 32 bits alone (the fold is not a no-op).
    g = torch.randn(5000, generator=torch.Generator().manual_seed(8)) * 1e-3
    seed = _state_dtype.rounding_seed(2, 5)
    start = 2**32 - 2500
    kernel_out, torch_out = torch.empty_like(g, dtype=BF16), torch.empty_like(g, dtype=BF16)
    low_bits = torch.empty(2500, dtype=BF16)
    _state_dtype.stochastic_round_(kernel_out, g, seed, start=start)
    _state_dtype.stochastic_round_(low_bits, g[2500:], seed, start=0)
    monkeypatch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
    _state_dtype.stochastic_round_(torch_out, g, seed, start=start)
    assert torch.equal(kernel_out, torch_out)
    assert not torch.equal(kernel_out[2500:], low_bits)


@pytest.mark.parametrize("high", [False, True], ids=["low-half", "high-half"])
def test_8_bit_noise_past_two_to_the_32_is_folded_alike_in_the_kernel_and_torch_operations(
    high: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 8-bit encoding's hashes (block_hashes in the kernel, hash32 in torch
    # operations) fold positions past 2**32 as bfloat16's do, in both halves
    # of the hash: the same bytes for blocks across and past the boundary,
    # which are not those of the positions' low 32 bits alone.
    n = 3000
    x = torch.randn(n, generator=torch.Generator().manual_seed(12)) * 1e-3
    start = 2**32 - 1024  # four blocks below the boundary, the rest past it

    def encoded(at: int) -> torch.Tensor:
        packed = torch.zeros(_state_dtype.packed_numel(n), dtype=U8)
        _state_dtype.quantize_(_state_dtype._Packed(packed, n, 0, n), x, False, 33, True, at, high)
        return packed

    kernel = encoded(start)
    monkeypatch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
    assert torch.equal(kernel, encoded(start))
    # Below the boundary the rule's NumPy statement, whose uint32 positions
    # wrap past it: there the fold draws other noise.
    codes, _ = rounding.eight_bit_encode_reference(x.numpy(), False, 33, True, start, high)
    stored = kernel[4 * -(-n // 256) :].numpy()
    assert np.array_equal(stored[:1024], codes[:1024])
    assert not np.array_equal(stored[1024:], codes[1024:])


def test_a_tensor_larger_than_a_chunk_steps_in_slices_as_a_whole(monkeypatch: Any) -> None:
    # Working copies are made a slice at a time for tensors larger than a chunk;
    # the slices take the whole tensor's step (one count, the noise of the same
    # elements), so slicing changes nothing. (On CPU the C++ kernel steps narrow
    # state without working copies where it can be built: not here.)
    from qhoptim.torch._optimizer import NarrowStateOptimizer

    monkeypatch.setattr(
        NarrowStateOptimizer, "_narrow_state_in_kernel", staticmethod(lambda *args: False)
    )
    params, sliced_params = _params(), _params()
    whole = QHAdam(params, lr=1e-2, nus=(0.7, 0.9), state_dtype=BF16)
    _run(whole, params, range(4))
    monkeypatch.setattr(_state_dtype, "CHUNK_VALUES", 500)
    monkeypatch.setattr(_state_dtype, "NOISE_VALUES", 300)
    sliced = QHAdam(sliced_params, lr=1e-2, nus=(0.7, 0.9), state_dtype=BF16)
    _run(sliced, sliced_params, range(4))
    for p, q in zip(params, sliced_params, strict=True):
        assert torch.equal(p, q)
        assert float(sliced.state[q]["step"]) == 4
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(whole.state[p][k], sliced.state[q][k])


# --------------------------------------------------------------- 8-bit state
U8 = torch.uint8


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_the_8_bit_state_takes_a_byte_and_a_share_of_a_scale_per_value(
    cls: type, kwargs: dict[str, Any], path: str
) -> None:
    params = _params()
    opt = cls(params, **kwargs, **PATHS[path], state_dtype=U8)
    _run(opt, params, range(3))
    numel = sum(p.numel() for p in params)
    state_bytes = sum(s[k].numel() for s in opt.state.values() for k in STATE_KEYS if k in s)
    for p in params:
        for k in STATE_KEYS:
            if k in opt.state[p]:
                assert opt.state[p][k].dtype == U8
                assert opt.state[p][k].numel() == _state_dtype.packed_numel(p.numel())
    if cls is QHAdam:  # two moments: at most 2.1 bytes per parameter
        assert state_bytes / numel <= 2.1
        assert state_bytes == 2 * sum(p.numel() + 4 * -(-p.numel() // 256) for p in params)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_an_8_bit_state_resumes_bit_for_bit(cls: type, kwargs: dict[str, Any]) -> None:
    params = _params()
    opt = cls(params, **kwargs, state_dtype=U8)
    _run(opt, params, range(5))
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(copies, **kwargs, state_dtype=U8)
    # torch's load casts every state tensor to the parameter's dtype; the
    # bytes (codes and the scales' bytes) survive that and are cast back.
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, copies, strict=True):
        for k in STATE_KEYS:
            if k in opt.state[p]:
                assert resumed.state[q][k].dtype == U8
                assert torch.equal(resumed.state[q][k], opt.state[p][k])
    _run(opt, params, range(5, 10))
    _run(resumed, copies, range(5, 10))
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


def test_8_bit_rounding_is_unbiased_and_keeps_a_positive_second_moment() -> None:
    # 2**16 copies of a block whose largest value is 1: each value is stored as
    # one of its two neighbouring levels, on average itself (to 6 standard
    # errors of a step of at most 12.5% of the value); a tiny positive value of an
    # unsigned state is stored as the lowest level, never 0.
    n = 256 * 256
    value = torch.full((n,), 0.3)
    value[::256] = 1.0  # each block's scale
    for signed in (True, False):
        packed = torch.zeros(_state_dtype.packed_numel(n), dtype=U8)
        stored = _state_dtype._Packed(packed, n, 0, n)
        _state_dtype.quantize_(stored, value, signed, seed=11, stochastic=True, start=0)
        out = torch.empty(n)
        _state_dtype.dequantize_(out, _state_dtype._Packed(packed, n, 0, n), signed)
        rest = out.view(256, 256)[:, 1:]
        assert len(torch.unique(rest)) == 2
        assert abs(float(rest.mean()) - 0.3) < 6 * 0.125 * 0.3 / 255
    tiny = torch.tensor([1.0] + [1e-30] * 255)
    packed = torch.zeros(_state_dtype.packed_numel(256), dtype=U8)
    _state_dtype.quantize_(_state_dtype._Packed(packed, 256, 0, 256), tiny, False, 3, True, 0)
    out = torch.empty(256)
    _state_dtype.dequantize_(out, _state_dtype._Packed(packed, 256, 0, 256), False)
    assert bool((out[1:] > 0).all())


@pytest.mark.parametrize("case", narrow_state_cases(), ids=lambda c: c.name)
def test_8_bit_state_follows_float32_state_on_the_conformance_problems(case: Any) -> None:
    trajectory, state = _deviation(case, U8)
    assert trajectory <= eight_bit_tolerance(case)
    assert state <= stored_state_tolerance(case, eight_bit=True)


@pytest.mark.parametrize(("dtype", "n"), [(torch.bfloat16, 257), (torch.float16, 2049)])
def test_an_8_bit_state_saved_after_a_load_loads_again(dtype: torch.dtype, n: int) -> None:
    # torch's load casts the state's shape record to the parameter's dtype
    # too, where bfloat16 holds 257 as 256: the record saved next must still
    # be the parameter's shape, or that checkpoint is refused.
    p = torch.nn.Parameter(torch.randn(n).to(dtype))
    opt = QHAdam([p], lr=1e-3, state_dtype=U8)
    p.grad = torch.randn(n).to(dtype)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for _ in range(2):
        q = torch.nn.Parameter(p.detach().clone())
        loaded = QHAdam([q], lr=1e-3, state_dtype=U8)
        loaded.load_state_dict(saved)
        assert loaded.state[q][_state_dtype.PARAM_SHAPE].tolist() == [n]
        saved = copy.deepcopy(loaded.state_dict())


def test_an_8_bit_state_of_the_wrong_size_is_refused_on_load() -> None:
    params = _params()
    opt = QHAdam(params, lr=1e-2, state_dtype=U8)
    _run(opt, params, range(1))
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"][:-1]
    fresh = QHAdam(_params(), lr=1e-2, state_dtype=U8)
    with pytest.raises(ValueError, match=r"the 8-bit state of a parameter of 2112 values"):
        fresh.load_state_dict(saved)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_8_bit_kernel_and_torch_operations_encode_the_same_bytes(
    signed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CPU the C++ extension encodes and decodes an 8-bit state; elsewhere
    # torch operations do, with the same arithmetic: the same bytes and values,
    # for blocks of zeros, non-finite values, subnormals, a partial last block
    # and a slice's offset.
    n = 5 * 256 + 77
    x = torch.randn(n, generator=torch.Generator().manual_seed(9))
    x = x.abs() if not signed else x
    x[256:512] = 0.0
    x[600] = float("nan")
    x[610] = float("inf")
    x[620] = -float("inf") if signed else float("inf")
    x[700:720] *= 1e-12
    x[730] = 1e-40  # a subnormal ratio to its block's scale
    # A block within a factor 4 of float32's overflow: the reciprocal of its
    # scale would be subnormal (rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE).
    x[768:1024] *= 3e38 / x[768:1024].abs().max()
    # A block of a tiny scale (1e-36), where a subnormal magnitude's ratio (1e-3)
    # would be a level but for the rule's flush to zero.
    x[1024:1280] *= 1e-36 / x[1024:1280].abs().max()
    x[1030] = 1e-39
    results = []
    for kernel in (True, False):
        with monkeypatch.context() as patch:
            if not kernel:
                patch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
            for stochastic in (True, False):
                packed = torch.zeros(_state_dtype.packed_numel(n), dtype=U8)
                stored = _state_dtype._Packed(packed, n, 0, n)
                _state_dtype.quantize_(stored, x, signed, 21, stochastic, start=4096)
                out = torch.empty(n)
                _state_dtype.dequantize_(out, _state_dtype._Packed(packed, n, 0, n), signed)
                results.append((packed, out))
    (k_sr, k_out), (k_near, _), (t_sr, t_out), (t_near, _) = results
    assert torch.equal(k_sr, t_sr) and torch.equal(k_near, t_near)
    assert torch.equal(k_out.nan_to_num(7.0), t_out.nan_to_num(7.0))
    # Both are the NumPy statement of the rule every backend follows.
    blocks = -(-n // 256)
    for packed, stochastic in ((k_sr, True), (k_near, False)):
        codes, scales = rounding.eight_bit_encode_reference(x.numpy(), signed, 21, stochastic, 4096)
        assert np.array_equal(packed[4 * blocks :].numpy(), codes)
        assert np.array_equal(packed[: 4 * blocks].view(torch.float32).numpy(), scales)
    k_scales = k_sr[: 4 * blocks].view(torch.float32).numpy()
    decoded = rounding.eight_bit_decode_reference(k_sr[4 * blocks :].numpy(), k_scales, signed)
    assert np.array_equal(np.nan_to_num(decoded, nan=7.0), k_out.nan_to_num(7.0).numpy())
    # The large block reads back as itself (within a level), not as zeros, and
    # its bytes do not depend on a flush-to-zero mode.
    np.testing.assert_allclose(k_out[768:1024].numpy(), x[768:1024].numpy(), rtol=0.125)
    flushing = torch.set_flush_denormal(True)
    try:
        packed = torch.zeros(_state_dtype.packed_numel(n), dtype=U8)
        _state_dtype.quantize_(_state_dtype._Packed(packed, n, 0, n), x, signed, 21, True, 4096)
    finally:
        torch.set_flush_denormal(False)
    assert not flushing or torch.equal(packed, k_sr)
    # A non-finite value keeps to its own coordinate: NaN (signed) or +inf
    # (unsigned, as a float32 second moment holds an overflow); the rest of its
    # block reads back finite, within a level of what was stored.
    special = [600, 610, 620]
    want = float("nan") if signed else float("inf")
    torch.testing.assert_close(k_out[special], torch.full((3,), want), equal_nan=True)
    rest = torch.ones(n, dtype=torch.bool)
    rest[special] = False
    assert bool(k_out[rest].isfinite().all())
    block = slice(512, 768)
    err = (k_out[block] - x[block])[rest[block]].abs().max() / x[block][rest[block]].abs().max()
    assert float(err) <= 0.1
    assert bool((k_out[256:512] == 0).all())


def test_8_bit_bytes_of_values_over_sixty_decades_are_the_rules() -> None:
    # A million values whose blocks' scales span 1e-13 .. 1e13, encoded by
    # the kernel (CPU) and by torch operations: the bytes of the NumPy
    # statement, on every side of every level.
    rng = np.random.default_rng(1)
    n = 1_000_003
    decades = np.exp(rng.uniform(-30, 30, n // 256 + 1)).repeat(256)[:n]
    values = (rng.standard_normal(n) * decades).astype(np.float32)
    blocks = -(-n // 256)
    for signed, x in ((True, values), (False, values * values)):
        codes, scales = rounding.eight_bit_encode_reference(x, signed, 5, True, 77)
        for kernel in (True, False):
            packed = _encoded(x, signed, 5, True, 77, kernel=kernel)
            assert np.array_equal(packed[4 * blocks :].numpy(), codes)
            assert np.array_equal(packed[: 4 * blocks].view(torch.float32).numpy(), scales)


def _encoded(
    x: np.ndarray, signed: bool, seed: int, stochastic: bool, start: int, *, kernel: bool
) -> torch.Tensor:
    """``x`` as a packed 8-bit state, encoded by the C++ kernel (CPU) or, without
    it, by torch operations."""
    with pytest.MonkeyPatch.context() as patch:
        if not kernel:
            patch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
        packed = torch.zeros(_state_dtype.packed_numel(x.size), dtype=U8)
        stored = _state_dtype._Packed(packed, x.size, 0, x.size)
        _state_dtype.quantize_(stored, torch.from_numpy(x), signed, seed, stochastic, start=start)
    return packed


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8_bit_bytes_at_and_beside_every_level_are_the_rules(signed: bool) -> None:
    # Every level itself, the float32 numbers on either side of it and the
    # midpoints between levels, in blocks of scale 1 (ratios are the values):
    # the kernel (which finds levels from a float's exponent and mantissa,
    # where the ladder allows it, else in the table) and torch operations
    # encode the NumPy statement's bytes, and decode every code as it does.
    levels = np.asarray(rounding.eight_bit_levels(signed), np.float32)
    ratios = np.concatenate(
        [
            levels,
            np.nextafter(levels, np.float32(0)),
            np.nextafter(levels, np.float32(2)),
            (levels[:-1] + levels[1:]) / np.float32(2),
        ]
    ).astype(np.float32)
    ratios = ratios[(ratios <= 1) & ((ratios == 0) | (ratios >= rounding.EIGHT_BIT_SMALLEST))]
    per_block = rounding.EIGHT_BIT_BLOCK - 1
    blocks = -(-ratios.size // per_block)
    x = np.zeros((blocks, rounding.EIGHT_BIT_BLOCK), np.float32)
    x[:, 0] = 1.0  # each block's scale
    x.reshape(-1)[np.flatnonzero(np.arange(x.size) % rounding.EIGHT_BIT_BLOCK)[: ratios.size]] = (
        ratios
    )
    x = x.reshape(-1)[: -3 or None]  # a partial last block
    if signed:
        x[1::2] *= -1
    n = x.size
    for stochastic in (True, False):
        codes, scales = rounding.eight_bit_encode_reference(x, signed, 3, stochastic, 11)
        for kernel in (True, False):
            packed = _encoded(x, signed, 3, stochastic, 11, kernel=kernel)
            assert np.array_equal(packed[4 * blocks :].numpy(), codes)
            assert np.array_equal(packed[: 4 * blocks].view(torch.float32).numpy(), scales)
            every_code = (np.arange(n) % 256).astype(np.uint8)
            packed[4 * blocks :] = torch.from_numpy(every_code)
            out = torch.empty(n)
            with pytest.MonkeyPatch.context() as patch:
                if not kernel:
                    patch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
                _state_dtype.dequantize_(out, _state_dtype._Packed(packed, n, 0, n), signed)
            want = rounding.eight_bit_decode_reference(every_code, scales, signed)
            assert np.array_equal(np.nan_to_num(want, nan=7.0), out.nan_to_num(7.0).numpy())


# The C++ kernel's builds besides this CPU's own: torch's capabilities below it
# (ATEN_CPU_CAPABILITY), each with qhoptim's vector width for it.
_CAPABILITIES = {"DEFAULT": "", "AVX2": "avx2", "AVX512": "avx512"}
_CAPABILITY = torch.backends.cpu.get_cpu_capability()
_ORDER = list(_CAPABILITIES)
_BELOW = _ORDER[: _ORDER.index(_CAPABILITY)] if _CAPABILITY in _ORDER else []


@pytest.mark.parametrize("capability", _BELOW)
def test_every_vector_width_of_the_kernel_takes_the_same_steps(
    capability: str, tmp_path: Path
) -> None:
    # The kernel is compiled for the vector width torch finds: AVX-512 and AVX2
    # builds find levels from a float's bits (16 and 8 values at a time),
    # others in the table, one value at a time. This CPU runs its own build
    # above; each narrower one here, in a fresh process (a build on first use),
    # holds to the same bytes at every level and takes the same steps.
    program = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_torch_state_dtype as tests
        from qhoptim.torch import _extension
        assert _extension._vector_width() == {_CAPABILITIES[capability]!r}
        for signed in (True, False):
            tests.test_8_bit_bytes_at_and_beside_every_level_are_the_rules(signed)
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        torch.save(tests.fused_steps(*inputs), {str(tmp_path / "steps.pt")!r})
        """
    )
    # The inputs made here: torch's own sampling differs between vector widths.
    params = _params()
    inputs = ([p.detach() for p in params], [_grads(params, t) for t in range(3)])
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["ATEN_CPU_CAPABILITY"] = capability.lower()
    proc = subprocess.run(
        [sys.executable, "-c", "import torch\n" + program],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # And the same steps, bit for bit: no build contracts a product and a sum
    # into a fused multiply-add (which only some CPUs have).
    theirs, ours = torch.load(tmp_path / "steps.pt"), fused_steps(*inputs)
    assert theirs.keys() == ours.keys()
    for key, tensor in ours.items():
        assert torch.equal(theirs[key], tensor), key


def fused_steps(
    start: list[torch.Tensor], grads: list[list[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Parameters and states after fused steps of QHM and QHAdam(W) from ``start``
    by ``grads`` (one list per step), with float32, bfloat16 and 8-bit state, on
    CPU (the C++ kernel)."""
    out: dict[str, torch.Tensor] = {}
    for cls, kwargs in CONFIGS:
        for state_dtype in (None, torch.bfloat16, U8):
            params = [torch.nn.Parameter(p.clone()) for p in start]
            opt = cls(params, **kwargs, fused=True, state_dtype=state_dtype)
            for step_grads in grads:
                for p, g in zip(params, step_grads, strict=True):
                    p.grad = g.clone()
                opt.step()
            name = f"{cls.__name__} {kwargs} {state_dtype}"
            for i, p in enumerate(params):
                out[f"{name} param {i}"] = p.detach().clone()
                for key, value in opt.state[p].items():
                    if torch.is_tensor(value):
                        out[f"{name} {key} {i}"] = value.clone()
    return out


# ------------------------------------------------------------- reading the state
def _decode_by_hand(packed: torch.Tensor, shape: torch.Size, signed: bool) -> torch.Tensor:
    """The 8-bit layout as docs/torch.md describes it, decoded here: a float32
    scale per block of 256 values, then a code per value (a sign bit where the
    state keeps one), standing for a level of ``rounding.eight_bit_levels``."""
    n = shape.numel()
    blocks = -(-n // rounding.EIGHT_BIT_BLOCK)
    scales = packed[: 4 * blocks].view(torch.float32).repeat_interleave(256)[:n]
    codes = packed[4 * blocks :].to(torch.int64)
    levels = torch.tensor(rounding.eight_bit_levels(signed), dtype=torch.float32)
    value = levels[codes & 127 if signed else codes] * scales
    if signed:
        value = torch.where(codes >= 128, -value, value)
    return value.reshape(shape)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_decoded_state_reads_8_bit_state_as_float32(cls: type, kwargs: dict[str, Any]) -> None:
    params = _params()
    opt = cls(params, **kwargs, state_dtype=U8)
    assert opt.decoded_state(params[0]) == {}  # before the first step
    _run(opt, params, range(4))
    stored = copy.deepcopy(opt.state_dict())
    signed = dict(zip(cls._STATE_LISTS, cls._SIGNED, strict=True))
    for p in params:
        decoded = opt.decoded_state(p)
        assert set(decoded) == {k for k in STATE_KEYS if k in opt.state[p]}
        for key, value in decoded.items():
            assert value.dtype == F32 and value.shape == p.shape
            want = _decode_by_hand(opt.state[p][key], p.shape, signed[key])
            assert torch.equal(value, want), key
    # Reading changes nothing.
    assert all(
        torch.equal(a, b)
        for a, b in zip(_state_tensors(opt.state_dict()), _state_tensors(stored), strict=True)
    )


def _state_tensors(state_dict: dict[str, Any]) -> list[torch.Tensor]:
    return [v for s in state_dict["state"].values() for v in s.values()]


@pytest.mark.parametrize(
    ("param_dtype", "state_dtype", "want"),
    [(F32, BF16, F32), (F32, None, F32), (F64, F32, F64), (F64, BF16, F64), (BF16, None, F32)],
    ids=["bf16-state", "own-state", "f32-state-of-f64", "bf16-state-of-f64", "bf16-param"],
)
def test_decoded_state_widens_and_copies(
    param_dtype: torch.dtype, state_dtype: torch.dtype | None, want: torch.dtype
) -> None:
    p = torch.nn.Parameter(torch.randn(5, 3, dtype=param_dtype))
    opt = QHAdam([p], lr=0.1, amsgrad=True, state_dtype=state_dtype)
    p.grad = torch.randn_like(p)
    opt.step()
    decoded = opt.decoded_state(p)
    assert set(decoded) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    for key, value in decoded.items():
        assert value.dtype == want and value.shape == p.shape
        assert torch.equal(value, opt.state[p][key].to(want))  # widening is exact
        value.add_(1.0)  # a copy: the stored state stays
        assert not torch.equal(value, opt.state[p][key].to(want))


def test_decoded_state_of_a_tensor_the_optimizer_does_not_hold_is_a_key_error() -> None:
    opt = QHM(_params(), lr=0.1)
    with pytest.raises(KeyError, match="not a parameter of this optimizer"):
        opt.decoded_state(torch.zeros(3))


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_the_fused_8_bit_kernel_steps_as_the_working_copies_do(
    cls: type, kwargs: dict[str, Any], monkeypatch: Any
) -> None:
    # fused=True steps an 8-bit state in one pass, block by block: the bytes of
    # decoding the whole state, stepping it with the float32 kernel and
    # encoding it back, which the other paths do on working copies.
    shapes = [(64, 33), (300,), (1,), (2, 256)]  # blocks whole, partial, single

    def run(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = cls(params, **kwargs, fused=True, state_dtype=U8)
        for t in range(6):
            for p, g in zip(params, _grads(params, t), strict=True):
                p.grad = g
            if t == 3:
                p.grad[0] = float("nan")  # a non-finite value keeps its own code
            opt.step()
        return opt

    def fresh() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(5)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]

    def working_copies_refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fused kernel should step this state")

    with monkeypatch.context() as patch:
        patch.setattr(_state_dtype, "step_with_narrow_state", working_copies_refused)
        fused_params = fresh()
        fused = run(fused_params)
    monkeypatch.setattr(_state_dtype, "in_fused_kernel", lambda *args: False)
    copied_params = fresh()
    copied = run(copied_params)
    for p, q in zip(fused_params, copied_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
        for k in STATE_KEYS:
            if k in fused.state[p]:
                assert torch.equal(fused.state[p][k], copied.state[q][k]), k


@pytest.mark.parametrize("path", ["kernel", "working copies", "torch operations"])
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_each_8_bit_state_is_stored_by_the_rule_with_the_noise_it_names(
    cls: type, kwargs: dict[str, Any], path: str, monkeypatch: Any
) -> None:
    # Each step's new 8-bit state is the float32 state stepped from the state
    # as read, stored by the rule every backend follows with the noise
    # rounding.eight_bit_noise_source names: QHAdam's second moment the high
    # halves of its first moment's hashes, every other state its own seed's
    # low halves. On each CPU path: the fused kernel, working copies encoded
    # in C++, working copies encoded by torch operations.
    if path != "kernel":
        monkeypatch.setattr(_state_dtype, "in_fused_kernel", lambda *args: False)
    if path == "torch operations":
        monkeypatch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
    gen = torch.Generator().manual_seed(9)
    shapes = [(300,), (2, 256), (7,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    narrow = cls(params, **kwargs, fused=True, state_dtype=U8)
    keys = cls._STATE_LISTS
    signed = dict(zip(keys, cls._SIGNED, strict=True))
    other_rule_differs = False
    for step in range(1, 4):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        wide = cls(copies, **kwargs, fused=True)
        if step > 1:  # the 8-bit state as read (decoded exactly by the load)
            wide.load_state_dict(copy.deepcopy(narrow.state_dict()))
        for p, q, g in zip(params, copies, _grads(params, step), strict=True):
            p.grad, q.grad = g, g.clone()
        narrow.step()
        wide.step()
        for position, (p, q) in enumerate(zip(params, copies, strict=True)):
            assert torch.equal(p, q)
            for k, key in enumerate(keys):
                if key not in narrow.state[p]:
                    continue
                value = wide.state[q][key].numpy()
                stored = narrow.state[p][key].numpy()
                blocks = -(-value.size // 256)
                source, high = rounding.eight_bit_noise_source(k)
                seed = rounding.rounding_seed(step, rounding.state_index(position, source))
                codes, scales = rounding.eight_bit_encode_reference(
                    value, signed[key], seed, True, high=high
                )
                assert np.array_equal(stored[4 * blocks :], codes), (key, step)
                assert np.array_equal(stored[: 4 * blocks].view(np.float32), scales)
                if high:  # the state's own seed would have stored other codes
                    own = rounding.rounding_seed(step, rounding.state_index(position, k))
                    other, _ = rounding.eight_bit_encode_reference(value, False, own, True)
                    other_rule_differs |= not np.array_equal(other, codes)
    assert other_rule_differs == ("exp_avg_sq" in keys)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_the_fused_8_bit_kernel_finds_the_rules_scale_of_every_kind_of_block(
    cls: type, kwargs: dict[str, Any], monkeypatch: Any
) -> None:
    # The kernel finds each block's scale from its largest magnitude as it
    # steps it; the rule's scale is the largest finite, normal magnitude. Four
    # blocks: ordinary values; subnormal ones only (scale 0, the rule's flush);
    # an infinite gradient among ordinary ones (its own code, the others'
    # scale); and a partial last block.
    n = 3 * 256 + 40
    subnormal, infinite = slice(256, 512), 600

    def run(fused: bool) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(3)
        param = torch.nn.Parameter(torch.randn(n, generator=gen))
        with torch.no_grad():
            param[subnormal] = 0.0  # no weight decay's term in the gradient
        grad = torch.randn(n, generator=gen)
        grad[subnormal] *= 1e-40
        grad[infinite] = float("inf")
        param.grad = grad
        opt = cls([param], **kwargs, fused=True, state_dtype=U8)
        if not fused:
            monkeypatch.setattr(_state_dtype, "in_fused_kernel", lambda *args: False)
        opt.step()
        monkeypatch.undo()
        return opt, param

    fused, p = run(True)
    copied, q = run(False)
    blocks = -(-n // 256)
    for k in STATE_KEYS:
        if k in fused.state[p]:
            assert torch.equal(fused.state[p][k], copied.state[q][k]), k
            scales = fused.state[p][k][: 4 * blocks].view(torch.float32)
            assert float(scales[1]) == 0.0, k
            decoded = fused.decoded_state(p)[k]
            assert bool(decoded[infinite].isinf() | decoded[infinite].isnan()), k
            rest = torch.cat([decoded[512:infinite], decoded[infinite + 1 : 768]])
            assert float(scales[2]) > 0 and bool(rest.isfinite().all()), k


@pytest.mark.parametrize("state_dtype", [BF16, U8], ids=["bfloat16", "8-bit"])
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize(
    "flags", [{"foreach": True}, {"foreach": False}], ids=["foreach", "per-tensor"]
)
def test_every_cpu_path_steps_narrow_state_in_the_kernel(
    cls: type,
    kwargs: dict[str, Any],
    flags: dict[str, bool],
    state_dtype: torch.dtype,
    monkeypatch: Any,
) -> None:
    # On CPU a narrow state steps in the fused C++ kernel's one pass whatever the
    # path flags (no float32 working copies): fused=True's steps, bit for bit.
    fused_params = _params()
    _run(cls(fused_params, **kwargs, fused=True, state_dtype=state_dtype), fused_params, range(4))

    def working_copies_refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the kernel should step this state")

    monkeypatch.setattr(_state_dtype, "step_with_narrow_state", working_copies_refused)
    params = _params()
    opt = cls(params, **kwargs, **flags, state_dtype=state_dtype)
    _run(opt, params, range(4))
    for p, q in zip(fused_params, params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_an_8_bit_state_of_16_bit_parameters_decays_as_in_float32(
    cls: type, fused: bool, param_dtype: torch.dtype
) -> None:
    # In bfloat16, 0.999 * v rounds back to v: a state stepped in the
    # parameters' dtype would never decay. After a gradient of ones and a
    # thousand of zeros the rule's averages are the first step's times
    # beta ** 1000 (stochastic rounding keeps the mean of 4,096 values).
    beta = 0.999
    kwargs = {"momentum": beta} if cls is QHM else {"betas": (beta, beta)}
    p = torch.nn.Parameter(torch.zeros(4096, dtype=param_dtype))
    opt = cls([p], lr=1e-3, state_dtype=torch.uint8, fused=fused, **kwargs)
    p.grad = torch.ones_like(p)
    opt.step()
    first = {k: v.double().mean().item() for k, v in opt.decoded_state(p).items() if k != "step"}
    for _ in range(1000):
        p.grad = torch.zeros_like(p)
        opt.step()
    later = {k: v.double().mean().item() for k, v in opt.decoded_state(p).items() if k != "step"}
    for k, value in first.items():
        assert later[k] / value == pytest.approx(beta**1000, rel=0.01), k


@pytest.mark.parametrize(
    ("param_dtype", "state_dtype"),
    [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)],
    ids=["float16-of-bfloat16", "bfloat16-of-float16"],
)
def test_a_16_bit_state_of_other_16_bit_parameters_is_refused(
    param_dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    # It stepped in the parameters' 16 bits, where 0.999 * v rounds back to v:
    # QHM's buffer never decayed.
    with pytest.raises(ValueError, match=r"is as wide as a parameter's dtype"):
        QHM(
            [torch.nn.Parameter(torch.zeros(3, dtype=param_dtype))], lr=0.1, state_dtype=state_dtype
        )
