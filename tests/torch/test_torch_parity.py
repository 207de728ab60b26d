"""Every path and flag against the same checks torch runs on its own optimizers.

In the manner of torch's optimizer tests (``test/test_optim.py`` over
``OptimizerInfo``s), written here: each implementation (the per-tensor loop,
foreach, fused) and each flag that changes what is stored (``amsgrad``, a
bfloat16 or 8-bit ``state_dtype``) meets

* fused = foreach = the loop, in every parameter dtype (fused: where it computes
  in the parameters' dtype, float32 and float64);
* step hooks run once per step, before and after, on every path;
* a step of parameters without gradients changes nothing;
* a state dict saved mid-run and loaded into a new optimizer continues exactly
  as the uninterrupted one.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from qhoptim.torch import QHM, QHAdam, QHAdamW

PATHS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "qhm": (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.01}),
    "qhadam": (QHAdam, {"lr": 0.01, "nus": (0.7, 0.9), "weight_decay": 0.01}),
    "qhadam-amsgrad": (QHAdam, {"lr": 0.01, "nus": (0.7, 1.0), "amsgrad": True}),
    "qhadamw-bf16": (QHAdamW, {"lr": 0.01, "nus": (0.7, 1.0), "state_dtype": torch.bfloat16}),
    "qhm-uint8": (QHM, {"lr": 0.1, "nu": 0.7, "state_dtype": torch.uint8}),
    "qhadam-uint8": (QHAdam, {"lr": 0.01, "nus": (0.7, 1.0), "state_dtype": torch.uint8}),
}
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# Against the loop after 5 steps, per dtype.
TOLERANCE = {
    torch.float64: (1e-12, 1e-14),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (0, 0),  # the loop and foreach: the same operations
    torch.bfloat16: (0, 0),
}


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 4), (7,), (0,), (2, 3, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params: list[torch.Tensor], t: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + t)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _run(opt: Any, params: list[torch.Tensor], steps: range) -> None:
    for t in steps:
        for p, g in zip(params, _grads(params, t), strict=True):
            p.grad = g
        opt.step()


def _supported(kwargs: dict[str, Any], dtype: torch.dtype) -> bool:
    """A state_dtype is the parameters' own or narrower (not wider, nor as wide
    and another: float16 beside bfloat16)."""
    state_dtype = kwargs.get("state_dtype")
    return state_dtype in (None, dtype) or state_dtype.itemsize < dtype.itemsize


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_foreach_and_loop_agree_in_every_dtype(name: str, dtype: torch.dtype) -> None:
    cls, kwargs = CONFIGS[name]
    if not _supported(kwargs, dtype):
        with pytest.raises(ValueError, match=r"(wider than|as wide as) a parameter's dtype"):
            cls(_params(dtype), **kwargs)
        return
    final = {}
    for path, flags in PATHS.items():
        params = _params(dtype)
        _run(cls(params, **kwargs, **flags), params, range(5))
        final[path] = [p.detach().double() for p in params]
    # The loop and foreach compute in the parameters' dtype; the fused step in
    # float32 below it (test_torch_fused.py's low-precision test holds it to the
    # float32 step), where float16 and bfloat16 arithmetic differ from it by more
    # than rounding (an underflowing second moment divides by 0 in float16).
    compared = ("foreach", "fused") if dtype in (torch.float64, torch.float32) else ("foreach",)
    rtol, atol = TOLERANCE[dtype]
    if "state_dtype" in kwargs:  # rounded state: the same noise, but paths round differently
        rtol, atol = max(rtol, 1e-2), max(atol, 1e-3)
    for path in compared:
        for a, b in zip(final[path], final["loop"], strict=True):
            # equal_nan: QHAdam's second moment underflows in float16 (|g| < 2.4e-4),
            # and both paths divide by 0 alike there.
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=path)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_hooks_run_once_per_step_before_and_after(name: str, path: str) -> None:
    cls, kwargs = CONFIGS[name]
    params = _params(torch.float32)
    opt = cls(params, **kwargs, **PATHS[path])
    calls: list[str] = []
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    post = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    _run(opt, params, range(2))
    assert calls == ["pre", "post"] * 2
    pre.remove()
    post.remove()
    _run(opt, params, range(2, 3))
    assert calls == ["pre", "post"] * 2


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_without_gradients_changes_nothing(name: str, path: str) -> None:
    cls, kwargs = CONFIGS[name]
    params = _params(torch.float32)
    before = [p.detach().clone() for p in params]
    opt = cls(params, **kwargs, **PATHS[path])
    opt.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    assert all(not opt.state[p] for p in params)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_resumed_run_continues_exactly(name: str, path: str) -> None:
    cls, kwargs = CONFIGS[name]
    params = _params(torch.float32)
    opt = cls(params, **kwargs, **PATHS[path])
    _run(opt, params, range(3))
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    _run(opt, params, range(3, 6))
    resumed = cls(resumed_params, **kwargs, **PATHS[path])
    resumed.load_state_dict(saved)
    _run(resumed, resumed_params, range(3, 6))
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), resumed.state.values(), strict=True):
        for key, value in a.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b[key])), key
