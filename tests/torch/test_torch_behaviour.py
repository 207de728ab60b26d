"""Behaviour of the torch optimizers: implementations agree, flags, groups, schedules, AMP."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from qh_torch_testing import (
    assert_trajectories_close,
    random_grads,
    reference_optimizer,
    reference_trajectory,
    run_torch,
)
from torch.optim import lr_scheduler

import qhoptim.torch as qht
from qhoptim.torch import QHM, QHAdam, QHAdamW

F64 = torch.float64

CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.5}),
    (QHM, {"lr": 0.5, "momentum": 0.9, "nu": 1.3, "weight_decay": 0.1}),
    (QHM, {"lr": 0.5, "nu": 0.0, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (QHM, {"lr": 0.5, "momentum": 0.0, "nu": 1.0, "maximize": True, "weight_decay": 0.1}),
    (QHAdam, {"lr": 0.01}),
    (QHAdam, {"lr": 0.01, "betas": (0.995, 0.999), "nus": (0.7, 1.0)}),
    (QHAdam, {"lr": 0.01, "nus": (0.8, 0.6), "weight_decay": 0.1}),
    (QHAdam, {"lr": 0.01, "nus": (-0.2, 0.0), "eps": 1e-3, "decoupled_weight_decay": True}),
    (QHAdam, {"lr": 0.01, "betas": (0.0, 0.9), "nus": (0.0, 0.5), "maximize": True}),
    (QHAdamW, {"lr": 0.01, "nus": (0.7, 0.9)}),
    (QHAdamW, {"lr": 0.01, "maximize": True, "weight_decay": 0.1}),
    # AMSGrad: beta2 = 0.9 lets the second moment fall, so the maximum is read.
    (QHAdam, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.7, 0.8), "amsgrad": True}),
    (QHAdam, {"lr": 0.01, "betas": (0.8, 0.9), "weight_decay": 0.1, "amsgrad": True}),
    (QHAdamW, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.7, 0.0), "amsgrad": True}),
    (QHAdamW, {"lr": 0.01, "betas": (0.9, 0.9), "maximize": True, "amsgrad": True}),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(CONFIGS)]


def _model_params() -> list[torch.nn.Parameter]:
    """torch's foreach-vs-loop setup: layers, a frozen one, an empty and a non-contiguous param."""
    gen = torch.Generator().manual_seed(0)

    def param(*shape: int, dtype: torch.dtype = F64) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, generator=gen, dtype=dtype))

    frozen = param(3)
    frozen.requires_grad_(False)
    return [
        param(4, 3),
        param(4),
        frozen,
        param(0),  # zero-size
        torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=F64).t()),  # non-contiguous
        torch.nn.Parameter(torch.randn(6, 4, generator=gen, dtype=F64)[::2, 1:]),  # strided
        param(2, 2, dtype=torch.complex128),  # a complex param in the same group
    ]


