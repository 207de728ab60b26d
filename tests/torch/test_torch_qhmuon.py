"""``qhoptim.torch.QHMuon``: torch's Muon bit for bit at ``nu = momentum`` and
``nu = 1``, the float64 reference elsewhere, checkpoints, narrow state, and bad input."""

from __future__ import annotations

import copy
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
from qhoptim import convert, reference
from qhoptim.torch import QHAdam, QHMuon, _state_dtype, qhmuon

F64 = torch.float64
SHAPES = [(6, 4), (4, 6), (5, 5)]


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]


def _grads(steps: int, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES] for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: Any) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_equals_torch_muon_bit_for_bit(
    nesterov: bool, adjust_lr_fn: str | None, device: str
) -> None:
    grads = [[g.to(device) for g in step] for step in _grads(50)]
    muon_params = [p.detach().to(device).requires_grad_() for p in _params()]
    qh_params = [p.detach().to(device).requires_grad_() for p in _params()]
    settings = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": adjust_lr_fn}
    muon = torch.optim.Muon(muon_params, momentum=0.9, nesterov=nesterov, **settings)
    converted = convert.from_muon(0.9, nesterov=nesterov)
    qh = QHMuon.from_params(qh_params, converted, **settings)
    _run(muon, muon_params, grads)
    _run(qh, qh_params, grads)
    for want, got in zip(muon_params, qh_params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for want, got in zip(muon_params, qh_params, strict=True):
        torch.testing.assert_close(
            qh.state[got]["momentum_buffer"], muon.state[want]["momentum_buffer"], rtol=0, atol=0
        )


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.9, "nu": 0.7},
        {"momentum": 0.999, "nu": 1.3, "weight_decay": 0.05},
        {"momentum": 0.5, "nu": 0.0},
        {"momentum": 0.9, "nu": -0.2, "adjust_lr_fn": "match_rms_adamw"},
    ],
)
def test_float64_follows_the_reference(settings: dict[str, Any]) -> None:
    lr, steps = 0.02, 40
    params = _params(F64)
    start = [p.detach().numpy().copy() for p in params]
    grads = _grads(steps, F64)
    opt = QHMuon(params, lr=lr, ns_dtype=F64, **{"weight_decay": 0.0, **settings})
    _run(opt, params, grads)
    ref = reference.QHMuon(lr=lr, **{"weight_decay": 0.0, **settings})
    for i, theta in enumerate(start):
        state = ref.init(theta)
        for step_grads in grads:
            theta, state = ref.step(theta, step_grads[i].numpy(), state)
        np.testing.assert_allclose(params[i].detach().numpy(), theta, rtol=1e-12, atol=1e-13)


