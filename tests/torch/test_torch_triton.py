"""``fused=True`` through the Triton kernels: CUDA tensors, or CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, the ``triton`` nox session).

What the Triton path adds to ``test_torch_fused.py``'s checks (which that
session runs through the same kernels): one launch per device and dtype and
nothing else on the device, tables reused while the tensors stay put,
coefficients per tensor where step counts differ, the capturable path's
device coefficients, many small and empty tensors, and host coefficients beyond
float32's range.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import numpy as np
import pytest
import torch
from qh_torch_testing import assert_trajectories_close, random_grads, reference_trajectory

from qhoptim import rounding
from qhoptim.torch import QHM, QHAdam, QHAdamW

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
if torch.cuda.is_available() and HAS_TRITON:
    DEVICE = "cuda"
elif INTERPRETED and HAS_TRITON:
    DEVICE = "cpu"
else:
    DEVICE = None
pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs CUDA, or Triton's interpreter (TRITON_INTERPRET=1)"
)

F32, F64 = torch.float32, torch.float64
CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.5, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.1}),
    (QHM, {"lr": 0.5, "nu": 1.3, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (QHAdam, {"lr": 0.01, "nus": (0.7, 1.0), "betas": (0.995, 0.999)}),
    (QHAdam, {"lr": 0.01, "nus": (0.8, 0.7), "weight_decay": 0.1, "maximize": True}),
    (QHAdamW, {"lr": 0.01, "nus": (0.7, 0.0), "weight_decay": 0.1}),
    (QHAdam, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.8, 0.6), "amsgrad": True}),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(CONFIGS)]
ADAM = [i for i, (cls, _) in enumerate(CONFIGS) if cls is not QHM]


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype = F64) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(DEVICE)) for s in shapes
    ]


def _run(opt: Any, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[Any]:
    out = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.to(p.device, p.dtype).clone()
        opt.step()
        out.append([p.detach().cpu().numpy().copy() for p in params])
    return out


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each Triton launch's kernel."""
    from qhoptim.torch import _triton

    calls: list[str] = []
    original = _triton._launch

    def launch(kernel: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(kernel.__name__ if hasattr(kernel, "__name__") else str(kernel))
        original(kernel, *args, **kwargs)

    monkeypatch.setattr(_triton, "_launch", launch)
    return calls


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_one_launch_per_device_and_dtype_and_tables_reused(
    cls: type, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qhoptim.torch import _triton

    shapes = [(4, 3), (7,), (2, 3, 5), (0,), (1,)]
    params = [*_params(shapes, F32), *_params(shapes[:2], F64)]
    opt = cls(params, **kwargs, fused=True)
    grads = [[torch.randn(p.shape, dtype=p.dtype) for p in params] for _ in range(3)]
    _run(opt, params, grads[:1])
    launches = _launches(monkeypatch)
    blocks, addresses = dict(_triton._BLOCKS), dict(_triton._ADDRESSES)
    for step_grads in grads[1:]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad.copy_(g)  # the gradients stay where they are
        opt.step()
    assert len(launches) == 2 * 2  # float32 and float64, each step
    assert _triton._BLOCKS == blocks and _triton._ADDRESSES == addresses


@pytest.mark.parametrize(("cls", "kwargs"), [CONFIGS[0], CONFIGS[5]], ids=[IDS[0], IDS[5]])
def test_a_group_whose_tensors_stay_put_steps_without_regrouping(
    cls: type, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qhoptim.torch import _fused

    shapes = [(4, 3), (7,), (0,), (1,)]
    params = _params(shapes)
    params0 = [p.detach().cpu().clone() for p in params]
    grads = random_grads(shapes, 4)
    opt = cls(params, **kwargs, fused=True)
    got = _run(opt, params, grads[:1])
    groupings: list[int] = []
    original = _fused._groups_with_indices

    def counted(*args: Any, **kw: Any) -> Any:
        groupings.append(1)
        return original(*args, **kw)

    monkeypatch.setattr(_fused, "_groups_with_indices", counted)
    for step_grads in grads[1:]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad.copy_(g.to(p.device))  # the gradients stay where they are
        opt.step()
        got.append([p.detach().cpu().numpy().copy() for p in params])
    assert groupings == []
    want = reference_trajectory(cls, kwargs, params0, grads, maximize=kwargs.get("maximize", False))
    assert_trajectories_close(got, want, rtol=1e-12)


@pytest.mark.parametrize(("cls", "kwargs"), [CONFIGS[0], CONFIGS[2]], ids=[IDS[0], IDS[2]])
def test_a_parameter_changed_at_its_address_is_stepped_as_it_now_is(
    cls: type, kwargs: dict[str, Any]
) -> None:
    # Set to another view of its memory, a parameter keeps its address: the
    # layout of the step before no longer fits it (strides, or size), and the
    # step finds that out rather than reading the memory as it was laid out.
    runs = []
    for impl in ({"fused": True}, {"foreach": True}):
        gen = torch.Generator().manual_seed(1)
        params = _params([(3, 3), (5,)])
        opt = cls(params, **kwargs, **impl)
        for p in params:
            p.grad = torch.zeros_like(p)
        for step in range(4):
            if step == 2:
                params[0].data = params[0].data.t()  # same address, transposed
            for p in params:  # the gradients stay where they are
                p.grad.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            opt.step()
        runs.append([p.detach().cpu().clone() for p in params])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)

    params, opt = _stepped_twice(cls, kwargs)
    params[0].data = params[0].data[:2]  # same address, fewer values (as its gradient)
    params[0].grad = params[0].grad[:2]
    with pytest.raises(RuntimeError, match="number of elements"):
        opt.step()

    # A state of another size at its old address (as a checkpoint's state that
    # the allocator placed where the state it replaces had been).
    params, opt = _stepped_twice(cls, kwargs)
    state = opt.state[params[0]]
    name = "momentum_buffer" if "momentum_buffer" in state else "exp_avg"
    state[name].data = state[name].data[:2]
    with pytest.raises(RuntimeError, match="number of elements"):
        opt.step()


def _stepped_twice(cls: type, kwargs: dict[str, Any]) -> tuple[list[torch.nn.Parameter], Any]:
    """Two parameters and a fused optimizer that has stepped them twice (its
    layout kept), their gradients in place."""
    params = _params([(4,), (5,)])
    opt = cls(params, **kwargs, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    return params, opt


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_many_small_and_empty_tensors_follow_the_reference(
    cls: type, kwargs: dict[str, Any]
) -> None:
    # 60 tensors of 0 to 4 values and one of several blocks: one launch, whose
    # blocks' table maps each program to its tensor. (Nothing depends on the
    # count; under Triton's interpreter each program costs tens of milliseconds.)
    shapes = [(i % 5,) for i in range(60)] + [(2500,)]
    params = _params(shapes)
    params0 = [p.detach().cpu().clone() for p in params]
    grads = random_grads(shapes, 4)
    got = _run(cls(params, **kwargs, fused=True), params, grads)
    want = reference_trajectory(cls, kwargs, params0, grads, maximize=kwargs.get("maximize", False))
    assert_trajectories_close(got, want, rtol=1e-12)


@pytest.mark.parametrize(("cls", "kwargs"), [CONFIGS[i] for i in ADAM], ids=[IDS[i] for i in ADAM])
def test_step_counts_that_differ_take_a_row_each(cls: type, kwargs: dict[str, Any]) -> None:
    # A parameter without a gradient misses a step: its count falls behind,
    # and its coefficients differ from the others' (one row per tensor).
    shapes = [(3, 2), (5,), (4,)]
    grads = random_grads(shapes, 6)
    for t in (1, 3):
        grads[t][1] = None  # type: ignore[call-overload]
    runs = []
    for impl in ({"fused": True}, {"foreach": True}):
        params = _params(shapes)
        runs.append(_run(cls(params, **kwargs, **impl), params, grads))
    for a_step, b_step in zip(*runs, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-13, atol=0)


@pytest.mark.parametrize(("cls", "kwargs"), [CONFIGS[i] for i in ADAM], ids=[IDS[i] for i in ADAM])
@pytest.mark.parametrize("lr_on_device", [False, True], ids=["lr-number", "lr-tensor"])
def test_capturable_steps_follow_the_reference(
    cls: type, kwargs: dict[str, Any], lr_on_device: bool
) -> None:
    # Step counts on the device, coefficients evaluated there from them.
    shapes = [(4, 3), (7,), (0,)]
    params = _params(shapes)
    params0 = [p.detach().cpu().clone() for p in params]
    grads = random_grads(shapes, 6)
    lr = torch.tensor(kwargs["lr"], dtype=F64, device=DEVICE) if lr_on_device else kwargs["lr"]
    opt = cls(params, **{**kwargs, "lr": lr}, fused=True, capturable=True)
    got = _run(opt, params, grads)
    for p in params:
        assert opt.state[p]["step"].device == p.device
    want = reference_trajectory(cls, kwargs, params0, grads, maximize=kwargs.get("maximize", False))
    assert_trajectories_close(got, want, rtol=1e-12)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("capturable", [False, True])
def test_a_float32_tensor_lr_folds_at_the_parameters_precision(
    cls: type, kwargs: dict[str, Any], capturable: bool
) -> None:
    # float64 parameters: the coefficients (the decoupled decay's factor too)
    # are folded from the float32 lr's value in float64, not in float32.
    shapes = [(4, 3), (5,)]
    params = _params(shapes)
    params0 = [p.detach().cpu().clone() for p in params]
    grads = random_grads(shapes, 6)
    lr = torch.tensor(kwargs["lr"], dtype=F32, device=DEVICE)
    opt = cls(params, **{**kwargs, "lr": lr}, fused=True, capturable=capturable)
    got = _run(opt, params, grads)
    want = reference_trajectory(
        cls, {**kwargs, "lr": float(lr)}, params0, grads, maximize=kwargs.get("maximize", False)
    )
    assert_trajectories_close(got, want, rtol=1e-12)


@pytest.mark.parametrize(("cls", "kwargs"), [CONFIGS[i] for i in ADAM], ids=[IDS[i] for i in ADAM])
@pytest.mark.parametrize("capturable", [False, True])
def test_grad_scaler_skips_a_step_with_an_inf_and_leaves_the_counts(
    cls: type, kwargs: dict[str, Any], capturable: bool
) -> None:
    params = _params([(4,), (3,)], F32)
    opt = cls(params, **kwargs, fused=True, capturable=capturable)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**4)
    for t in range(3):
        for p in params:
            p.grad = scaler.scale(torch.full_like(p, 0.5))
        if t == 1:
            params[0].grad[0] = torch.inf
            before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        if t == 1:
            for p, b in zip(params, before, strict=True):
                torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 2.0]


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_coefficients_beyond_float32_complete_the_step_as_foreach(
    cls: type, kwargs: dict[str, Any]
) -> None:
    # lr * nu = 1e308 overflows float32: the launch's scalar is inf, as IEEE
    # arithmetic rounds it (and as the multi-tensor kernels' arithmetic gives).
    runs = []
    for impl in ({"fused": True}, {"foreach": True}):
        params = _params([(3,), (2, 2)], F32)
        opt = cls(params, **{**kwargs, "lr": 1e308}, **impl)
        runs.append(_run(opt, params, random_grads([(3,), (2, 2)], 1)))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), equal_nan=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA kernels (a GPU)")