@pytest.mark.parametrize("chunk", [None, 8], ids=["one-chunk", "chunks-of-8"])
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_foreach_matches_forloop(
    cls: type, kwargs: dict[str, Any], chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if chunk is not None:  # the CPU multi-tensor path works in chunks of whole tensors
        monkeypatch.setattr(qht._kernels, "CPU_CHUNK_NUMEL", chunk)
    runs = {}
    for foreach in (False, True):
        params = _model_params()
        assert not params[4].is_contiguous() and not params[5].is_contiguous()
        opt = cls(params, **kwargs, foreach=foreach)
        gen = torch.Generator().manual_seed(1)
        history = []
        for step in range(7):
            for i, p in enumerate(params):
                if not p.requires_grad or (step == 3 and i in (1, 4)):
                    p.grad = None  # frozen, or skipped at one step: steps then differ
                else:
                    p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            opt.step()
            history.append([p.detach().clone() for p in params])
        states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        runs[foreach] = history, states
    (loop_hist, loop_states), (fe_hist, fe_states) = runs[False], runs[True]
    for loop_step, fe_step in zip(loop_hist, fe_hist, strict=True):
        for a, b in zip(loop_step, fe_step, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    for a, b in zip(loop_states, fe_states, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("foreach", [False, True])
def test_matches_the_reference(cls: type, kwargs: dict[str, Any], foreach: bool) -> None:
    # Real and complex parameters in one group; the reference takes |g|^2 for complex.
    shapes = [(3, 2), (4,)]
    gen = torch.Generator().manual_seed(2)
    params = [
        torch.nn.Parameter(torch.randn(3, 2, generator=gen, dtype=F64)),
        torch.nn.Parameter(torch.randn(4, generator=gen, dtype=torch.complex128)),
    ]
    grads = [
        [g.to(p.dtype) if p.is_complex() else g for g, p in zip(step, params, strict=True)]
        for step in random_grads(shapes, 6)
    ]
    for step in grads:  # complex gradients with a nonzero imaginary part
        step[1] = step[1] + 1j * torch.randn(4, generator=gen, dtype=F64)
    want = reference_trajectory(cls, kwargs, params, grads, maximize=kwargs.get("maximize", False))
    got = run_torch(cls(params, **kwargs, foreach=foreach), params, grads)
    assert_trajectories_close(got, want)


@pytest.mark.parametrize("foreach", [False, True])
def test_complex_second_moment_is_abs_squared(foreach: bool) -> None:
    p = torch.nn.Parameter(torch.tensor([3.0 + 4.0j], dtype=torch.complex128))
    opt = QHAdam([p], lr=0.1, betas=(0.9, 0.5), foreach=foreach)
    p.grad = torch.tensor([3.0 + 4.0j], dtype=torch.complex128)
    opt.step()
    state = opt.state[p]
    assert state["exp_avg"].dtype == torch.complex128
    assert state["exp_avg_sq"].dtype == F64 and state["exp_avg_sq"].shape == p.shape
    torch.testing.assert_close(state["exp_avg_sq"], torch.tensor([0.5 * 25.0], dtype=F64))
    # Adam on a complex parameter moves it along the gradient's phase (not per component).
    step = (torch.tensor([3.0 + 4.0j], dtype=torch.complex128) - p.detach()) / 0.1
    torch.testing.assert_close(step, torch.tensor([0.6 + 0.8j], dtype=torch.complex128))


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_maximize_is_minimizing_the_negation(cls: type, kwargs: dict[str, Any]) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k != "maximize"}
    shapes = [(3, 2), (4,)]
    grads = random_grads(shapes, 5)
    base = [torch.randn(s, dtype=F64) for s in shapes]
    up = [torch.nn.Parameter(b.clone()) for b in base]
    down = [torch.nn.Parameter(b.clone()) for b in base]
    got = run_torch(cls(up, **kwargs, maximize=True), up, grads)
    want = run_torch(cls(down, **kwargs), down, [[-g for g in step] for step in grads])
    assert_trajectories_close(got, want, rtol=0.0)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("foreach", [False, True])
def test_gradients_are_left_untouched(cls: type, kwargs: dict[str, Any], foreach: bool) -> None:
    # qhoptim 1.1.0 added the weight decay into p.grad.
    p = torch.nn.Parameter(torch.randn(5, dtype=F64))
    opt = cls([p], **kwargs, foreach=foreach)
    for _ in range(2):
        grad = torch.randn(5, dtype=F64)
        p.grad = grad.clone()
        opt.step()
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [QHM, QHAdam, QHAdamW])
@pytest.mark.parametrize("foreach", [False, True])
def test_zero_gradients_without_decay_are_a_no_op(cls: type, foreach: bool) -> None:
    kwargs: dict[str, Any] = {"lr": 0.5, "weight_decay": 0.0, "foreach": foreach}
    params = _model_params()
    before = [p.detach().clone() for p in params]
    opt = cls(params, **kwargs)
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        opt.step()
    for a, b in zip(params, before, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True])
def test_param_groups_keep_their_hyperparameters(foreach: bool) -> None:
    groups: list[tuple[type, dict[str, Any], dict[str, Any]]] = [
        (QHM, {"lr": 0.5}, {"momentum": 0.5, "nu": 1.0, "weight_decay": 0.1}),
        (QHAdam, {"lr": 0.01}, {"lr": 0.1, "nus": (0.5, 0.8), "weight_decay": 0.1}),
    ]
    for cls, defaults, override in groups:
        a = torch.nn.Parameter(torch.randn(3, dtype=F64))
        b = torch.nn.Parameter(torch.randn(2, dtype=F64))
        a0, b0 = a.detach().clone(), b.detach().clone()
        opt = cls([{"params": [a]}, {"params": [b], **override}], **defaults, foreach=foreach)
        grads = random_grads([(3,), (2,)], 5)
        got = run_torch(opt, [a, b], grads)
        want_a = reference_trajectory(cls, defaults, [a0], [[g[0]] for g in grads])
        want_b = reference_trajectory(cls, {**defaults, **override}, [b0], [[g[1]] for g in grads])
        assert_trajectories_close([[s[0]] for s in got], want_a)
        assert_trajectories_close([[s[1]] for s in got], want_b)


