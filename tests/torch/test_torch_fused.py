"""``fused=True``: the one-pass kernels against the multi-tensor ones and the reference.

On CPU the fused kernels are a C++ extension compiled on first use (once per
machine: torch keeps it under TORCH_EXTENSIONS_DIR); on CUDA Triton kernels.
The tests that take ``device`` run on both; the CUDA ones skip without a GPU
(CI), and are run on a GPU machine.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from qh_torch_testing import assert_trajectories_close, random_grads, reference_trajectory

from qhoptim.torch import QHM, QHAdam, QHAdamW

F32, F64 = torch.float32, torch.float64
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
SHAPES = [(4, 3), (7,), (2, 3, 5), (1,)]

CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.5, "momentum": 0.9, "nu": 0.7}),
    (QHM, {"lr": 0.5, "nu": 1.3, "weight_decay": 0.1, "maximize": True}),
    (QHM, {"lr": 0.5, "nu": 0.0, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (QHAdam, {"lr": 0.01, "nus": (0.7, 1.0), "betas": (0.995, 0.999)}),
    (QHAdam, {"lr": 0.01, "nus": (0.8, 0.7), "weight_decay": 0.1, "eps": 1e-3}),
    (QHAdam, {"lr": 0.01, "nus": (-0.2, 0.0), "maximize": True}),
    (QHAdam, {"lr": 0.01, "nus": (1.0, 1.0), "eps": 0.0}),
    (QHAdamW, {"lr": 0.01, "nus": (0.7, 0.9), "weight_decay": 0.1}),
    # AMSGrad: the running maximum, in the C++ and the Triton kernels alike.
    (QHAdam, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.7, 1.0), "amsgrad": True}),
    (QHAdam, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.8, 0.6), "eps": 1e-3, "amsgrad": True}),
    (QHAdamW, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.7, 0.0), "amsgrad": True}),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(CONFIGS)]
AMSGRAD = [i for i, (_, kwargs) in enumerate(CONFIGS) if kwargs.get("amsgrad")]


def _configs(*indices: int) -> Any:
    return pytest.mark.parametrize(
        ("cls", "kwargs"), [CONFIGS[i] for i in indices], ids=[IDS[i] for i in indices]
    )


def _params(
    dtype: torch.dtype = F64, seed: int = 0, device: str = "cpu"
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(device)) for s in SHAPES
    ]


def _run(opt: Any, params: list[torch.Tensor], grads: list[list[Any]]) -> list[Any]:
    """The parameters after each step of ``grads`` (a None gradient: that
    parameter sits the step out)."""
    out = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.to(p.device, p.dtype).clone()
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_fused_follows_the_float64_reference(
    cls: type, kwargs: dict[str, Any], device: str
) -> None:
    params = _params(device=device)
    params0 = [p.detach().cpu().clone() for p in params]
    grads = random_grads(SHAPES, 25)
    got = _run(cls(params, **kwargs, fused=True), params, grads)
    want = reference_trajectory(cls, kwargs, params0, grads, maximize=kwargs.get("maximize", False))
    assert_trajectories_close([[t.cpu().numpy() for t in step] for step in got], want, rtol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_fused_equals_foreach_to_rounding_over_100_float32_steps(
    cls: type, kwargs: dict[str, Any], device: str
) -> None:
    grads = random_grads(SHAPES, 100)
    runs = {}
    for impl in ({"fused": True}, {"foreach": True}):
        params = _params(F32, device=device)
        runs[str(impl)] = _run(cls(params, **kwargs, **impl), params, grads)
    for fused, foreach in zip(*runs.values(), strict=True):
        for a, b in zip(fused, foreach, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
@_configs(3, 4, 7, AMSGRAD[0])
def test_step_counts_that_differ_take_a_row_of_coefficients_each(
    cls: type, kwargs: dict[str, Any], device: str
) -> None:
    # A parameter without a gradient misses a step: its count falls behind, and
    # its coefficients (bias corrections) differ from the others' -- one row
    # per tensor where the step's counts differ, one row for all where not.
    grads = random_grads(SHAPES, 6)
    for t in (1, 3):
        grads[t][1] = None  # type: ignore[call-overload]
    runs = []
    for impl in ({"fused": True}, {"foreach": True}):
        params = _params(device=device)
        runs.append(_run(cls(params, **kwargs, **impl), params, grads))
    for fused, foreach in zip(*runs, strict=True):
        for a, b in zip(fused, foreach, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.uint8], ids=str)
@_configs(0, 3, 6, AMSGRAD[0])
def test_maximize_of_the_negated_gradients_steps_the_same_bits(
    cls: type, kwargs: dict[str, Any], state_dtype: torch.dtype | None, device: str
) -> None:
    # Without a grad scale, maximize or weight decay the kernels' loops skip
    # the gradient's multiplier and the parameter's decay factor (both 1);
    # maximize takes the loops that multiply (by -1), whose step from -g must
    # be the same bits as the other's from g: x * 1 is x, also in an FMA.
    grads = random_grads(SHAPES, 20)
    runs = []
    for sign, maximize in ((1, False), (-1, True)):
        params = _params(F32, device=device)
        opt = cls(params, **kwargs, maximize=maximize, state_dtype=state_dtype, fused=True)
        runs.append(_run(opt, params, [[sign * g for g in step] for step in grads]))
    for step, (plain, maximized) in enumerate(zip(*runs, strict=True)):
        for a, b in zip(plain, maximized, strict=True):
            assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"


@_configs(1, 4, 7, AMSGRAD[1])
@pytest.mark.parametrize("direction", ["fused->foreach", "foreach->fused"])
def test_state_dict_moves_between_fused_and_foreach(
    cls: type, kwargs: dict[str, Any], direction: str
) -> None:
    first, second = (
        ({"fused": True}, {"foreach": True})
        if direction == "fused->foreach"
        else ({"foreach": True}, {"fused": True})
    )
    grads = random_grads(SHAPES, 10)
    params = _params()
    opt = cls(params, **kwargs, **first)
    _run(opt, params, grads[:5])
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    straight = _run(opt, params, grads[5:])

    resumed_params = [torch.nn.Parameter(p.clone()) for p in saved_params]
    resumed = cls(resumed_params, **kwargs, **second)
    resumed.load_state_dict(saved)
    # As in torch, a loaded state dict brings its groups' flags; switching the
    # implementation is then a matter of setting them.
    assert resumed.param_groups[0]["fused"] == first.get("fused")
    for group in resumed.param_groups:
        group.update(fused=second.get("fused"), foreach=second.get("foreach"))
    continued = _run(resumed, resumed_params, grads[5:])
    for a_step, b_step in zip(continued, straight, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_param_groups_with_their_own_hyperparameters() -> None:
    grads = random_grads(SHAPES, 8)
    runs = []
    for impl in ({"fused": True}, {"foreach": True}):
        params = _params()
        groups = [
            {"params": params[:2]},
            {"params": params[2:], "lr": 0.05, "nus": (0.5, 0.5), "weight_decay": 0.2},
        ]
        runs.append(_run(QHAdam(groups, lr=0.01, **impl), params, grads))
    for a_step, b_step in zip(*runs, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_tensor_lr_and_strided_params(cls: type, device: str) -> None:
    grads = random_grads([(3, 4)], 6)
    runs = []
    tensor_lr = torch.tensor(0.01, dtype=F64, device=device)
    for lr, impl in ((tensor_lr, {"fused": True}), (0.01, {"foreach": True})):
        base = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
        param = torch.nn.Parameter(base.to(device).t())  # non-contiguous
        runs.append(_run(cls([param], lr=lr, **impl), [param], grads))
        assert not param.is_contiguous()
    for a_step, b_step in zip(*runs, strict=True):
        torch.testing.assert_close(a_step[0], b_step[0], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@_configs(0, 4, AMSGRAD[1])
def test_low_precision_params_are_computed_in_float32(
    cls: type, kwargs: dict[str, Any], dtype: torch.dtype, device: str
) -> None:
    # One step from the same low-precision values: the fused step computes in
    # float32 and rounds once, so it is the float32 step rounded to ``dtype``
    # (to one unit in the last place: float32 rounding in between may differ).
    low = _params(dtype, device=device)
    high = [torch.nn.Parameter(p.detach().float()) for p in low]
    grads = random_grads(SHAPES, 1)
    got = _run(cls(low, **kwargs, fused=True), low, [[g.to(dtype) for g in grads[0]]])
    want = _run(cls(high, **kwargs, foreach=True), high, [[g.to(dtype).float() for g in grads[0]]])
    for a, b in zip(got[0], want[0], strict=True):
        assert a.dtype == dtype
        ulp = torch.finfo(dtype).eps * b.abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((a.float() - b.to(dtype).float()).abs() <= ulp).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_a_bfloat16_parameter_rounds_to_nearest(cls: type, device: str) -> None:
    # Updates far below half a bfloat16 unit in the last place leave the
    # parameters as they were when rounded to nearest; Triton's interpreter
    # truncated, which moved each one a unit towards zero (8% of the mean
    # magnitude after 30 such steps).
    gen = torch.Generator().manual_seed(0)
    value = (torch.rand(2000, generator=gen) + 0.5) * torch.sign(torch.randn(2000, generator=gen))
    p = torch.nn.Parameter(value.to(torch.bfloat16).to(device))
    before = p.detach().clone()
    opt = cls([p], lr=1e-5, fused=True)
    for _ in range(3):
        p.grad = torch.randn(2000, generator=gen).to(device, torch.bfloat16)
        opt.step()
    assert torch.equal(p.detach(), before)


# ------------------------------------------------------------------ GradScaler
@pytest.mark.parametrize("device", DEVICES)
@_configs(2, 5, 7, AMSGRAD[0])
def test_grad_scaler_unscales_inside_the_step_and_skips_infs(
    cls: type, kwargs: dict[str, Any], device: str
) -> None:
    # GradScaler hands a fused optimizer grad_scale and found_inf instead of
    # unscaling the grads itself: the step must equal an unscaled step, and a
    # step with an inf gradient must leave parameters and state untouched.
    scaled_params, plain_params = _params(F32, device=device), _params(F32, device=device)
    scaled = cls(scaled_params, **kwargs, fused=True)
    plain = cls(plain_params, **kwargs, fused=True)
    assert scaled._step_supports_amp_scaling
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1000)
    grads = random_grads(SHAPES, 6)
    for t, step_grads in enumerate(grads):
        inf_step = t == 3
        for p, g in zip(scaled_params, step_grads, strict=True):
            p.grad = scaler.scale(g.float().to(device)).clone()  # backward() of a scaled loss
        if inf_step:
            scaled_params[1].grad[0] = torch.inf
            before = (
                [p.detach().clone() for p in scaled_params],
                copy.deepcopy(scaled.state_dict()["state"]),
            )
        scaler.step(scaled)
        scaler.update()
        assert not hasattr(scaled, "grad_scale")  # GradScaler removes what it set
        if inf_step:
            for p, b in zip(scaled_params, before[0], strict=True):
                torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
            after = scaled.state_dict()["state"]
            for key, state in before[1].items():
                for name, value in state.items():
                    torch.testing.assert_close(after[key][name], value, rtol=0, atol=0)
            continue
        for p, g in zip(plain_params, step_grads, strict=True):
            p.grad = g.float().to(device).clone()
        plain.step()
        for a, b in zip(scaled_params, plain_params, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 2.0**9  # halved once, at the inf


# ------------------------------------------------------------------- refusals
@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
def test_fused_refuses_what_it_cannot_do(cls: type) -> None:
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        cls(_params(), lr=0.1, fused=True, foreach=True)
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        cls(_params(), lr=0.1, fused=True, differentiable=True)
    complex_param = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match="floating point Tensors of supported devices"):
        cls([complex_param], lr=0.1, fused=True)
    sparse = torch.nn.Parameter(torch.randn(3, 2))
    opt = cls([sparse], lr=0.1, fused=True)
    sparse.grad = torch.randn(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_fused_none_keeps_the_default_implementation() -> None:
    opt = QHAdam(_params(), fused=None)
    assert opt.defaults["fused"] is None
    assert not getattr(opt, "_step_supports_amp_scaling", False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capturable", [False, True])
def test_fused_qhadam_keeps_float32_step_counts_on_the_host_unless_capturable(
    device: str, capturable: bool
) -> None:
    # The host reads the counts of a step that is not capturable without a
    # synchronization; a capturable step keeps them on the device, as torch's.
    params = _params(device=device)
    opt = QHAdam(params, fused=True, capturable=capturable)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    for p in params:
        step = opt.state[p]["step"]
        where = p.device if capturable else torch.device("cpu")
        assert step.dtype == F32 and step.device == where and float(step) == 2.0


# --------------------------------------------------- the CPU kernel's build
def test_missing_compiler_or_ninja_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the C++ kernel, not Triton's

    from qhoptim.torch import _extension

    def no_ninja() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    _extension.cpu_extension.cache_clear()
    monkeypatch.setattr(_extension.shutil, "which", lambda name: None)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    params = _params()
    opt = QHAdam(params, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler .* and ninja") as info:
        opt.step()
    assert "fused=False" in str(info.value)
    _extension.cpu_extension.cache_clear()  # built (or loaded from disk) again when next needed


def _in_a_fresh_process(program: str) -> subprocess.CompletedProcess[str]:
    # The C++ kernel's loading as a new process meets it (not Triton's: no
    # TRITON_INTERPRET); a build takes well under the 300 s limit.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_build_killed_part_way_does_not_block_the_next_process() -> None:
    # torch guards a build with a lock file that a killed build leaves behind,
    # and waits for it to go away for as long as it takes. A fresh process must
    # load (or build) the kernel anyway, in the time a build takes.
    from qhoptim.torch import _extension

    stale = _extension.extension_build_directory() / "lock"
    stale.touch()  # what a process killed mid-build leaves
    program = (
        "import torch, qhoptim.torch as qt\n"
        "p = torch.zeros(5, requires_grad=True); p.grad = torch.ones(5)\n"
        "qt.QHAdam([p], lr=0.1, fused=True).step()\n"
        "assert float(p[0]) < 0, p\n"
    )
    try:
        proc = _in_a_fresh_process(program)
    except subprocess.TimeoutExpired:
        pytest.fail("the kernel's load waited on a lock file its builder left behind")
    finally:
        stale.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_fresh_checkout_loads_the_build_without_compiling_it_again() -> None:
    # A fresh clone's source is newer than the library built from the same
    # bytes (the build's name holds their digest); ninja, which compares file
    # times, would compile it again. The library is loaded instead.
    from qhoptim.torch import _extension

    library = Path(_extension.cpu_extension().__file__)
    times = library.stat()
    source_time = _extension._CSRC.stat().st_mtime
    os.utime(library, (times.st_atime, source_time - 3600))
    program = (
        "from pathlib import Path\n"
        "from torch.utils import cpp_extension\n"
        "from qhoptim.torch import _extension as e\n"
        "def compiled_again(*args, **kwargs):\n"
        "    raise AssertionError('the kernel was compiled again')\n"
        "cpp_extension.load = compiled_again\n"
        f"e.extension_build_directory = lambda name=None: Path({str(library.parent)!r})\n"
        f"assert Path(e.cpu_extension().__file__) == Path({str(library)!r})\n"
    )
    try:
        proc = _in_a_fresh_process(program)
    finally:
        os.utime(library, (times.st_atime, times.st_mtime))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_second_installation_loads_the_first_ones_build() -> None:
    # Two virtualenvs with the same torch compile the same library; the second
    # loads a build the first made instead of compiling its own (tens of
    # seconds), and steps as the multi-tensor kernels do.
    from qhoptim.torch import _extension

    _extension.cpu_extension()  # this installation's build, made or loaded
    program = (
        "from pathlib import Path\n"
        "import torch\n"
        "import qhoptim.torch as qt\n"
        "from qhoptim.torch import _extension as e\n"
        "e._install_tag = lambda: 'a-second-installation'\n"
        "module = e.cpu_extension()\n"
        "own = e.extension_build_directory()\n"
        "assert Path(module.__file__).parent != own, module.__file__\n"
        "assert not list(own.glob('*.so')), sorted(own.iterdir())\n"
        "steps = []\n"
        "for fused in (True, False):\n"
        "    p = torch.linspace(-1, 1, 9, requires_grad=True); p.grad = torch.cos(p.detach())\n"
        "    qt.QHAdam([p], lr=0.1, fused=fused, foreach=not fused).step()\n"
        "    steps.append(p.detach())\n"
        "torch.testing.assert_close(steps[0], steps[1], rtol=1e-6, atol=0)\n"
    )
    try:
        proc = _in_a_fresh_process(program)
    finally:
        second = _extension.extension_build_directory().parent / "a-second-installation"
        shutil.rmtree(second, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_which_kernel_follows_triton_interpret_as_set_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU tensors take the Triton kernels under Triton's interpreter only, read
    # from the environment on every step (tests switch it within one process).
    from qhoptim.torch._tensors import runs_triton

    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runs_triton(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runs_triton(cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not runs_triton(cpu) and runs_triton(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not runs_triton(torch.device("meta"))


def test_counting_steps_advances_every_count_or_none() -> None:
    # The fused CPU step advances its step counts and reads them in one call:
    # as torch's foreach addition of one would (the sum in the count's dtype,
    # its version bumped), or, on a list with a count it cannot take, not at
    # all (None: the caller counts with torch's operations).
    from qhoptim.torch._extension import cpu_extension

    counts = [torch.tensor(3.0), torch.tensor(0.0, dtype=F64), torch.tensor(2.0**24)]
    expected = [t.item() for t in torch._foreach_add([t.clone() for t in counts], 1)]
    versions = [t._version for t in counts]
    assert expected[2] == 2.0**24  # float32's sum, not the exact one
    assert cpu_extension().count_steps_(counts) == expected
    assert [t.item() for t in counts] == expected
    assert [t._version for t in counts] == [v + 1 for v in versions]
    for bad in (torch.tensor(1), torch.zeros(2), torch.tensor(1.0, dtype=torch.bfloat16)):
        counts = [torch.tensor(5.0), bad.clone()]
        assert cpu_extension().count_steps_(counts) is None
        assert counts[0].item() == 5.0 and torch.equal(counts[1], bad)
    # What the steps call: the same counts either way, whichever adds them.
    from qhoptim.torch import _fused

    for counts in (
        [torch.tensor(2.0), torch.tensor(7.0, dtype=F64)],
        [torch.tensor(3.0, dtype=torch.float16)],  # torch's operations
    ):
        expected = [t.item() + 1 for t in counts]
        assert _fused.counted(counts) == expected == [t.item() for t in counts]


def test_changing_lr_never_rebuilds_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-step scalars (lr, bias corrections) are arguments of the
    # compiled kernel, never part of what is compiled: one build for every step.
    from qhoptim.torch import _extension

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the C++ kernel, not Triton's
    params = _params(F32)
    opt = QHAdam(params, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9**t)
    _extension.cpu_extension()  # built or loaded once
    before = _extension.cpu_extension.cache_info()
    for _ in range(20):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        scheduler.step()
    after = _extension.cpu_extension.cache_info()
    # Every step looked the kernel up (at least once), and none built it again.
    assert after.misses == before.misses and after.hits >= before.hits + 20