@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_a_step_runs_one_kernel_per_device_and_dtype_on_cuda(
    cls: type, kwargs: dict[str, Any]
) -> None:
    params = [*_params([(64, 3), (5,)], F32), *_params([(7,)], torch.bfloat16)]
    opt = cls(params, **kwargs, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # warm: tables built, kernels compiled
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, [e.name for e in kernels]  # float32 and bfloat16


def _stored_by_the_rule(
    value: torch.Tensor, state_dtype: torch.dtype, signed: bool, step: int, position: int, k: int
) -> np.ndarray:
    """The bytes ``value`` (float32) is stored as after ``step``, state ``k`` of
    the parameter at ``position``: qhoptim.rounding's NumPy statements of the
    bfloat16 and 8-bit rules (an 8-bit state's noise the one
    rounding.eight_bit_noise_source names)."""
    x = value.detach().cpu().numpy()
    if state_dtype == torch.bfloat16:
        return rounding.stochastic_round_reference(x, step, rounding.state_index(position, k)).view(
            np.uint8
        )
    source, high = rounding.eight_bit_noise_source(k)
    seed = rounding.rounding_seed(step, rounding.state_index(position, source))
    codes, scales = rounding.eight_bit_encode_reference(x, signed, seed, True, high=high)
    return np.concatenate([scales.view(np.uint8), codes])


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.uint8], ids=["bfloat16", "8-bit"])
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_a_narrow_state_steps_in_the_kernel_and_rounds_by_the_rule(
    cls: type, kwargs: dict[str, Any], state_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fused=True reads and writes a bfloat16 or 8-bit state in the kernel's one
    # pass, no float32 working copies: each step is the float32-state kernel's
    # step from the state as read (the parameters bit for bit), its new state
    # stored by the rule every backend follows, with the state's seed.
    from qhoptim.torch import _state_dtype

    def no_working_copies(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the narrow state stepped on float32 working copies")

    monkeypatch.setattr(_state_dtype, "step_with_narrow_state", no_working_copies)
    shapes = [(33, 5), (1000,), (7,), (3000,)]  # partial blocks of 256 and of 1024
    params = _params(shapes, F32)
    narrow = cls(params, **kwargs, fused=True, state_dtype=state_dtype)
    signed = dict(zip(cls._STATE_LISTS, cls._SIGNED, strict=True))
    for step, grads in enumerate(random_grads(shapes, 4, F32, seed=3), start=1):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        wide = cls(copies, **kwargs, fused=True)
        if step > 1:  # the narrow state as read (widened or decoded exactly by the load)
            wide.load_state_dict(copy.deepcopy(narrow.state_dict()))
        for p, q, g in zip(params, copies, grads, strict=True):
            p.grad, q.grad = g.to(DEVICE), g.to(DEVICE).clone()
        narrow.step()
        wide.step()
        for position, (p, q) in enumerate(zip(params, copies, strict=True)):
            assert torch.equal(p, q)
            for k, key in enumerate(cls._STATE_LISTS):
                if key not in narrow.state[p]:
                    continue
                stored = narrow.state[p][key]
                assert stored.dtype == state_dtype
                value = wide.state[q][key]
                want = _stored_by_the_rule(value, state_dtype, signed[key], step, position, k)
                assert np.array_equal(stored.cpu().contiguous().view(torch.uint8).numpy(), want)


def test_an_8_bit_block_near_float32s_overflow_is_stored_by_the_rule() -> None:
    # QHM with momentum 0 stores the gradient itself: a block whose scale is
    # above 2**126 (its reciprocal subnormal, rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE)
    # beside an ordinary one, encoded as the NumPy statement does.
    g = torch.randn(512, generator=torch.Generator().manual_seed(5))
    g[256:] *= 3e38 / g[256:].abs().max()
    p = torch.nn.Parameter(torch.zeros(512, device=DEVICE))
    opt = QHM([p], lr=0.0, momentum=0.0, nu=1.0, fused=True, state_dtype=torch.uint8)
    p.grad = g.to(DEVICE)
    opt.step()
    stored = opt.state[p]["momentum_buffer"].cpu().contiguous().view(torch.uint8).numpy()
    assert np.array_equal(stored, _stored_by_the_rule(g, torch.uint8, True, 1, 0, 0))


def test_a_nan_whatever_its_payload_is_stored_as_a_nan_by_the_rule() -> None:
    # QHM with momentum 0 stores the gradient itself. NaNs made from bits fill
    # the half bfloat16 drops; the rule adds them no noise (which carried one
    # into the sign, 0x7FFFFFFF -> -0) and keeps them quiet.
    g = torch.randn(300, generator=torch.Generator().manual_seed(6))
    payloads = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x7FC00000]).to(torch.int32)
    g.view(torch.int32)[[3, 100, 200, 299]] = payloads
    p = torch.nn.Parameter(torch.zeros(300, device=DEVICE))
    opt = QHM([p], lr=0.0, momentum=0.0, nu=1.0, fused=True, state_dtype=torch.bfloat16)
    p.grad = g.to(DEVICE)
    opt.step()
    stored = opt.state[p]["momentum_buffer"].cpu().contiguous()
    assert stored[[3, 100, 200, 299]].isnan().all()
    assert np.array_equal(
        stored.view(torch.uint8).numpy(), _stored_by_the_rule(g, torch.bfloat16, True, 1, 0, 0)
    )


