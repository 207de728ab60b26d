"""Steps whose inputs used to break the in-place kernels (docs/robustness.md).

* A gradient that shares storage with its parameter (``p.grad = p.detach()``,
  the gradient of ``|p|**2 / 2``, or a view of ``p``): the in-place passes read
  it after writing ``p``. Every path is held to the float64 reference fed the
  same gradient, and to ``torch.optim.Adam`` / ``SGD``.
* Hyperparameters inside the documented ranges whose folded coefficients do
  not fit the tensors' dtype (``lr=1e308``, ``nu=1e308``, ``weight_decay=1e308``
  in float32; ``1e5`` in float16): the step used to raise inside the kernels,
  after the momentum buffer was updated. It now completes with the IEEE
  arithmetic's inf or NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from qh_torch_testing import reference_optimizer

from qhoptim import reference
from qhoptim.torch import QHM, QHAdam, QHAdamW

F16, F32, F64 = torch.float16, torch.float32, torch.float64

# Every implementation a step can take (the compiled one is in test_torch_graphs.py).
PATHS: dict[str, dict[str, Any]] = {
    "per-tensor": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "capturable-foreach": {"capturable": True, "foreach": True},
    "capturable-per-tensor": {"capturable": True, "foreach": False},
    "differentiable": {"differentiable": True},
    "tensor-lr": {"foreach": True, "tensor_lr": True},
}

ALIAS_CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7}),
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 1.3, "weight_decay": 0.1, "maximize": True}),
    (
        QHM,
        {
            "lr": 0.1,
            "momentum": 0.9,
            "nu": 0.7,
            "weight_decay": 0.2,
            "decoupled_weight_decay": True,
        },
    ),
    (QHAdam, {"lr": 0.1, "nus": (0.7, 1.0)}),
    (QHAdam, {"lr": 0.1, "nus": (0.7, 0.8), "weight_decay": 0.1, "eps": 1e-3}),
    (QHAdam, {"lr": 0.1, "nus": (0.7, 0.8), "amsgrad": True}),
    (QHAdamW, {"lr": 0.1, "nus": (0.7, 0.9), "weight_decay": 0.1}),
]


def _make(cls: type, kwargs: dict[str, Any], path: str, p: torch.Tensor) -> torch.optim.Optimizer:
    flags = dict(PATHS[path])
    kw = dict(kwargs)
    if flags.pop("tensor_lr", False):
        kw["lr"] = torch.tensor(kw["lr"], dtype=F64)
    return cls([p], **kw, **flags)  # type: ignore[no-any-return]


def _leaf_or_not(values: torch.Tensor, path: str) -> torch.Tensor:
    """The parameter: a leaf Parameter, or (differentiable) a non-leaf tensor as autograd needs."""
    if path == "differentiable":
        return values.clone().requires_grad_(True).clone()
    return torch.nn.Parameter(values.clone())


def _aliased_grad(p: torch.Tensor, view: str) -> torch.Tensor:
    return {
        "same": p.detach(),
        "transpose": p.detach().t(),
        "flat": p.detach().view(-1).view(2, 2),
    }[view]


@pytest.mark.parametrize("view", ["same", "transpose", "flat"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("cls", "kwargs"), ALIAS_CONFIGS)
def test_a_gradient_aliasing_its_parameter_follows_the_reference(
    cls: type, kwargs: dict[str, Any], path: str, view: str
) -> None:
    x0 = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=F64)
    p = _leaf_or_not(x0, path)
    opt = _make(cls, kwargs, path, p)
    ref = reference_optimizer(cls, kwargs)
    x = x0.numpy().copy()
    state = ref.init(x)
    for _ in range(3):
        g = _aliased_grad(p, view)
        assert g.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        p.grad = g
        opt.step()
        ref_grad = x.T.copy() if view == "transpose" else x.copy()
        x, state = ref.step(x, -ref_grad if kwargs.get("maximize") else ref_grad, state)
    np.testing.assert_allclose(p.detach().numpy(), x, rtol=1e-12, atol=1e-14)
    # The gradient the user set is still the parameter: nothing was copied into it.
    assert p.grad.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()


@pytest.mark.parametrize("shift", [3, -3])
@pytest.mark.parametrize("path", [p for p in PATHS if p != "differentiable"])
@pytest.mark.parametrize(("cls", "kwargs"), ALIAS_CONFIGS)
def test_a_gradient_overlapping_part_of_its_parameter_follows_the_reference(
    cls: type, kwargs: dict[str, Any], path: str, shift: int
) -> None:
    # Parameter and gradient are windows of one buffer, `shift` elements apart
    # (longer than a vector register, so that a vectorized loop cannot read a
    # window before writing it by luck). With the gradient behind the
    # parameter (shift < 0), a loop reading it after writing the parameter
    # reads updated values.
    n, k = 67, abs(shift)
    buffer = torch.linspace(-2.0, 3.0, n + k, dtype=F64)
    p_at, g_at = (0, k) if shift > 0 else (k, 0)
    p = torch.nn.Parameter(buffer[p_at : p_at + n])
    assert p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    opt = _make(cls, kwargs, path, p)
    ref = reference_optimizer(cls, kwargs)
    whole = buffer.numpy().copy()  # the reference's view of the buffer
    state = ref.init(whole[p_at : p_at + n].copy())
    for _ in range(3):
        p.grad = buffer[g_at : g_at + n].detach()
        opt.step()
        ref_grad = whole[g_at : g_at + n].copy()
        x, state = ref.step(
            whole[p_at : p_at + n].copy(), -ref_grad if kwargs.get("maximize") else ref_grad, state
        )
        whole[p_at : p_at + n] = x
    np.testing.assert_allclose(buffer.numpy(), whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("path", ["per-tensor", "foreach", "fused", "capturable-foreach"])
def test_aliased_gradients_step_as_torch_adam_and_sgd(path: str) -> None:
    x0 = torch.tensor([1.0, -2.0, 0.25], dtype=F32)

    def run(make: Any) -> torch.Tensor:
        p = torch.nn.Parameter(x0.clone())
        opt = make(p)
        for _ in range(3):
            p.grad = p.detach()
            opt.step()
        return p.detach()

    flags = PATHS[path]
    # QHAdam with nus = (1, 1) is Adam; QHM with nu = 0 is SGD.
    want = run(lambda p: torch.optim.Adam([p], lr=0.1))
    got = run(lambda p: QHAdam([p], lr=0.1, nus=(1.0, 1.0), **flags))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    want = run(lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=0.1))
    got = run(lambda p: QHM([p], lr=0.1, nu=0.0, weight_decay=0.1, **flags))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_qhadam_with_an_aliased_gradient_ends_where_the_reference_does() -> None:
    # A gradient that is the parameter itself (p.grad = p.detach()): the step
    # reads it before it writes the parameter. (Reported: 0.7125 after 3 steps.)
    ref = reference.QHAdam(lr=0.1, nus=(0.7, 1.0))
    x = np.array([1.0, -2.0])
    state = ref.init(x)
    for _ in range(3):
        x, state = ref.step(x, x.copy(), state)
    for flags in PATHS.values():
        if "tensor_lr" in flags or flags.get("differentiable"):
            continue
        p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        opt = QHAdam([p], lr=0.1, nus=(0.7, 1.0), **flags)
        for _ in range(3):
            p.grad = p.detach()
            opt.step()
        np.testing.assert_allclose(p.detach().numpy(), x, rtol=0, atol=1e-6, err_msg=str(flags))


# ------------------------------------------------------------------ overflow
OVERFLOW_CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 1e308, "momentum": 0.9}),
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 1e308}),
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": -1e308}),
    (QHM, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e308}),
    (QHM, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e308, "maximize": True}),
    (QHM, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e308, "decoupled_weight_decay": True}),
    (QHAdam, {"lr": 1e308}),
    (QHAdam, {"lr": 0.1, "nus": (1e308, 0.5)}),
    (QHAdam, {"lr": 0.1, "nus": (0.7, 0.8), "weight_decay": 1e308}),
    (QHAdam, {"lr": 0.1, "eps": 1e308}),
    (QHAdam, {"lr": 1e308, "nus": (-1e308, 0.5), "eps": 1e300, "amsgrad": True}),
]
GRAD = [0.5, -0.25, 0.0]
X0 = [1.0, -2.0, 3.0]


def _fold_overflows_in_float64(cls: type, kwargs: dict[str, Any]) -> bool:
    """QHAdam's folded ``-lr * nu1 / (1 - beta1**t)`` is beyond float64 itself for lr = 1e308."""
    return cls is QHAdam and kwargs["lr"] >= 1e307