def test_checkpoint_resumes_bit_for_bit() -> None:
    grads = _grads(10)
    params = _params()
    opt = QHMuon(params, lr=0.02, momentum=0.9, nu=0.7)
    _run(opt, params, grads)

    resumed_params = _params()
    first = QHMuon(resumed_params, lr=0.02, momentum=0.9, nu=0.7)
    _run(first, resumed_params, grads[:5])
    saved = copy.deepcopy(first.state_dict())
    second = QHMuon(resumed_params, lr=0.5, momentum=0.5, nu=0.1)  # the checkpoint's win
    second.load_state_dict(saved)
    _run(second, resumed_params, grads[5:])
    for want, got in zip(params, resumed_params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_maximize_is_minimizing_the_negative() -> None:
    grads = _grads(5)
    up, down = _params(), _params()
    _run(QHMuon(up, lr=0.02, nu=0.7, maximize=True), up, grads)
    _run(QHMuon(down, lr=0.02, nu=0.7), down, [[-g for g in gs] for gs in grads])
    for a, b in zip(up, down, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tensor_lr_and_scheduler_and_frozen_parameters() -> None:
    grads = _grads(6)
    a, b = _params(), _params()
    frozen = torch.randn(3, 3, requires_grad=True)
    opt_a = QHMuon([*a, frozen], lr=torch.tensor(0.02), nu=0.7)
    opt_b = QHMuon(b, lr=0.02, nu=0.7)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    before = frozen.detach().clone()
    for step_grads in grads:
        _run(opt_a, a, [step_grads])
        _run(opt_b, b, [step_grads])
        sched_a.step()
        sched_b.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert torch.equal(frozen, before) and frozen not in opt_a.state


def test_functional_form_is_the_step() -> None:
    grads = _grads(3)
    a, b = _params(), _params()
    opt = QHMuon(a, lr=0.02, nu=0.7, weight_decay=0.0)
    _run(opt, a, grads)
    buffers = [torch.zeros_like(p) for p in b]
    with torch.no_grad():
        for step_grads in grads:
            qhmuon(b, step_grads, buffers, lr=0.02, weight_decay=0.0, momentum=0.95, nu=0.7)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_only_matrices_are_taken(shape: tuple[int, ...]) -> None:
    bad = torch.zeros(shape, requires_grad=True)
    with pytest.raises(ValueError, match=r"QHMuon optimizes 2-D parameters only .* shape"):
        QHMuon([bad])
    opt = QHMuon([torch.zeros(2, 2, requires_grad=True)])
    with pytest.raises(ValueError, match="2-D parameters only"):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"momentum": 1.0}, ValueError, r"momentum must be in \[0, 1\); received momentum=1.0"),
        ({"nu": float("inf")}, ValueError, "nu must be a finite real number; received nu=inf"),
        ({"lr": -0.1}, ValueError, r"lr must be in \[0, inf\); received lr=-0.1"),
        ({"ns_steps": 100}, ValueError, r"ns_steps must be in \[0, 100\); received ns_steps=100"),
        ({"adjust_lr_fn": "rms"}, ValueError, "adjust_lr_fn must be one of None, 'original'"),
        ({"ns_dtype": torch.int32}, ValueError, r"ns_dtype must be one of torch\.bfloat16, "),
        ({"maximize": 1}, TypeError, "maximize must be a bool"),
    ],
)
def test_bad_hyperparameters_are_named(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        QHMuon(_params(), **kwargs)


def test_from_params_takes_muon_conversions_only() -> None:
    with pytest.raises(TypeError, match="QHMuonParams"):
        QHMuon.from_params(_params(), convert.from_nesterov(0.1, 0.9))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="QHMuonParams"):
        QHAdam.from_params(_params(), convert.from_muon(0.9))  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0)])
def test_an_empty_matrix_steps_as_nothing(shape: tuple[int, int]) -> None:
    # torch's Muon divides by the column count here; QHMuon steps the others.
    empty = torch.zeros(shape, requires_grad=True)
    other = torch.ones(3, 2, requires_grad=True)
    opt = QHMuon([empty, other], lr=0.1)
    empty.grad, other.grad = torch.zeros(shape), torch.ones(3, 2)
    opt.step()
    assert empty.shape == shape and not torch.equal(other, torch.ones(3, 2))


def test_a_named_parameter_that_is_no_matrix_is_refused_as_an_unnamed_one() -> None:
    # torch's named parameters, ("name", tensor) pairs, as torch's Muon refuses them.
    w, b = torch.ones(4, 3, requires_grad=True), torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"2-D parameters only .* shape \(3,\)"):
        QHMuon([("w", w), ("b", b)], lr=0.1)
    opt = QHMuon([("w", w)], lr=0.1)
    with pytest.raises(ValueError, match=r"2-D parameters only .* shape \(3,\)"):
        opt.add_param_group({"params": [("b", b)]})
    assert len(opt.param_groups) == 1


def test_a_step_with_a_gradient_that_is_no_matrix_changes_nothing() -> None:
    # A parameter made 1-D after construction (its .data replaced): the step
    # refuses its gradient before any parameter moves or has state.
    w, v = torch.ones(4, 3, requires_grad=True), torch.ones(2, 2, requires_grad=True)
    opt = QHMuon([{"params": [w]}, {"params": [v]}], lr=0.1)
    v.data = torch.ones(5)
    w.grad, v.grad = torch.ones(4, 3), torch.ones(5)
    with pytest.raises(ValueError, match=r"gradients must be matrices; received shape \(5,\)"):
        opt.step()
    assert torch.equal(w, torch.ones(4, 3)) and not opt.state


