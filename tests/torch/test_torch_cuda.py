"""CUDA: the default implementation, foreach = loop, capturable steps in a CUDA graph.

Skipped where no CUDA device is present (CI); run on a GPU machine.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from qh_torch_testing import assert_trajectories_close, random_grads, reference_trajectory

import qhoptim.torch as qht
from qhoptim.torch import QHM, QHAdam, QHAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

F64 = torch.float64
CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.5, "weight_decay": 0.1}),
    (QHAdam, {"lr": 0.01, "nus": (0.7, 0.8), "weight_decay": 0.1}),
    (QHAdamW, {"lr": 0.01, "nus": (0.7, 1.0), "maximize": True}),
]
IDS = [cls.__name__ for cls, _ in CONFIGS]
SHAPES = [(3, 2), (5,), (0,)]


def _cuda_params(dtype: torch.dtype = F64) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).cuda()) for s in SHAPES]


def _run(opt: Any, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[Any]:
    out = []
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.to(p.device, p.dtype)
        opt.step()
        out.append([p.detach().cpu().numpy().copy() for p in params])
    return out


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_default_is_foreach_on_cuda(cls: type, kwargs: dict[str, Any]) -> None:
    params = _cuda_params()
    for p in params:
        p.grad = torch.ones_like(p)
    name = "_multi_tensor_qhm" if cls is QHM else "_multi_tensor_qhadam"
    with mock.patch.object(qht._qhm if cls is QHM else qht._qhadam, name) as patched:
        cls(params, **kwargs).step()
    patched.assert_called_once()


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("variant", ["loop", "foreach", "capturable", "fused"])
def test_cuda_matches_the_reference(cls: type, kwargs: dict[str, Any], variant: str) -> None:
    params = _cuda_params()
    params0 = [p.detach().cpu() for p in params]
    grads = random_grads(SHAPES, 6)
    flags = {"foreach": variant == "foreach", "capturable": variant == "capturable"}
    if variant == "fused":
        flags = {"fused": True}
    got = _run(cls(params, **kwargs, **flags), params, grads)
    want = reference_trajectory(cls, kwargs, params0, grads, maximize=kwargs.get("maximize", False))
    assert_trajectories_close(got, want, rtol=1e-12)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize(
    "impl",
    [{"foreach": False}, {"foreach": True}, {"fused": True}],
    ids=["loop", "foreach", "fused"],
)
def test_capturable_step_replays_in_a_cuda_graph(
    cls: type, kwargs: dict[str, Any], impl: dict[str, bool]
) -> None:
    params = _cuda_params(torch.float32)
    params0 = [p.detach().cpu().double() for p in params]
    grads = random_grads(SHAPES, 8)
    lr = torch.tensor(kwargs["lr"], device="cuda")  # a tensor lr, changed between replays
    opt = cls(params, **{**kwargs, "lr": lr}, **impl, capturable=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    static_grads = [p.grad for p in params]

    got = []
    # Two eager steps (state initialization, and warm-up on a side stream), then replays.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in range(2):
            for g, new in zip(static_grads, grads[t], strict=True):
                g.copy_(new)
            opt.step()
            got.append([p.detach().cpu().double().numpy().copy() for p in params])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    lrs = [kwargs["lr"]] * 2
    for t in range(2, len(grads)):
        lrs.append(kwargs["lr"] * 0.5 ** (t - 1))
        lr.fill_(lrs[-1])
        for g, new in zip(static_grads, grads[t], strict=True):
            g.copy_(new)
        graph.replay()
        got.append([p.detach().cpu().double().numpy().copy() for p in params])
    torch.cuda.synchronize()
    grads64 = [[g.float().double() for g in step] for step in grads]
    want = reference_trajectory(
        cls, kwargs, params0, grads64, lrs, maximize=kwargs.get("maximize", False)
    )
    assert_trajectories_close(got, want, rtol=1e-5)
    if cls is not QHM:
        assert all(s["step"].is_cuda and float(s["step"]) == len(grads) for s in opt.state.values())


# ------------------------------------------------ step hazards (docs/robustness.md)
# The CPU suite (test_torch_step_hazards.py) runs every path on CPU tensors;
# these are the same checks on CUDA, where the fused path is Triton's.
CUDA_PATHS: dict[str, dict[str, bool]] = {
    "loop": {"foreach": False},
    "foreach": {"foreach": True},
    "capturable": {"foreach": True, "capturable": True},
    "fused": {"fused": True},
}
ALIAS_CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.1}),
    (QHAdam, {"lr": 0.1, "nus": (0.7, 0.8), "weight_decay": 0.1, "eps": 1e-3}),
    (QHAdamW, {"lr": 0.1, "nus": (0.7, 0.9), "weight_decay": 0.1}),
]


@pytest.mark.parametrize("view", ["same", "transpose", "shift-ahead", "shift-behind"])
@pytest.mark.parametrize("path", list(CUDA_PATHS))
@pytest.mark.parametrize(
    ("cls", "kwargs"), ALIAS_CONFIGS, ids=[c.__name__ for c, _ in ALIAS_CONFIGS]
)
def test_a_gradient_aliasing_its_parameter_on_cuda_follows_the_reference(
    cls: type, kwargs: dict[str, Any], path: str, view: str
) -> None:
    from qh_torch_testing import reference_optimizer

    n, k = 64, 3  # a square parameter for the transpose, windows k apart for the shifts
    buffer = torch.linspace(-2.0, 3.0, n + k, dtype=F64, device="cuda")
    at = {"shift-behind": k}.get(view, 0)
    p = torch.nn.Parameter(buffer[at : at + n].view(8, 8))
    opt = cls([p], **kwargs, **CUDA_PATHS[path])
    ref = reference_optimizer(cls, kwargs)
    whole = buffer.cpu().numpy().copy()
    state = ref.init(whole[at : at + n].reshape(8, 8).copy())
    for _ in range(3):
        x = whole[at : at + n].reshape(8, 8).copy()
        if view == "same":
            p.grad, want_grad = p.detach(), x.copy()
        elif view == "transpose":
            p.grad, want_grad = p.detach().t(), x.T.copy()
        else:
            g_at = k if view == "shift-ahead" else 0
            p.grad = buffer[g_at : g_at + n].view(8, 8).detach()
            want_grad = whole[g_at : g_at + n].reshape(8, 8).copy()
        opt.step()
        x, state = ref.step(x, want_grad, state)
        whole[at : at + n] = x.reshape(-1)
    torch.testing.assert_close(buffer.cpu(), torch.from_numpy(whole), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("beta1", [0.99999, 0.9999999])
@pytest.mark.parametrize("path", list(CUDA_PATHS))
def test_adam_first_step_on_cuda_is_lr_times_the_sign_in_float32(path: str, beta1: float) -> None:
    grad = torch.tensor([1.0, -2.0, 0.5, -3.0, 1e-3, 7.0], device="cuda")
    p = torch.nn.Parameter(torch.zeros(6, device="cuda"))
    p.grad = grad
    QHAdam([p], lr=1.0, betas=(beta1, 0.999), eps=0.0, **CUDA_PATHS[path]).step()
    # Two float32 ulps (docs/robustness.md); 1 - beta1 in float32 would be 16% off.
    eps32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(p.detach(), -torch.sign(grad), rtol=2 * eps32, atol=0)


@pytest.mark.parametrize("path", list(CUDA_PATHS))
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (QHM, {"lr": 1e308, "momentum": 0.9}),
        (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 1e308}),
        (QHAdam, {"lr": 0.1, "nus": (1e308, 0.5)}),
        (QHAdam, {"lr": 0.1, "eps": 1e308}),
    ],
)
def test_float32_coefficients_beyond_the_range_complete_the_step_on_cuda(
    cls: type, kwargs: dict[str, Any], path: str
) -> None:
    # CUDA's kernels refuse a scalar beyond float32's range where CPU's round it
    # to inf; the step must complete either way (IEEE inf/NaN, never an error
    # halfway), and agree with the same path on CPU where both are finite.
    def run(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], device=device))
        opt = cls([p], **kwargs, **CUDA_PATHS[path])
        for _ in range(2):
            p.grad = torch.tensor([0.5, -0.25, 0.0], device=device)
            opt.step()
        buf = opt.state[p]["momentum_buffer" if cls is QHM else "exp_avg"]
        return p.detach().cpu(), buf.detach().cpu()

    for got, want in zip(run("cuda"), run("cpu"), strict=True):
        both = torch.isfinite(got) & torch.isfinite(want)
        torch.testing.assert_close(got[both], want[both], rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", ["loop", "foreach", "fused"])
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_bfloat16_state_on_cuda_follows_float32_state_and_resumes_exactly(
    cls: type, kwargs: dict[str, Any], path: str
) -> None:
    import copy

    def make(params: list[torch.Tensor], state_dtype: torch.dtype | None) -> Any:
        return cls(params, **kwargs, **CUDA_PATHS[path], state_dtype=state_dtype)

    wide, narrow = _cuda_params(torch.float32), _cuda_params(torch.float32)
    opt_wide, opt_narrow = make(wide, None), make(narrow, torch.bfloat16)
    grads = random_grads(SHAPES, 30)
    _run(opt_wide, wide, grads)
    _run(opt_narrow, narrow, grads)
    for state in opt_narrow.state.values():
        assert all(v.dtype == torch.bfloat16 for k, v in state.items() if k != "step")
    for a, b in zip(wide, narrow, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-3)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in narrow]
    resumed = make(resumed_params, torch.bfloat16)
    resumed.load_state_dict(copy.deepcopy(opt_narrow.state_dict()))
    more = random_grads(SHAPES, 3)
    _run(opt_narrow, narrow, more)
    _run(resumed, resumed_params, more)
    for a, b in zip(narrow, resumed_params, strict=True):
        assert torch.equal(a, b)