def _reference_run(cls: type, kwargs: dict[str, Any], steps: int) -> tuple[np.ndarray, Any]:
    ref = reference_optimizer(cls, kwargs)
    x = np.array(X0)
    state = ref.init(x)
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(steps):
            x, state = ref.step(x, np.array(GRAD), state)
    return x, state


def _snapshot(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    return [p.detach().clone()] + [
        v.detach().clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)
    ]


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("cls", "kwargs"), OVERFLOW_CONFIGS)
def test_coefficients_beyond_the_dtype_complete_the_step(
    cls: type, kwargs: dict[str, Any], path: str, dtype: torch.dtype
) -> None:
    p = _leaf_or_not(torch.tensor(X0, dtype=dtype), path)
    opt = _make(cls, kwargs, path, p)
    for step in (1, 2):
        p.grad = torch.tensor(GRAD, dtype=dtype)
        before = _snapshot(opt, p) if step > 1 else None
        try:
            opt.step()
        except Exception:  # the rule's other branch: raise before touching anything
            if before is not None:
                for a, b in zip(before, _snapshot(opt, p), strict=True):
                    torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
            raise  # qhoptim takes the first branch: the step completes
    x, state = _reference_run(cls, kwargs, 2)
    got = p.detach().to(F64).numpy()
    # The state follows the reference where it is finite: the update, not the
    # moments, carries the huge coefficients.
    want_buf = state.momentum_buffer if cls is QHM else state.exp_avg
    got_buf = opt.state[p]["momentum_buffer" if cls is QHM else "exp_avg"].detach().to(F64).numpy()
    finite = np.isfinite(want_buf) & np.isfinite(got_buf)
    np.testing.assert_allclose(
        got_buf[finite], want_buf[finite], rtol=1e-6 if dtype == F32 else 1e-12
    )
    if dtype == F64 and not _fold_overflows_in_float64(cls, kwargs):
        # IEEE float64 arithmetic: non-finite where the reference is, equal elsewhere.
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(x))
        fin = np.isfinite(x)
        np.testing.assert_allclose(got[fin], x[fin], rtol=1e-9)
    else:
        # A coefficient beyond the dtype's range is inf there, so the update is
        # inf or NaN (0 * inf) where the reference's float64 stays finite (its
        # order of operations differs from the folded kernels'); where both are
        # finite they agree, and where the reference overflows so does the step.
        with np.errstate(over="ignore"):
            want = x.astype(np.float32 if dtype == F32 else np.float64).astype(np.float64)
        fin = np.isfinite(want) & np.isfinite(got)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5)
        assert not np.any(np.isfinite(got) & ~np.isfinite(want))


