"""The newest features under attack: GradScaler with groups that are not fused,
frozen groups and ``meta`` parameters with ``fused=True``, float16 second
moments, NaN parameters in the fused kernels, skipped steps' counts.

Each test fails on the code before its fix (docs/robustness.md states the rules).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from qhoptim.torch import QHM, QHAdam, QHAdamW

F32 = torch.float32
CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7}),
    (QHAdam, {"lr": 0.01, "nus": (0.7, 1.0)}),
    (QHAdamW, {"lr": 0.01, "nus": (0.7, 0.8), "amsgrad": True}),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(CONFIGS)]


def _params(n: int = 2, dtype: torch.dtype = F32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2, generator=gen, dtype=dtype)) for _ in range(n)]


def _snapshot(opt: Any, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _assert_unchanged(opt: Any, params: list[torch.Tensor], before: Any) -> None:
    for p, b in zip(params, before[0], strict=True):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    after = opt.state_dict()["state"]
    assert after.keys() == before[1].keys()
    for key, state in before[1].items():
        for name, value in state.items():
            torch.testing.assert_close(after[key][name], value, rtol=0, atol=0)


# ------------------------------------------------------- GradScaler, mixed groups
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_grad_scaler_refuses_a_group_that_is_not_fused_before_anything_moves(
    cls: type, kwargs: dict[str, Any]
) -> None:
    # GradScaler sees a fused optimizer and hands its scale over instead of
    # unscaling; a group that is not fused would step by the scaled gradients.
    a, b = _params()
    opt = cls([{"params": [a]}, {"params": [b], "fused": False}], **kwargs, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for p in (a, b):
        p.grad = scaler.scale(torch.ones_like(p))
    opt.step()  # without GradScaler: both groups step, each its own way
    for p in (a, b):
        p.grad = scaler.scale(torch.ones_like(p))
    before = _snapshot(opt, [a, b])
    with pytest.raises(RuntimeError, match=r"param groups \[1\] are not fused"):
        scaler.step(opt)
    _assert_unchanged(opt, [a, b], before)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_grad_scaler_refuses_a_non_fused_checkpoint_loaded_into_a_fused_optimizer(
    cls: type, kwargs: dict[str, Any]
) -> None:
    source_params = _params()
    source = cls(source_params, **kwargs)  # fused=None
    for p in source_params:
        p.grad = torch.ones_like(p)
    source.step()
    params = _params()
    opt = cls(params, **kwargs, fused=True)
    opt.load_state_dict(source.state_dict())  # the groups' fused=None comes along
    scaler = torch.amp.GradScaler("cpu")
    for p in params:
        p.grad = scaler.scale(torch.ones_like(p))
    with pytest.raises(RuntimeError, match="not fused"):
        scaler.step(opt)


# ------------------------------------------------------------- frozen groups
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_a_frozen_group_is_skipped_by_the_fused_step(cls: type, kwargs: dict[str, Any]) -> None:
    runs = []
    for impl in ({"fused": True}, {"foreach": True}):
        a, b = _params()
        opt = cls([{"params": [a]}, {"params": [b]}], **kwargs, **impl)
        for _ in range(3):
            a.grad = torch.ones_like(a)  # b is frozen: no gradient
            opt.step()
        assert b not in opt.state or not opt.state[b]
        runs.append((a.detach().clone(), b.detach().clone()))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_the_functional_fused_step_of_no_tensors_does_nothing(
    cls: type, kwargs: dict[str, Any]
) -> None:
    from qhoptim.torch import qhadam, qhm

    if cls is QHM:
        qhm([], [], [], fused=True, lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.0,
            decoupled_weight_decay=False, maximize=False)  # fmt: skip
    else:
        qhadam([], [], [], [], [], fused=True, lr=0.01, beta1=0.9, beta2=0.999, nu1=0.7,
               nu2=1.0, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
               maximize=False)  # fmt: skip


# ------------------------------------------------------------------- meta
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_fused_optimizer_of_a_meta_model_steps_once_materialized(
    cls: type, kwargs: dict[str, Any]
) -> None:
    # A model built on meta, the optimizer built before it is materialized
    # (to_empty): torch's fused Adam takes that, checking devices at step().
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    opt = cls(model.parameters(), **kwargs, fused=True)
    model.to_empty(device="cpu")
    torch.nn.init.ones_(model.weight)
    torch.nn.init.zeros_(model.bias)
    # to_empty replaces the parameters: the optimizer is rebuilt on them, as
    # torch's documentation has it -- or takes the materialized ones here.
    opt.param_groups[0]["params"] = list(model.parameters())
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert torch.isfinite(model.weight).all()


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_fused_step_on_meta_parameters_is_refused_with_the_device_named(
    cls: type, kwargs: dict[str, Any]
) -> None:
    p = torch.nn.Parameter(torch.empty(3, device="meta"))
    opt = cls([p], **kwargs, fused=True)  # built: devices are checked at step()
    p.grad = torch.empty(3, device="meta")
    with pytest.raises(RuntimeError, match=r"supported devices: \['cpu', 'cuda'\].*meta"):
        opt.step()
    assert not opt.state[p]


# --------------------------------------------------------- float16 state
@pytest.mark.parametrize("cls", [QHAdam, QHAdamW])
def test_float16_state_is_refused_for_qhadams_second_moment(cls: type) -> None:
    with pytest.raises(ValueError, match=r"state_dtype=float16 cannot hold QHAdam's second"):
        cls(_params(), state_dtype=torch.float16)
    opt = cls(_params())
    with pytest.raises(ValueError, match=r"state_dtype=float16 cannot hold"):
        opt.add_param_group({"params": _params(1), "state_dtype": torch.float16})


def test_float16_state_of_qhm_still_rounds_to_nearest() -> None:
    params, wide_params = _params(), _params()
    opt = QHM(params, lr=0.1, state_dtype=torch.float16)
    wide = QHM(wide_params, lr=0.1)
    for o, ps in ((opt, params), (wide, wide_params)):
        for p in ps:
            p.grad = torch.full_like(p, 1e-3)
        o.step()
    for p, q in zip(params, wide_params, strict=True):
        buf = wide.state[q]["momentum_buffer"].to(torch.float16)
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)


# ------------------------------------------------- NaN parameters, fused
@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_a_nan_parameter_leaves_its_state_finite_without_coupled_decay(
    cls: type, kwargs: dict[str, Any]
) -> None:
    # 0 * NaN is NaN: a coupled decay of 0 must not be applied at all.
    for impl in ({"fused": True}, {"foreach": True}):
        p = torch.nn.Parameter(torch.tensor([float("nan"), 1.0, -2.0]))
        opt = cls([p], **kwargs, **impl)
        p.grad = torch.tensor([0.5, 0.5, 0.5])
        opt.step()
        for name, value in opt.state[p].items():
            if name != "step":
                assert torch.isfinite(value).all(), (impl, name, value)


# ----------------------------------------------- skipped steps' counts
def test_a_skipped_fused_qhm_step_with_narrow_state_leaves_its_count() -> None:
    params = _params()
    opt = QHM(params, lr=0.1, fused=True, state_dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for t in range(3):
        for p in params:
            p.grad = scaler.scale(torch.ones_like(p))
        if t == 1:
            params[0].grad[0, 0] = torch.inf
            before = _snapshot(opt, params)
        scaler.step(opt)
        scaler.update()
        if t == 1:
            _assert_unchanged(opt, params, before)
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 2.0]


# ------------------------------------------ narrow state on every layout
NARROW = [torch.bfloat16, torch.float16, torch.uint8]
PATHS = [{"foreach": False}, {"foreach": True}, {"fused": True}]


@pytest.mark.parametrize("path", PATHS, ids=["loop", "foreach", "fused"])
@pytest.mark.parametrize(
    ("cls", "state_dtype"),
    # QHAdam refuses float16 (test_float16_state_is_refused_for_qhadams_second_moment).
    [(cls, d) for cls in (QHM, QHAdam) for d in NARROW if (cls, d) != (QHAdam, torch.float16)],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
@pytest.mark.parametrize("chunk", [None, 256], ids=["whole", "sliced"])
def test_narrow_state_steps_any_layout_as_the_contiguous_tensor(
    cls: type,
    state_dtype: torch.dtype,
    path: dict[str, bool],
    chunk: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # channels_last weights, transposed parameters and gradients: the step (and
    # its rounding, by row-major position) is that of the same values laid out
    # contiguously. chunk=256: on the working copies (which CPU tensors take
    # where the C++ kernel cannot be built), tensors larger than their chunk
    # (whole 8-bit blocks, as the chunk of 2**22 values is).
    from qhoptim.torch import _state_dtype

    if chunk is not None:  # on float32 working copies, a slice at a time
        monkeypatch.setattr(_state_dtype, "CHUNK_VALUES", chunk)
        monkeypatch.setattr(_state_dtype, "in_fused_kernel", lambda *args: False)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 8, 3, 3, generator=gen)
    matrix = torch.randn(24, 30, generator=gen)
    grads = [
        (torch.randn(8, 8, 3, 3, generator=gen), torch.randn(30, 24, generator=gen).t())
        for _ in range(3)
    ]
    layouts = {
        "strided": [
            torch.nn.Parameter(weight.to(memory_format=torch.channels_last)),
            torch.nn.Parameter(matrix.t().contiguous().t()),
        ],
        "contiguous": [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(matrix.clone())],
    }
    results = {}
    for name, params in layouts.items():
        opt = cls(params, lr=0.1, state_dtype=state_dtype, **path)
        for w_grad, m_grad in grads:
            params[0].grad = w_grad.to(memory_format=torch.channels_last)
            params[1].grad = m_grad if name == "strided" else m_grad.contiguous()
            opt.step()
        results[name] = [p.detach().contiguous() for p in params]
    assert not layouts["strided"][0].is_contiguous()
    for a, b in zip(results["strided"], results["contiguous"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------- checkpoints of another state_dtype
STORAGE = [None, torch.bfloat16, torch.uint8]


@pytest.mark.parametrize("saved", STORAGE, ids=str)
@pytest.mark.parametrize("own", STORAGE, ids=str)
@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_a_checkpoint_of_another_state_dtype_is_converted_to_the_optimizers(
    cls: type, own: torch.dtype | None, saved: torch.dtype | None
) -> None:
    from qhoptim.torch import _state_dtype

    params = _params()
    source = cls(params, lr=0.1, state_dtype=saved)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        source.step()
    checkpoint = copy.deepcopy(source.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(resumed_params, lr=0.1, state_dtype=own)
    resumed.load_state_dict(checkpoint)
    assert resumed.param_groups[0]["state_dtype"] == own
    keys = cls._STATE_LISTS
    for p, q in zip(params, resumed_params, strict=True):
        for key, signed in zip(keys, cls._SIGNED, strict=False):
            if key not in source.state[p]:
                continue
            value = resumed.state[q][key]
            # What the source held, as values; and what the resumed one holds.
            held = _state_dtype.converted(source.state[p][key], p, saved, None, signed)
            now = _state_dtype.converted(value, q, own, None, signed)
            if own == torch.uint8:
                assert value.dtype == torch.uint8
                assert value.numel() == _state_dtype.packed_numel(q.numel())
                ratio = (now - held).abs().max() / held.abs().max()
                assert ratio <= 0.1  # one 8-bit level (9%) at the most
            else:
                assert value.dtype == (torch.float32 if own is None else own)
                torch.testing.assert_close(now, held.to(value.dtype).float(), rtol=0, atol=0)
    for p in resumed_params:  # and it steps
        p.grad = torch.ones_like(p)
    resumed.step()


# ------------------------------------- 8-bit state: a bad value keeps to itself
@pytest.mark.parametrize("encoder", ["c++", "torch operations"])
@pytest.mark.parametrize("bad", [1e22, float("nan")], ids=["square-overflows", "nan"])
@pytest.mark.parametrize("path", PATHS, ids=["loop", "foreach", "fused"])
def test_one_bad_gradient_leaves_the_rest_of_its_8_bit_block_finite(
    path: dict[str, bool], bad: float, encoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As with float32 state: a gradient of 1e22 (its square overflows) takes
    # a zero step where the second moment is inf, a NaN gradient poisons its
    # own coordinate; the other 511 values step on, finite.
    from qhoptim.torch import _state_dtype

    if encoder != "c++":
        monkeypatch.setattr(_state_dtype, "_cpu_kernel", lambda: None)
    non_finite = {}
    for state_dtype in (None, torch.uint8):
        p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 512))
        opt = QHAdam([p], lr=0.01, nus=(0.7, 1.0), state_dtype=state_dtype, **path)
        for t in range(3):
            grad = torch.full_like(p, 0.1)
            if t == 0:
                grad[300] = bad
            p.grad = grad
            opt.step()
        non_finite[state_dtype] = (~torch.isfinite(p.detach())).nonzero().flatten().tolist()
    assert non_finite[torch.uint8] == non_finite[None]
    assert non_finite[None] == ([] if bad == 1e22 else [300])


@pytest.mark.parametrize("cls", [QHM, QHAdam])
@pytest.mark.parametrize("shape", [(256,), (4, 4, 16)], ids=str)
def test_an_8_bit_state_loads_only_into_a_parameter_of_its_shape(
    cls: type, shape: tuple[int, ...]
) -> None:
    # The packed state is flat: its parameter's shape is recorded beside it,
    # so that it is refused where a float32 state of that shape would be.
    p = torch.nn.Parameter(torch.randn(16, 16))
    opt = cls([p], lr=0.1, state_dtype=torch.uint8)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other = torch.nn.Parameter(torch.randn(shape))
    before = cls([other], lr=0.1, state_dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"8-bit state of parameter 0 is a parameter's of shape"):
        before.load_state_dict(saved)
    assert not before.state[other]
    same = torch.nn.Parameter(torch.randn(16, 16))
    resumed = cls([same], lr=0.1, state_dtype=torch.uint8)
    resumed.load_state_dict(saved)
    record = resumed.state[same]["param_shape"]
    assert record.dtype == torch.int64 and record.tolist() == [16, 16]


# ------------------------------------------ a group's own flags, checked as the defaults'
@pytest.mark.parametrize("cls", [QHM, QHAdam])
@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("foreach", r"`fused` and `foreach` cannot be `True` together"),
        ("differentiable", r"`fused` does not support `differentiable`"),
    ],
)
def test_a_groups_fused_flag_is_refused_beside_foreach_or_differentiable(
    cls: type, flag: str, message: str
) -> None:
    # Only the defaults were checked: a group's fused=True beside
    # differentiable=True stepped without recording autograd, silently.
    opt = cls(_params(), lr=0.1)
    with pytest.raises(RuntimeError, match=message):
        opt.add_param_group({"params": _params(1), "fused": True, flag: True})
    assert len(opt.param_groups) == 1
    ps = [p for g in opt.param_groups for p in g["params"]]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = _snapshot(opt, ps)
    opt.param_groups[0].update({"fused": True, flag: True})  # set later: refused at the step
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    _assert_unchanged(opt, ps, before)


@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_fused_set_on_a_group_of_complex_parameters_is_refused_before_any_group_steps(
    cls: type,
) -> None:
    # Their state existed, so the first-step check of fused parameters did not
    # run: the kernel failed after the first group had moved.
    real, cplx = _params(1)[0], torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))
    opt = cls([{"params": [real]}, {"params": [cplx]}], lr=0.1)
    for p in (real, cplx):
        p.grad = torch.ones_like(p)
    opt.step()
    before = _snapshot(opt, [real, cplx])
    opt.param_groups[1]["fused"] = True
    with pytest.raises(RuntimeError, match=r"`fused=True` requires all the params to be floating"):
        opt.step()
    _assert_unchanged(opt, [real, cplx], before)


@pytest.mark.parametrize("cls", [QHM, QHAdam])
def test_a_complex_parameter_appended_to_a_narrow_state_group_is_refused(cls: type) -> None:
    # add_param_group refuses it; appended to a group's params, QHM stepped it
    # with a real bfloat16 buffer (its imaginary momentum dropped) and QHAdam
    # failed after the first group had moved.
    ps = _params(2)
    opt = cls([{"params": ps[:1]}, {"params": ps[1:], "state_dtype": torch.bfloat16}], lr=0.1)
    cplx = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))
    opt.param_groups[1]["params"].append(cplx)
    for p in (*ps, cplx):
        p.grad = torch.ones_like(p)
    before = _snapshot(opt, [*ps, cplx])
    with pytest.raises(ValueError, match="state_dtype applies to real parameters"):
        opt.step()
    _assert_unchanged(opt, [*ps, cplx], before)