def test_tensor_lr() -> None:
    for foreach in (False, True):
        for cls, kwargs in [(QHM, {"weight_decay": 0.1}), (QHAdam, {"nus": (0.7, 0.9)})]:
            p = torch.nn.Parameter(torch.randn(4, dtype=F64))
            p0 = p.detach().clone()
            lr = torch.tensor([0.05], dtype=F64)  # 1-element, not 0-d
            grads = random_grads([(4,)], 4)
            got = run_torch(cls([p], lr=lr, **kwargs, foreach=foreach), [p], grads)
            want = reference_trajectory(cls, {"lr": 0.05, **kwargs}, [p0], grads)
            assert_trajectories_close(got, want)


@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_capturable_path_matches_the_reference(cls: type) -> None:
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    p = torch.nn.Parameter(torch.randn(4, dtype=F64))
    p0 = p.detach().clone()
    grads = random_grads([(4,)], 5)
    opt = cls([p], **kwargs, capturable=True)
    got = run_torch(opt, [p], grads)
    assert_trajectories_close(got, reference_trajectory(cls, kwargs, [p0], grads))
    if cls is QHAdam:
        assert opt.state[p]["step"].device == p.device


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize(
    "lr_dtype", [None, F64, torch.float32], ids=["float-lr", "tensor-lr", "float32-tensor-lr"]
)
def test_capturable_steps_match_the_reference(
    cls: type, kwargs: dict[str, Any], foreach: bool, lr_dtype: torch.dtype | None
) -> None:
    # capturable=True reads nothing back to the host: with foreach the
    # coefficients are tensors on the device, one per parameter (params that
    # skip a step have their own step count), and a tensor lr stays a tensor.
    # A float32 one (torch's default dtype) folds at the parameters' float64:
    # folded in float32, the steps were 1e-9 off.
    shapes = [(4, 3), (5,), (2, 2)]
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64)) for s in shapes]
    params0 = [p.detach().clone() for p in params]
    grads: list[list[torch.Tensor | None]] = list(random_grads(shapes, 6))
    grads[2] = [grads[2][0], None, grads[2][2]]  # param 1 skips step 2
    lr = kwargs["lr"] if lr_dtype is None else torch.tensor(kwargs["lr"], dtype=lr_dtype)
    opt = cls(params, **{**kwargs, "lr": lr}, foreach=foreach, capturable=True)
    got = run_torch(opt, params, grads)
    taken = {**kwargs, "lr": float(lr)}  # a float32 lr's value, exactly
    want = reference_trajectory(cls, taken, params0, grads, maximize=kwargs.get("maximize", False))
    assert_trajectories_close(got, want)


@pytest.mark.parametrize("cls", [QHAdam, QHAdamW])
def test_capturable_foreach_takes_the_on_device_kernels(cls: type) -> None:
    params = [torch.nn.Parameter(torch.ones(3, dtype=F64)) for _ in range(2)]
    opt = cls(params, lr=0.1, foreach=True, capturable=True)
    for p in params:
        p.grad = torch.ones_like(p)
    with (
        mock.patch.object(qht._kernels, "_device_fold", wraps=qht._kernels._device_fold) as spy,
        mock.patch.object(qht._qhadam, "_single_tensor_qhadam") as loop,
    ):
        opt.step()
    spy.assert_called_once()
    loop.assert_not_called()


# ------------------------------------------------------------- conversions
def test_nesterov_and_momentum_conversions_reproduce_torch_sgd() -> None:
    for name, sgd_kwargs in [
        ("from_nesterov", {"momentum": 0.9, "nesterov": True}),
        ("from_momentum", {"momentum": 0.9}),
        ("from_sgd", {}),
    ]:
        base = torch.randn(6, dtype=F64)
        p, q = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
        grads = random_grads([(6,)], 8)
        qhm_kwargs = getattr(QHM, name)(lr=0.1, **({"momentum": 0.9} if sgd_kwargs else {}))
        got = run_torch(QHM([p], **qhm_kwargs), [p], grads)
        want = run_torch(torch.optim.SGD([q], lr=0.1, **sgd_kwargs), [q], grads)
        assert_trajectories_close(got, want)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_conversion_reproduces_torch_adam_and_adamw(
    weight_decay: float, amsgrad: bool
) -> None:
    adam = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    qhadam = {**QHAdam.from_adam(0.01, (0.8, 0.99), eps=1e-6), "weight_decay": weight_decay}
    for ours, theirs in ((QHAdam, torch.optim.Adam), (QHAdamW, torch.optim.AdamW)):
        base = torch.randn(6, dtype=F64)
        p, q = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
        grads = random_grads([(6,)], 8)
        got = run_torch(ours([p], **qhadam, amsgrad=amsgrad), [p], grads)
        want = run_torch(theirs([q], **adam, amsgrad=amsgrad), [q], grads)
        assert_trajectories_close(got, want)