@pytest.mark.parametrize("path", ["per-tensor", "foreach", "capturable-foreach"])
def test_float16_coefficients_beyond_half_range_complete_the_step(path: str) -> None:
    # weight_decay = 1e5 does not fit float16 (max 65504): an alpha= scalar refused it.
    for cls, kwargs in [
        (QHM, {"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e5}),
        (QHM, {"lr": 1e5, "momentum": 0.9, "nu": 1.0}),
        (QHAdam, {"lr": 1e-3, "weight_decay": 1e5, "eps": 1e-3}),
    ]:
        p = torch.nn.Parameter(torch.tensor([1e-3, -2e-3], dtype=F16))
        opt = cls([p], **kwargs, **PATHS[path])
        p.grad = torch.tensor([1e-3, 1e-3], dtype=F16)
        opt.step()
        x, _ = _reference_run_at(cls, kwargs, [1e-3, -2e-3], [1e-3, 1e-3])
        torch.testing.assert_close(
            p.detach().to(F64), torch.tensor(x), rtol=2e-2, atol=1e-5, equal_nan=True
        )


def _reference_run_at(cls: type, kwargs: dict[str, Any], x0: list[float], g: list[float]) -> Any:
    ref = reference_optimizer(cls, kwargs)
    # The float16 inputs as the optimizer saw them.
    x = np.array(x0, dtype=np.float16).astype(np.float64)
    grad = np.array(g, dtype=np.float16).astype(np.float64)
    return ref.step(x, grad, ref.init(x))