def test_a_tensor_ns_steps_is_refused_as_other_tensors_are() -> None:
    # Kept in the group, it would be read once and never checked again.
    with pytest.raises(TypeError, match=r"ns_steps must be a Python number"):
        QHMuon(_params(), lr=0.02, ns_steps=torch.tensor(5))


@pytest.mark.parametrize(
    "coefficients",
    [(torch.tensor(3.4445), -4.775, 2.0315), torch.tensor([3.4445, -4.775, 2.0315])],
    ids=["an-element", "the-whole"],
)
def test_tensor_newton_schulz_coefficients_are_refused_as_other_tensors_are(
    coefficients: Any,
) -> None:
    with pytest.raises(TypeError, match=r"ns_coefficients(\[0\])? must be a Python number"):
        QHMuon(_params(), lr=0.02, ns_coefficients=coefficients)


# ------------------------------------------------------------------ state_dtype
BF16, U8 = torch.bfloat16, torch.uint8


@pytest.mark.parametrize("state_dtype", [BF16, U8], ids=["bfloat16", "8-bit"])
def test_the_buffer_is_stored_narrow(state_dtype: torch.dtype) -> None:
    params = _params()
    opt = QHMuon(params, lr=0.02, nu=0.7, state_dtype=state_dtype)
    _run(opt, params, _grads(3))
    for p in params:
        buffer = opt.state[p]["momentum_buffer"]
        assert buffer.dtype == state_dtype
        if state_dtype == U8:  # a byte per value and a float32 scale per block of 256
            assert buffer.numel() == p.numel() + 4 * -(-p.numel() // 256)
        else:
            assert buffer.shape == p.shape
        assert opt.state[p]["step"].item() == 3  # the rounding's seed counts steps


@pytest.mark.parametrize("state_dtype", [BF16, U8], ids=["bfloat16", "8-bit"])
def test_a_narrow_state_resumes_bit_for_bit(state_dtype: torch.dtype) -> None:
    grads = _grads(10)
    params = _params()
    opt = QHMuon(params, lr=0.02, momentum=0.9, nu=0.7, state_dtype=state_dtype)
    _run(opt, params, grads[:5])
    copies = [p.detach().clone().requires_grad_() for p in params]
    resumed = QHMuon(copies, lr=0.02, momentum=0.9, nu=0.7, state_dtype=state_dtype)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for q in copies:
        assert resumed.state[q]["momentum_buffer"].dtype == state_dtype
    _run(opt, params, grads[5:])
    _run(resumed, copies, grads[5:])
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)


def _deviation(case: Any, state_dtype: torch.dtype) -> tuple[float, float]:
    """How far 100 steps of the QHMuon ``case`` with ``state_dtype`` stray from
    the same steps with float32 state (Newton-Schulz in float32 in both): the
    trajectories' largest relative distance, and the buffers'."""
    problem = get_problem(case.problem_name)

    def run(state_dtype: torch.dtype | None) -> tuple[np.ndarray, list[np.ndarray]]:
        params = [torch.tensor(a, dtype=torch.float32) for a in problem.split(problem.x0)]
        settings = {"weight_decay": 0.0, **case.hparams}
        opt = QHMuon(params, **settings, ns_dtype=torch.float32, state_dtype=state_dtype)
        out, states = [], []
        for t in range(100):
            x = problem.join([p.numpy() for p in params])
            for p, g in zip(params, problem.split(problem.grad(x, t)), strict=True):
                p.grad = torch.tensor(g, dtype=torch.float32)
            opt.step()
            out.append(problem.join([p.numpy() for p in params]))
            states.append(
                np.concatenate(
                    [
                        opt.decoded_state(p)["momentum_buffer"].double().numpy().ravel()
                        for p in params
                    ]
                )
            )
        return np.array(out), states

    (wide, wide_states), (narrow, narrow_states) = run(None), run(state_dtype)
    trajectory = float((np.linalg.norm(narrow - wide, axis=1) / np.linalg.norm(wide, axis=1)).max())
    return trajectory, relative_state_distance(narrow_states, wide_states)