# Every implementation that takes amsgrad on CPU (fused: the C++ kernel).
AMSGRAD_PATHS = [
    {"foreach": False},
    {"foreach": True},
    {"fused": True},
    {"foreach": False, "capturable": True},
    {"foreach": True, "capturable": True},
    {"foreach": True, "tensor_lr": True},
    {"foreach": False, "tensor_lr": True},
]


@pytest.mark.parametrize("path", AMSGRAD_PATHS, ids=lambda p: "-".join(sorted(p)))
@pytest.mark.parametrize(("ours", "theirs"), [(QHAdam, "Adam"), (QHAdamW, "AdamW")])
def test_amsgrad_with_nus_one_is_torch_amsgrad(
    ours: type, theirs: str, path: dict[str, bool]
) -> None:
    # nu = (1, 1) is torch's Adam(amsgrad=True) / AdamW(amsgrad=True), step by
    # step in float64, on gradients that shrink (the maximum stays above the
    # second moment) with spikes.
    path = dict(path)
    lr: Any = torch.tensor(0.01, dtype=F64) if path.pop("tensor_lr", False) else 0.01
    kwargs = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.05}
    shapes = [(5, 3), (7,), (0,)]
    base = random_grads(shapes, 40, seed=3)
    grads = [
        [g * (0.9**t) * (20.0 if t % 9 == 0 else 1.0) for g in step] for t, step in enumerate(base)
    ]
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ours(params, lr=lr, nus=(1.0, 1.0), amsgrad=True, **kwargs, **path)
    got = run_torch(opt, params, grads)
    want = run_torch(
        getattr(torch.optim, theirs)(twins, lr=0.01, amsgrad=True, **kwargs), twins, grads
    )
    assert_trajectories_close(got, want)
    state = opt.state[params[0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert torch.all(state["max_exp_avg_sq"] >= state["exp_avg_sq"])
    assert torch.any(state["max_exp_avg_sq"] > state["exp_avg_sq"])


@pytest.mark.parametrize("foreach", [False, True])
def test_amsgrad_keeps_a_real_maximum_for_complex_params(foreach: bool) -> None:
    p = torch.nn.Parameter(torch.tensor([1.0 + 1.0j, -2.0j], dtype=torch.complex128))
    opt = QHAdam([p], lr=0.1, nus=(0.7, 0.9), amsgrad=True, foreach=foreach)
    p.grad = torch.tensor([3.0 + 4.0j, 1.0], dtype=torch.complex128)
    opt.step()
    assert opt.state[p]["max_exp_avg_sq"].dtype == F64
    torch.testing.assert_close(opt.state[p]["max_exp_avg_sq"], opt.state[p]["exp_avg_sq"])


# -------------------------------------------------------------- schedulers
def _schedulers(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "StepLR": lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
        "MultiStepLR": lr_scheduler.MultiStepLR(opt, milestones=[2, 5], gamma=0.3),
        "ExponentialLR": lr_scheduler.ExponentialLR(opt, gamma=0.9),
        "CosineAnnealingLR": lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=0.01),
        "CosineAnnealingWarmRestarts": lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3),
        "LinearLR": lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=4),
        "ConstantLR": lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=3),
        "PolynomialLR": lr_scheduler.PolynomialLR(opt, total_iters=6, power=2.0),
        "LambdaLR": lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t)),
        "MultiplicativeLR": lr_scheduler.MultiplicativeLR(opt, lambda t: 0.8),
        "OneCycleLR": lr_scheduler.OneCycleLR(
            opt, max_lr=0.1, total_steps=10, cycle_momentum=False
        ),
        "CyclicLR": lr_scheduler.CyclicLR(
            opt, base_lr=0.01, max_lr=0.1, step_size_up=2, cycle_momentum=False
        ),
        "ReduceLROnPlateau": lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1),
    }


SCHEDULERS = list(_schedulers(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)))


def _make_scheduler(name: str, opt: torch.optim.Optimizer) -> Any:
    if name == "SequentialLR":
        first = lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        second = lr_scheduler.ExponentialLR(opt, gamma=0.8)
        return lr_scheduler.SequentialLR(opt, [first, second], milestones=[3])
    if name == "ChainedScheduler":
        return lr_scheduler.ChainedScheduler(
            [
                lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2),
                lr_scheduler.ExponentialLR(opt, 0.9),
            ]
        )
    return _schedulers(opt)[name]


