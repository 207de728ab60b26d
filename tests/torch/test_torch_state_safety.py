"""load_state_dict refuses state that does not fit, and leaves the optimizer unchanged."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from qh_torch_testing import random_grads, run_torch

from qhoptim.torch import QHM, QHAdam, QHAdamW, QHMuon

F64 = torch.float64
SHAPES = [(3, 2), (4,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64)) for s in SHAPES]


def _trained(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], steps: int = 3) -> Any:
    params = _params()
    opt = make(params)
    run_torch(opt, params, random_grads(SHAPES, steps))
    return opt


def _snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, state in a["state"].items():
        assert state.keys() == b["state"][i].keys()
        for key, value in state.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


QH = {
    "QHM": lambda ps: QHM(ps, lr=0.5, momentum=0.9, nu=0.7),
    "QHAdam": lambda ps: QHAdam(ps, lr=0.01, nus=(0.7, 0.9)),
    "QHAdamW": lambda ps: QHAdamW(ps, lr=0.01, nus=(0.7, 1.0)),
}
FOREIGN = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    **QH,
}
PAIRS = [
    (target, source)
    for target in QH
    for source in FOREIGN
    if source != target and {source, target} != {"QHAdam", "QHAdamW"}
]


@pytest.mark.parametrize(("target", "source"), PAIRS)
def test_a_state_dict_of_another_optimizer_is_refused(target: str, source: str) -> None:
    opt = _trained(QH[target])
    before = _snapshot(opt)
    foreign = _trained(FOREIGN[source]).state_dict()
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(foreign)
    _assert_same(opt.state_dict(), before)


MATRICES = {
    "QHM": lambda ps: QHM(ps, lr=0.5, momentum=0.95, nu=0.7),
    "QHAdam": lambda ps: QHAdam(ps, lr=0.01),
    "QHMuon": lambda ps: QHMuon(ps, lr=0.02, momentum=0.95, weight_decay=0.1),
    "torch Muon": lambda ps: torch.optim.Muon(ps, lr=0.02),
}


@pytest.mark.parametrize(
    ("target", "source"),
    [(t, s) for t in ("QHM", "QHAdam", "QHMuon") for s in MATRICES if s != t],
)
def test_a_state_dict_of_another_optimizer_on_matrices_is_refused(target: str, source: str) -> None:
    # A QHMuon group holds every key QHM's needs (and its state a momentum
    # buffer): its own keys (ns_coefficients, ...) tell it apart, or its
    # decoupled decay would load as QHM's coupled one.
    def trained(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Any:
        params = [torch.nn.Parameter(torch.ones(4, 3))]
        opt = make(params)
        params[0].grad = torch.full((4, 3), 0.5)
        opt.step()
        return opt

    opt = trained(MATRICES[target])
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(trained(MATRICES[source]).state_dict())
    _assert_same(opt.state_dict(), before)


def _corrupt_cases() -> list[tuple[str, str, Callable[[dict[str, Any]], None], type, str]]:
    def set_state(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def apply(sd: dict[str, Any]) -> None:
            sd["state"][0][key] = value

        return apply

    def drop_state(key: str) -> Callable[[dict[str, Any]], None]:
        return lambda sd: sd["state"][0].pop(key)

    def set_group(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def apply(sd: dict[str, Any]) -> None:
            sd["param_groups"][0][key] = value

        return apply

    return [
        ("QHM", "shape", set_state("momentum_buffer", torch.zeros(2, 3, dtype=F64)), ValueError,
         r"momentum_buffer of parameter 0 has shape \(2, 3\), the parameter \(3, 2\)"),
        ("QHM", "broadcastable shape", set_state("momentum_buffer", torch.zeros(1, dtype=F64)),
         ValueError, r"has shape \(1,\), the parameter \(3, 2\)"),
        ("QHM", "int dtype", set_state("momentum_buffer", torch.zeros(3, 2, dtype=torch.int64)),
         ValueError, "dtype torch.int64, which cannot hold the state"),
        ("QHM", "complex for a real param",
         set_state("momentum_buffer", torch.zeros(3, 2, dtype=torch.complex128)), ValueError,
         "dtype torch.complex128"),
        ("QHM", "not a tensor", set_state("momentum_buffer", [[0.0] * 2] * 3), TypeError,
         "must be a tensor; received list"),
        ("QHM", "missing key", drop_state("momentum_buffer"), None, ""),
        ("QHM", "another optimizer's key instead",
         lambda sd: sd["state"][0].update(exp_avg=sd["state"][0].pop("momentum_buffer")),
         ValueError, r"has keys \['exp_avg'\], expected \['momentum_buffer'\]"),
        ("QHAdam", "an incomplete layout beside a foreign key",
         lambda sd: sd["state"][0].update(slow=sd["state"][0].pop("exp_avg_sq")), ValueError,
         r"has keys \['exp_avg', 'slow', 'step'\], expected"),
        ("QHM", "bad momentum", set_group("momentum", 1.5), ValueError,
         r"^momentum must be in \[0, 1\); received momentum=1.5$"),
        ("QHM", "bad weight_decay_type", set_group("weight_decay_type", "l2"), ValueError,
         "weight_decay_type must be 'grad' or 'direct'"),
        ("QHM", "missing nu", lambda sd: sd["param_groups"][0].pop("nu"), ValueError,
         r"param group 0 lacks \['nu'\]"),
        ("QHAdam", "missing exp_avg_sq", drop_state("exp_avg_sq"), ValueError,
         r"has keys \['exp_avg', 'step'\], expected"),
        ("QHAdam", "shape", set_state("exp_avg_sq", torch.zeros(6, dtype=F64)), ValueError,
         r"exp_avg_sq of parameter 0 has shape \(6,\)"),
        ("QHAdam", "step shape", set_state("step", torch.zeros(2)), ValueError,
         "step of parameter 0 must be a real number or a 1-element tensor"),
        ("QHAdam", "negative step", set_state("step", torch.tensor(-3.0)), ValueError,
         r"step of parameter 0 must be in \[0, inf\); received -3.0"),
        ("QHAdam", "nan step", set_state("step", torch.tensor(float("nan"))), ValueError,
         r"step of parameter 0 must be in \[0, inf\); received nan"),
        ("QHAdam", "string step", set_state("step", "3"), TypeError,
         "step of parameter 0 must be a number"),
        ("QHAdam", "betas triple", set_group("betas", (0.9, 0.99, 0.999)), ValueError,
         "betas must be a pair of two numbers"),
        ("QHAdam", "nu2 out of range", set_group("nus", (0.7, 1.5)), ValueError,
         r"^nus\[1\] must be in \[0, 1\]; received nus\[1\]=1.5$"),
        ("QHAdam", "unknown parameter", lambda sd: sd["state"].update({7: sd["state"][0]}),
         ValueError, "state for parameter 7, which none of its param groups lists"),
        ("QHAdam", "a group too many", lambda sd: sd["param_groups"].append(
            {**sd["param_groups"][0], "params": []}), ValueError, "has 2 param groups"),
        ("QHAdam", "a parameter too many", lambda sd: sd["param_groups"][0]["params"].append(9),
         ValueError, "param group 0 of the state dict has 3 parameters"),
        ("QHAdam", "no state dtype", set_group("state_dtype", "torch.float8"), ValueError,
         r"state_dtype must be None or one of torch\.bfloat16, .*'torch\.float8'"),
    ]  # fmt: skip


CORRUPT = _corrupt_cases()


@pytest.mark.parametrize(
    ("target", "what", "corrupt", "error", "match"),
    CORRUPT,
    ids=[f"{c[0]}-{c[1]}" for c in CORRUPT],
)
def test_a_corrupt_state_dict_is_refused_and_nothing_changes(
    target: str, what: str, corrupt: Callable[[dict[str, Any]], None], error: Any, match: str
) -> None:
    opt = _trained(QH[target])
    saved = copy.deepcopy(opt.state_dict())
    corrupt(saved)
    if error is None:
        # QHM's state of a parameter may be empty (not stepped yet): fine to load.
        opt.load_state_dict(saved)
        return
    twin = _trained(QH[target])
    before = _snapshot(opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), before)
    # ... and it continues exactly as an optimizer that never saw the bad state.
    grads = random_grads(SHAPES, 2, seed=5)
    got = run_torch(opt, opt.param_groups[0]["params"], grads)
    want = run_torch(twin, twin.param_groups[0]["params"], grads)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a, b, strict=True):
            assert (x == y).all()


@pytest.mark.parametrize("value", [None, [], {"state": {}}, "state_dict"])
def test_something_that_is_not_a_state_dict_is_a_type_error(value: Any) -> None:
    opt = _trained(QH["QHAdam"])
    with pytest.raises(TypeError, match="expects a dict with 'state' and 'param_groups'"):
        opt.load_state_dict(value)


def test_pre_hooks_run_once_and_before_the_checks() -> None:
    calls = []
    opt = _trained(QH["QHM"])
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["momentum"] = 7.0  # invalid, repaired by the hook

    def repair(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        state_dict["param_groups"] = copy.deepcopy(state_dict["param_groups"])
        state_dict["param_groups"][0]["momentum"] = 0.5
        return state_dict

    opt.register_load_state_dict_pre_hook(repair)
    opt.load_state_dict(saved)
    assert calls == [1]
    assert opt.param_groups[0]["momentum"] == 0.5
    opt.load_state_dict(opt.state_dict())  # the hook stays registered
    assert calls == [1, 1]


@pytest.mark.parametrize("name", list(QH))
def test_state_dicts_load_with_weights_only(name: str) -> None:
    opt = _trained(QH[name])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # no arbitrary unpickling
    twin = QH[name](_params())
    twin.load_state_dict(loaded)
    _assert_same(twin.state_dict(), opt.state_dict())


DTYPED = {
    "QHM-8-bit": lambda ps: QHM(ps, lr=0.5, state_dtype=torch.uint8),
    "QHAdam-bfloat16": lambda ps: QHAdam(ps, lr=0.01, state_dtype=torch.bfloat16),
    "QHMuon": lambda ps: QHMuon(ps, lr=0.01),  # its ns_dtype, a dtype too
}


def _float32_trained(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Any:
    model = torch.nn.Linear(24, 16, bias=False)  # a matrix: QHMuon's too
    opt = make(list(model.parameters()))
    for seed in range(2):
        model(torch.randn(4, 24, generator=torch.Generator().manual_seed(seed))).sum().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name", list(DTYPED))
def test_a_state_dict_holds_dtypes_by_name_and_distributed_checkpoint_takes_it(
    name: str,
) -> None:
    # torch.distributed.checkpoint flattens and offloads state dicts of numbers,
    # bools, strings, None and tensors (torch's optimizers'), and refused one
    # holding a torch.dtype; the dtypes are written as their names and read back.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _float32_trained(DTYPED[name])
    groups = opt.state_dict()["param_groups"]
    assert not any(isinstance(v, torch.dtype) for g in groups for v in g.values())
    assert all(isinstance(g.get("state_dtype", "torch.x"), (str, type(None))) for g in groups)
    for options in (StateDictOptions(full_state_dict=True), StateDictOptions(cpu_offload=True)):
        saved = get_optimizer_state_dict(model, opt, options=options)
        twin_model = copy.deepcopy(model)
        twin = DTYPED[name](list(twin_model.parameters()))
        set_optimizer_state_dict(twin_model, twin, saved, options=options)
        for key in ("state_dtype", "ns_dtype"):
            assert twin.param_groups[0].get(key) == opt.param_groups[0].get(key)
        # (its round trip makes the groups' tuples lists, torch Adam's betas too)
        twin_state, state = twin.state_dict()["state"], opt.state_dict()["state"]
        _assert_same(
            {"param_groups": [], "state": twin_state}, {"param_groups": [], "state": state}
        )


@pytest.mark.parametrize("name", list(DTYPED))
def test_a_state_dict_holding_the_dtypes_themselves_loads(name: str) -> None:
    # As earlier versions wrote them.
    _, opt = _float32_trained(DTYPED[name])
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("state_dtype", "ns_dtype"):
            if isinstance(group.get(key), str):
                group[key] = getattr(torch, group[key].removeprefix("torch."))
    _, twin = _float32_trained(DTYPED[name])
    twin.load_state_dict(saved)
    assert isinstance(twin.param_groups[0]["state_dtype"], (torch.dtype, type(None)))
    _assert_same(twin.state_dict(), opt.state_dict())


def test_a_tensor_lr_state_dict_loads_with_weights_only() -> None:
    params = _params()
    opt = QHAdam(params, lr=torch.tensor(0.01))
    run_torch(opt, params, random_grads(SHAPES, 2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = QHAdam(_params(), lr=torch.tensor(0.5))
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(twin.param_groups[0]["lr"], torch.tensor(0.01))


# --------------------------------------------------- a loaded step of another dtype
@pytest.mark.parametrize(
    "step_dtype", [torch.int64, torch.int32, torch.float16, torch.float64, "python"]
)
@pytest.mark.parametrize(
    "flags",
    [{}, {"foreach": False}, {"foreach": True}, {"capturable": True}],
    ids=["default", "loop", "foreach", "capturable"],
)
def test_a_saved_step_of_another_dtype_is_cast_on_load(step_dtype: Any, flags: dict) -> None:
    # A step saved as int64 (or float16) used to pass the checks, and then every
    # multi-tensor step failed on the mix of dtypes.
    def make(ps: list[torch.Tensor]) -> QHAdam:
        return QHAdam(ps, lr=0.01, nus=(0.7, 0.9), **flags)

    saved = _trained(make).state_dict()
    edited = copy.deepcopy(saved)
    for state in edited["state"].values():
        count = int(state["step"].item())
        state["step"] = count if step_dtype == "python" else torch.tensor(count, dtype=step_dtype)
    expected_params, loaded_params = _params(1), _params(1)
    expected, loaded = make(expected_params), make(loaded_params)
    expected.load_state_dict(copy.deepcopy(saved))
    loaded.load_state_dict(edited)
    pairs = zip(expected.param_groups[0]["params"], loaded.param_groups[0]["params"], strict=True)
    for p, q in pairs:
        want, got = expected.state[p]["step"], loaded.state[q]["step"]
        assert (got.dtype, got.device, got.shape) == (want.dtype, want.device, want.shape)
    grads = random_grads(SHAPES, 2, seed=5)
    run_torch(expected, expected_params, grads)
    run_torch(loaded, loaded_params, grads)
    for a, b in zip(expected_params, loaded_params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


SEEDED_SHAPES = [(3, 2), (4, 3)]
SEEDED = {  # a narrow state: a step count for the rounding's seeds
    "QHM": lambda ps: QHM(ps, lr=0.5, momentum=0.9, nu=0.7, state_dtype=torch.bfloat16),
    "QHMuon": lambda ps: QHMuon(ps, lr=0.02, state_dtype=torch.bfloat16),
}


@pytest.mark.parametrize(
    "step_of",
    [int, float, lambda n: torch.tensor([n], dtype=torch.float64)]
    + [lambda n, d=d: torch.tensor(n, dtype=d) for d in (torch.int64, torch.float16)],
    ids=["python-int", "python-float", "shape-1", "int64", "float16"],
)
@pytest.mark.parametrize("name", SEEDED)
def test_a_saved_seed_count_of_another_kind_is_cast_on_load(name: str, step_of: Any) -> None:
    # A Python number failed the next step after it had moved the parameters
    # (QHM, QHMuon); QHMuon kept a float16 count, which stops at 2048 and
    # repeats the rounding's seeds from there.
    def params() -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64)) for s in SEEDED_SHAPES]

    trained = SEEDED[name](ps := params())
    run_torch(trained, ps, random_grads(SEEDED_SHAPES, 3))
    saved = trained.state_dict()
    edited = copy.deepcopy(saved)
    for state in edited["state"].values():
        state["step"] = step_of(int(state["step"].item()) + 2045)
    for state in saved["state"].values():
        state["step"] = torch.tensor(float(state["step"].item()) + 2045, dtype=F64)
    expected_params, loaded_params = params(), params()
    expected, loaded = SEEDED[name](expected_params), SEEDED[name](loaded_params)
    expected.load_state_dict(saved)
    loaded.load_state_dict(edited)
    for q in loaded_params:
        step = loaded.state[q]["step"]
        assert (step.dtype, step.shape) == (F64, ())
    grads = random_grads(SEEDED_SHAPES, 4, seed=5)
    run_torch(expected, expected_params, grads)
    run_torch(loaded, loaded_params, grads)
    for a, b in zip(expected_params, loaded_params, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert float(loaded.state[loaded_params[0]]["step"]) == 2052


@pytest.mark.parametrize("name", ["QHM", "QHAdam"])
def test_a_wrappers_entries_beside_the_state_load_and_stay(name: str) -> None:
    # timm's Lookahead keeps its slow weights in the wrapped optimizer's state
    # ("lookahead_slow_buff"); torch.optim keeps such entries, and so does qhoptim.
    opt = _trained(QH[name])
    sd = opt.state_dict()
    slow = torch.full((3, 2), 0.5, dtype=F64)
    sd["state"][0]["lookahead_slow_buff"] = slow
    sd["state"][0]["slow_steps"] = 6
    resumed = _trained(QH[name])
    resumed.load_state_dict(sd)
    p = resumed.param_groups[0]["params"][0]  # parameter 0, of shape (3, 2)
    assert resumed.state[p]["slow_steps"] == 6
    torch.testing.assert_close(resumed.state[p]["lookahead_slow_buff"], slow)
    for q in resumed.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    resumed.step()
    torch.testing.assert_close(resumed.state[p]["lookahead_slow_buff"], slow)


# ------------------------------------------------ values changed after the group is made
def _two_groups(make: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> Any:
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(300, generator=gen)) for _ in range(2)]
    opt = make([{"params": [params[0]]}, {"params": [params[1]]}], **kwargs)
    for p in params:
        p.grad = torch.randn(300, generator=gen)
    opt.step()
    return opt, params


CHANGED_VALUES: list[tuple[Callable[..., torch.optim.Optimizer], str, Any, str]] = [
    (QHAdam, "lr", -0.005, r"lr must be in \[0, inf\); received lr=-0.005"),
    (QHAdam, "betas", (1.0, 0.999), r"betas\[0\] must be in \[0, 1\); received betas\[0\]=1.0"),
    (QHAdamW, "eps", -1.0, r"eps must be in \[0, inf\); received eps=-1.0"),
    (QHM, "momentum", 1.5, r"momentum must be in \[0, 1\); received momentum=1.5"),
    (QHM, "weight_decay", float("nan"), r"weight_decay must be in \[0, inf\); received"),
]


@pytest.mark.parametrize(("make", "key", "value", "message"), CHANGED_VALUES)
def test_a_value_made_invalid_after_the_group_is_refused_before_any_group_moves(
    make: Callable[..., torch.optim.Optimizer], key: str, value: Any, message: str
) -> None:
    # A scheduler run past its end (LambdaLR's linear decay gives a negative
    # lr) or a hand sets a value the constructor refuses. torch's optimizers
    # step by it; here the next step raises the constructor's error before
    # either group moves, and the checkpoint stays loadable.
    kwargs = {"lr": 0.1} if make is QHM else {}
    opt, params = _two_groups(make, **kwargs)
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict())
    opt.param_groups[1][key] = value
    with pytest.raises(ValueError, match=message):
        opt.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    after = opt.state_dict()["state"]
    for index, saved in state_before["state"].items():
        for name, value in saved.items():
            assert torch.equal(after[index][name], value), (index, name)
    opt.param_groups[1][key] = state_before["param_groups"][1][key]
    opt.step()  # the value mended, it steps
    fresh, _ = _two_groups(make, **kwargs)
    fresh.load_state_dict(opt.state_dict())


def test_a_lambda_lr_run_past_its_end_is_refused_at_the_step() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = QHAdam(params, lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 4)
    for step in range(6):
        params[0].grad = torch.ones(3)
        if opt.param_groups[0]["lr"] < 0:
            with pytest.raises(ValueError, match=r"received lr=-0.0025"):
                opt.step()
            assert step == 5
            return
        opt.step()
        schedule.step()
    raise AssertionError("the schedule never went negative")


def test_a_concrete_scalar_set_after_the_group_is_read_as_a_float() -> None:
    np = pytest.importorskip("numpy")
    opt, _ = _two_groups(QHM, lr=0.1)
    opt.param_groups[0]["momentum"] = np.float32(0.5)
    opt.step()
    assert type(opt.param_groups[0]["momentum"]) is float


STATE_DTYPE_CHANGES = [
    (None, torch.bfloat16),
    (None, torch.uint8),
    (torch.bfloat16, None),
    (torch.uint8, torch.bfloat16),
]


def _copied(opt: torch.optim.Optimizer, how: str) -> torch.optim.Optimizer:
    if how == "deepcopy":
        return copy.deepcopy(opt)
    if how == "pickle":
        return pickle.loads(pickle.dumps(opt))
    return opt


@pytest.mark.parametrize("make", [QHM, QHAdam, QHMuon], ids=["QHM", "QHAdam", "QHMuon"])
@pytest.mark.parametrize(("was", "now"), STATE_DTYPE_CHANGES, ids=str)
@pytest.mark.parametrize(
    ("before", "after"),
    [("as-is", "as-is"), ("deepcopy", "as-is"), ("pickle", "as-is"), ("as-is", "deepcopy")],
    ids=["original", "copied", "pickled", "changed-then-copied"],
)
def test_a_group_s_state_dtype_changed_converts_its_state_as_loading_does(
    make: Callable[..., torch.optim.Optimizer], was: Any, now: Any, before: str, after: str
) -> None:
    # The next step converts the group's state, as load_state_dict converts a
    # checkpoint saved with another state_dtype: the two optimizers then step
    # alike, bit for bit. So does a copy's, or a pickled optimizer's, changed
    # before or after it was copied (the copy knows what its state is stored
    # in, as the original does).
    gen = torch.Generator().manual_seed(5)
    shapes = [(16, 24), (24, 16)]  # matrices: QHMuon's too
    kwargs = {"lr": 0.1} if make is QHM else {}

    def made(state_dtype: Any) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        opt = make([{"params": [params[0]]}, {"params": [params[1]], "state_dtype": state_dtype}],
                   **kwargs)  # fmt: skip
        return opt, params

    changed, params = made(was)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    for g in grads[:2]:
        for p, gi in zip(params, g, strict=True):
            p.grad = gi
        changed.step()
    loaded, loaded_params = made(now)
    with torch.no_grad():
        for a, b in zip(loaded_params, params, strict=True):
            a.copy_(b)
    loaded.load_state_dict(copy.deepcopy(changed.state_dict()))  # as a checkpoint: no aliases
    changed = _copied(changed, before)
    changed.param_groups[1]["state_dtype"] = now
    changed = _copied(changed, after)
    params = [group["params"][0] for group in changed.param_groups]
    for g in grads[2:]:
        for opt, ps in ((changed, params), (loaded, loaded_params)):
            for p, gi in zip(ps, g, strict=True):
                p.grad = gi.clone()
            opt.step()
    for a, b in zip(params, loaded_params, strict=True):
        assert torch.equal(a, b)
    for key, value in loaded.state[loaded_params[1]].items():
        assert torch.equal(changed.state[params[1]][key], value), key


@pytest.mark.parametrize("make", [QHM, QHAdam, QHMuon], ids=["QHM", "QHAdam", "QHMuon"])
@pytest.mark.parametrize(("was", "now"), STATE_DTYPE_CHANGES, ids=str)
def test_a_state_dict_taken_before_a_changed_state_dtype_is_converted_loads_and_resumes(
    make: Callable[..., torch.optim.Optimizer], was: Any, now: Any
) -> None:
    # Between the change and the step that converts the state, decoded_state
    # reads the state as stored, and the state dict names the dtype it is
    # stored in: an optimizer built with the new one converts it on load, and
    # steps on from there as the original does.
    gen = torch.Generator().manual_seed(6)
    shape = (16, 24)
    kwargs = {"lr": 0.1} if make is QHM else {}

    def made(state_dtype: Any) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
        param = torch.nn.Parameter(torch.ones(shape))
        return make([param], state_dtype=state_dtype, **kwargs), param

    changed, param = made(was)
    grads = [torch.randn(shape, generator=gen) for _ in range(4)]
    for g in grads[:2]:
        param.grad = g
        changed.step()
    decoded = changed.decoded_state(param)
    changed.param_groups[0]["state_dtype"] = now
    for key, value in changed.decoded_state(param).items():
        assert torch.equal(value, decoded[key]), key
    saved = copy.deepcopy(changed.state_dict())
    assert saved["param_groups"][0]["state_dtype"] == (None if was is None else str(was))
    loaded, loaded_param = made(now)
    with torch.no_grad():
        loaded_param.copy_(param)
    loaded.load_state_dict(saved)
    for g in grads[2:]:
        for opt, p in ((changed, param), (loaded, loaded_param)):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(param, loaded_param)
    for key, value in loaded.state[loaded_param].items():
        assert torch.equal(changed.state[param][key], value), key


@pytest.mark.parametrize(
    ("was", "now"),
    [
        ({}, {"state_dtype": torch.bfloat16, "stochastic_rounding": True}),
        ({"state_dtype": torch.bfloat16}, {"state_dtype": None, "capturable": True}),
    ],
    ids=["to-bfloat16-rounded", "to-float32-capturable"],
)
def test_a_state_dict_taken_before_a_change_with_its_flags_loads(
    was: dict[str, Any], now: dict[str, Any]
) -> None:
    # The state dict writes the storage the state is in (dtype, rounding and
    # the flags it was checked with), not the stored dtype beside the new
    # flags, a pair no group could be made with or loaded from.
    param = torch.nn.Parameter(torch.ones(8, 4))
    opt = QHAdam([param], **was)
    param.grad = torch.full((8, 4), 0.5)
    opt.step()
    opt.param_groups[0].update(now)
    # A copy's state dict is the original's (the copy knows the storage too).
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        _assert_same(copied.state_dict(), opt.state_dict())
    opt.param_groups[0]["state_dtype"] = np.array([1, 2])  # not a dtype: the state dict written
    assert opt.state_dict()["param_groups"][0]["state_dtype"] == (
        None if was.get("state_dtype") is None else str(was["state_dtype"])
    )
    opt.param_groups[0].update(now)
    saved = copy.deepcopy(opt.state_dict())
    fresh_param = torch.nn.Parameter(param.detach().clone())
    fresh = QHAdam([fresh_param], **now)
    fresh.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))
    for o, p in ((opt, param), (fresh, fresh_param)):
        p.grad = torch.full((8, 4), 0.25)
        o.step()
    assert torch.equal(param, fresh_param)


def test_a_group_is_checked_as_it_will_be_once_loaded() -> None:
    # Loaded, a group keeps this optimizer's state_dtype beside the saved
    # flags: capturable=True saved, loaded into a bfloat16-state optimizer, is
    # a pair no group can be made with -- refused, and nothing changes.
    param = torch.nn.Parameter(torch.ones(4))
    saved_opt = QHAdam([param], capturable=True)
    param.grad = torch.ones(4)
    saved_opt.step()
    opt = QHAdam([torch.nn.Parameter(torch.ones(4))], state_dtype=torch.bfloat16)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="state_dtype is not supported with capturable=True"):
        opt.load_state_dict(saved_opt.state_dict())
    _assert_same(opt.state_dict(), before)


def test_a_post_hook_s_own_layout_is_returned_as_it_is() -> None:
    opt = QHAdam([torch.nn.Parameter(torch.ones(3))], state_dtype=torch.bfloat16)
    opt.register_state_dict_post_hook(lambda optimizer, sd: {"optim": sd})
    assert list(opt.state_dict()) == ["optim"]


def test_state_dict_post_hooks_may_drop_a_group() -> None:
    # As with torch's optimizers: a hook may drop a group (a frozen one, say).
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))]
    opt = QHAdam([{"params": [params[0]]}, {"params": [params[1]], "state_dtype": torch.bfloat16}])

    def drop_the_first_group(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {**state_dict, "param_groups": state_dict["param_groups"][1:]}

    opt.register_state_dict_post_hook(drop_the_first_group)
    groups = opt.state_dict()["param_groups"]
    assert len(groups) == 1 and groups[0]["state_dtype"] == "torch.bfloat16"


@pytest.mark.parametrize(
    ("key", "value", "refused"),
    [("weight_decay_type", "direct", "give one"), ("lr", -0.1, r"lr must be in \[0, inf\)")],
    ids=["disagreeing-decay-spellings", "negative-lr"],
)
def test_a_copy_checks_a_group_changed_before_it_was_made(
    key: str, value: Any, refused: str
) -> None:
    # A copy or a pickle restores the optimizer as it was, a group changed
    # since its last check included: the copy's step checks and refuses it, as
    # the original's does.
    from qhoptim import pyt

    opt = pyt.QHM([torch.nn.Parameter(torch.ones(3))], lr=0.1, weight_decay=0.1)
    opt.param_groups[0][key] = value
    # A pickle of an earlier version, which did not say which groups changed:
    # every group is checked.
    earlier = type(opt).__new__(type(opt))
    earlier.__setstate__(
        {k: v for k, v in copy.deepcopy(opt.__getstate__()).items() if k != "_qhoptim_changed"}
    )
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt)), earlier, opt):
        assert copied.param_groups[0][key] == value
        copied.param_groups[0]["params"][0].grad = torch.ones(3)
        with pytest.raises(ValueError, match=refused):
            copied.step()


@pytest.mark.parametrize("make", [QHAdam, QHMuon], ids=["QHAdam", "QHMuon"])
def test_a_refused_step_leaves_a_changed_state_dtype_unconverted(
    make: Callable[..., torch.optim.Optimizer],
) -> None:
    # A failing step changes nothing: not the state of a group whose
    # state_dtype changed, which the step would have converted.
    params = [torch.nn.Parameter(torch.ones(16, 24)), torch.nn.Parameter(torch.ones(16, 24))]
    opt = make([{"params": [params[0]], "state_dtype": torch.bfloat16}, {"params": [params[1]]}])
    params[0].grad = torch.full((16, 24), 0.5)
    opt.step()
    before = _snapshot(opt)
    opt.param_groups[0]["state_dtype"] = torch.uint8
    if make is QHAdam:
        params[1].grad = torch.ones(16, 24).to_sparse()
        error, refused = RuntimeError, r"does not support sparse gradients"
    else:  # a parameter made 1-D after construction (its .data replaced)
        params[1].data = torch.ones(12)
        params[1].grad = torch.ones(12)
        error, refused = ValueError, r"gradients must be matrices"
    with pytest.raises(error, match=refused):
        opt.step()
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    _assert_same(opt.state_dict(), before)


@pytest.mark.parametrize(
    ("make", "extra"),
    [
        (lambda g: QHAdam(g, lr=0.01), {"momentum": 0.9}),
        (lambda g: QHM(g, lr=0.1), {"eps": 1e-8}),
        (lambda g: QHMuon(g, lr=0.02), {"betas": (0.9, 0.99)}),
    ],
    ids=["QHAdam+momentum", "QHM+eps", "QHMuon+betas"],
)
def test_an_optimizer_s_own_state_dict_with_another_s_key_loads(
    make: Callable[[Any], torch.optim.Optimizer], extra: dict[str, Any]
) -> None:
    # A user's extra group key that happens to be another qhoptim optimizer's
    # is this optimizer's own; what is refused is a group holding such a key
    # where this optimizer's does not.
    params = [torch.nn.Parameter(torch.ones(4, 3))]
    opt = make([{"params": params, **extra}])
    params[0].grad = torch.full((4, 3), 0.5)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    _assert_same(opt.state_dict(), saved)
    with pytest.raises(ValueError, match="another optimizer"):
        make([{"params": [torch.nn.Parameter(torch.ones(4, 3))]}]).load_state_dict(saved)


def test_a_user_s_subclass_with_its_own_group_key_changes_no_other_optimizer_s_loading() -> None:
    # Only qhoptim's own classes mark another optimizer's state dict: a
    # subclass defined elsewhere (a layer-decay variant's "lr_scale") does not
    # make QHAdam refuse its own checkpoints that hold that key.
    class LayerDecayQHAdam(QHAdam):
        _GROUP_KEYS = (*QHAdam._GROUP_KEYS, "lr_scale")

    params = [torch.nn.Parameter(torch.ones(3))]
    opt = QHAdam([{"params": params, "lr_scale": 0.5}], lr=0.01)
    params[0].grad = torch.ones(3)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    QHAdam([{"params": [torch.nn.Parameter(torch.ones(3))]}], lr=0.01).load_state_dict(saved)
    assert LayerDecayQHAdam.__name__  # defined while the load ran


def test_a_state_dict_keeps_a_user_s_dtype_valued_group_key_and_tuple_groups_load() -> None:
    # Only state_dtype and ns_dtype are written as names (and read back); a
    # user's own dtype-valued key stays a dtype, as in torch's optimizers. A
    # state dict whose param_groups is a tuple loads, as torch's do.
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = QHAdam([{"params": params, "my_dtype": torch.float16}], state_dtype=torch.bfloat16)
    params[0].grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"][0]["my_dtype"] is torch.float16
    assert saved["param_groups"][0]["state_dtype"] == "torch.bfloat16"
    opt.load_state_dict({**saved, "param_groups": tuple(saved["param_groups"])})
    assert opt.param_groups[0]["state_dtype"] is torch.bfloat16


def test_a_new_tensor_lr_is_checked_and_a_replaced_params_list_is_not_compared() -> None:
    # A new tensor counts as a change (never compared element-wise with the
    # old one); on the CPU its value is read and checked.
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = QHAdam(params, lr=torch.tensor(0.01))
    params[0].grad = torch.ones(3)
    opt.step()
    opt.param_groups[0]["lr"] = torch.tensor(-0.01)
    with pytest.raises(ValueError, match=r"lr must be in \[0, inf\); received lr=-0.0099"):
        opt.step()
    opt.param_groups[0]["lr"] = torch.tensor(0.02)
    opt.param_groups[0]["params"] = list(params)  # another list, the same tensors
    opt.step()