# Measured: bfloat16 2.6e-3 at most, 8-bit 1.1e-2 (nu = 0 reads no buffer: 0);
# the buffers: bfloat16 1.6e-2, 8-bit 5.4e-2 (the trajectories alone strayed
# 0.7% with the buffer reset at every step).
@pytest.mark.parametrize("case", narrow_state_cases(("qhmuon",)), ids=lambda c: c.name)
def test_narrow_state_follows_float32_state_on_the_conformance_matrices(case: Any) -> None:
    for dtype, trajectory_limit, eight_bit in (
        (BF16, narrow_state_tolerance(case), False),
        (U8, eight_bit_tolerance(case), True),
    ):
        trajectory, state = _deviation(case, dtype)
        assert trajectory <= trajectory_limit
        assert state <= stored_state_tolerance(case, eight_bit=eight_bit)


def test_a_matrix_larger_than_a_working_copy_chunk_steps_whole(monkeypatch: Any) -> None:
    # QHM and QHAdam step a large tensor's narrow state slice by slice; the
    # orthogonalization takes whole matrices, so QHMuon's never is sliced.
    grads = _grads(3)
    whole = _params()
    _run(QHMuon(whole, lr=0.02, nu=0.7, state_dtype=BF16), whole, grads)
    monkeypatch.setattr(_state_dtype, "CHUNK_VALUES", 7)
    sliced = _params()
    _run(QHMuon(sliced, lr=0.02, nu=0.7, state_dtype=BF16), sliced, grads)
    for p, q in zip(whole, sliced, strict=True):
        assert torch.equal(p, q)


def test_a_float32_checkpoint_loads_into_8_bit_state_and_reads_back() -> None:
    grads = _grads(4)
    params = _params()
    wide = QHMuon(params, lr=0.02, nu=0.7)
    _run(wide, params, grads)
    copies = [p.detach().clone().requires_grad_() for p in params]
    narrow = QHMuon(copies, lr=0.02, nu=0.7, state_dtype=U8)
    narrow.load_state_dict(copy.deepcopy(wide.state_dict()))
    for p, q in zip(params, copies, strict=True):
        assert narrow.state[q]["momentum_buffer"].dtype == U8
        buffer = wide.state[p]["momentum_buffer"]
        decoded = narrow.decoded_state(q)["momentum_buffer"]
        assert decoded.dtype == torch.float32 and decoded.shape == p.shape
        # the nearest of 256 levels per block, neighbours at most 12.5% apart:
        # within 6.25% of a value, and so of the block's scale
        scale = buffer.abs().max()
        assert float((decoded - buffer).abs().max()) <= 0.0625 * float(scale)
    _run(narrow, copies, grads)  # and it steps on


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"state_dtype": torch.int32}, "state_dtype must be"),
        ({"state_dtype": BF16, "stochastic_rounding": 1}, "stochastic_rounding must be"),
    ],
)
def test_bad_state_settings_are_named(settings: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        QHMuon(_params(), lr=0.02, **settings)


def test_a_state_dtype_wider_than_the_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="state_dtype"):
        QHMuon(_params(torch.bfloat16), lr=0.02, state_dtype=torch.float32)


@pytest.mark.parametrize("scale", [1e-8, 1e3])
def test_a_float16_orthogonalization_keeps_the_step_of_small_and_large_gradients(
    scale: float,
) -> None:
    # Cast to float16 before the norm, the step was zero (or NaN): the squared
    # norm overflowed float16, or the entries underflowed.
    def first_update(ns_dtype: torch.dtype) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(64, 64))
        p.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * scale
        QHMuon([p], lr=1.0, ns_dtype=ns_dtype).step()
        return p.detach()

    want, got = first_update(torch.float32), first_update(torch.float16)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * want.abs().max().item())