def _nvidia_backend() -> bool:
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not HAS_TRITON or not _nvidia_backend(), reason="needs Triton's CUDA backend")
def test_the_kernels_compile_for_a_gpu_without_fused_multiply_adds() -> None:
    # The interpreter never meets Triton's code generator: each kernel, with
    # every state storage, is compiled for sm_90 (PTX and cubin, no GPU
    # needed) in a process without TRITON_INTERPRET; the launches ask for no
    # FMA contraction, so that a narrow state's bytes are the rules' on a GPU.
    import subprocess
    import sys
    from pathlib import Path

    from qhoptim.torch import _triton

    flags = _triton._flags([torch.zeros(1)], None, None)
    assert flags["enable_fp_fusion"] is False
    script = Path(__file__).with_name("triton_gpu_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("qhm", "qhadam"))]
    assert len(lines) == 6 and all(line.endswith("fma=0") for line in lines), done.stdout


@pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter (TRITON_INTERPRET=1) only")
def test_the_interpreter_patches_triton_language_once_per_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """conftest.py's ``skip_repeated_patching`` is in effect: a launch walks
    ``triton.language`` once (a handful of ``_patch_builtin`` calls), not again at
    each of its kernel's helper calls; the numbers are the rest of this file's."""
    from triton.runtime import interpreter

    from conformance.triton_interpreter import skip_repeated_patching

    assert skip_repeated_patching()
    walks: list[object] = []
    walk = interpreter._patch_builtin
    monkeypatch.setattr(
        interpreter, "_patch_builtin", lambda pkg, *args: (walks.append(pkg), walk(pkg, *args))
    )
    launches = _launches(monkeypatch)
    params = _params([(4,)], F32)
    opt = QHAdam(params, lr=0.01, nus=(0.7, 0.8), fused=True)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert len(launches) == 1
    # lang, lang.tensor, lang.math, tensor_descriptor_base; the kernel's helpers
    # (dozens of calls) add none.
    assert 0 < len(walks) <= 6, len(walks)