# torch < 2.5's SequentialLR calls scheduler.step(0), which warns about the
# epoch argument (with torch.optim.SGD as well).
@pytest.mark.filterwarnings("ignore:The epoch parameter in `scheduler.step\\(\\)`:UserWarning")
@pytest.mark.parametrize("name", [*SCHEDULERS, "SequentialLR", "ChainedScheduler"])
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(QHM, {"lr": 0.5, "weight_decay": 0.01}), (QHAdamW, {"lr": 0.05, "nus": (0.7, 1.0)})],
    ids=["QHM", "QHAdamW"],
)
def test_lr_schedulers(name: str, cls: type, kwargs: dict[str, Any]) -> None:
    p = torch.nn.Parameter(torch.randn(4, dtype=F64))
    p0 = p.detach().clone()
    opt = cls([p], **kwargs)
    scheduler = _make_scheduler(name, opt)
    grads = random_grads([(4,)], 10)

    def schedule(t: int) -> None:
        if name == "ReduceLROnPlateau":
            scheduler.step(1.0)  # a plateau: the lr halves every other step
        else:
            scheduler.step()

    # Record the lr each step is taken with, then let the scheduler move it.
    lrs: list[float] = []
    got = []
    for step_grads in grads:
        lrs.append(float(opt.param_groups[0]["lr"]))
        got += run_torch(opt, [p], [step_grads], after_step=schedule)
    assert len(set(lrs)) > 1, "the schedule should change the lr"
    want = reference_trajectory(cls, kwargs, [p0], grads, lrs)
    assert_trajectories_close(got, want)


@pytest.mark.parametrize(
    ("cls", "kwargs", "key"),
    [(QHM, {"lr": 0.5, "nu": 0.7}, "momentum"), (QHAdam, {"lr": 0.05, "nus": (0.7, 1.0)}, "betas")],
)
def test_one_cycle_cycles_the_momentum(cls: type, kwargs: dict[str, Any], key: str) -> None:
    # OneCycleLR(cycle_momentum=True) drives QHM's beta (group["momentum"]) and
    # QHAdam's beta1 (group["betas"][0]); each step must use the current value.
    p = torch.nn.Parameter(torch.randn(4, dtype=F64))
    x = p.detach().numpy().copy()
    opt = cls([p], **kwargs)
    scheduler = lr_scheduler.OneCycleLR(
        opt, max_lr=kwargs["lr"], total_steps=8, base_momentum=0.8, max_momentum=0.95
    )
    state = None
    seen = set()
    for step_grads in random_grads([(4,)], 8):
        group = opt.param_groups[0]
        seen.add(group[key] if key == "momentum" else group[key][0])
        ref_kwargs = {**kwargs, "lr": group["lr"], key: group[key]}
        ref = reference_optimizer(cls, ref_kwargs)
        state = ref.init(x) if state is None else state
        x, state = ref.step(x, step_grads[0].numpy(), state)
        run_torch(opt, [p], [step_grads])
        scheduler.step()
        np.testing.assert_allclose(p.detach().numpy(), x, rtol=1e-12, atol=1e-14)
    assert len(seen) > 2


# ----------------------------------------------------------------- GradScaler
@pytest.mark.parametrize("cls", [QHM, QHAdam])
@pytest.mark.parametrize("foreach", [False, True])
def test_grad_scaler_skips_steps_with_inf(cls: type, foreach: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = cls(model.parameters(), lr=0.1, foreach=foreach)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    data = torch.randn(5, 3)

    def scaled_step(poison: bool) -> None:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(data).float().pow(2).mean()
        scaler.scale(loss).backward()
        if poison:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    scaled_step(poison=False)
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    scale = scaler.get_scale()
    scaled_step(poison=True)
    assert scaler.get_scale() < scale  # the step was recognized as overflowing
    for p, before in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)
        for k, v in opt.state[p].items():
            torch.testing.assert_close(v, state[id(p)][k], rtol=0, atol=0)
    scaled_step(poison=False)  # and training resumes
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), params, strict=True))


def test_grad_scaler_step_equals_an_unscaled_step() -> None:
    base = torch.nn.Linear(3, 2)
    runs = []
    for use_scaler in (False, True):
        model = torch.nn.Linear(3, 2)
        model.load_state_dict(base.state_dict())
        opt = QHAdam(model.parameters(), lr=0.1, nus=(0.7, 0.9))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=use_scaler)
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.ones(4, 3)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        runs.append([p.detach() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
