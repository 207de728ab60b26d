"""Optimizer state: state_dict round trips, casting, old checkpoints (ours and qhoptim 1.1.0)."""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from qh_torch_testing import (
    assert_trajectories_close,
    install_qhoptim_110,
    random_grads,
    reference_trajectory,
    run_torch,
)

from qhoptim import pyt, reference, rules
from qhoptim.torch import QHM, QHAdam, QHAdamW

F64 = torch.float64
FLAGS = ("maximize", "foreach", "capturable", "differentiable")

CONFIGS: list[tuple[type, dict[str, Any]]] = [
    (QHM, {"lr": 0.5, "weight_decay": 0.1}),
    (QHM, {"lr": 0.5, "nu": 1.2, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (QHAdam, {"lr": 0.01, "nus": (0.7, 0.8), "weight_decay": 0.1}),
    (QHAdamW, {"lr": 0.01, "nus": (0.7, 1.0), "betas": (0.995, 0.999)}),
    (QHAdam, {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.7, 0.8), "amsgrad": True}),
    (QHAdamW, {"lr": 0.01, "betas": (0.9, 0.9), "amsgrad": True}),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(CONFIGS)]
SHAPES = [(3, 2), (4,), (0,)]


def _params(dtype: torch.dtype = F64, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]


def _roundtrip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("foreach", [False, True])
def test_resuming_from_a_checkpoint_is_bit_identical(
    cls: type, kwargs: dict[str, Any], foreach: bool
) -> None:
    grads = random_grads(SHAPES, 8)
    params = _params()
    uninterrupted = run_torch(cls(params, **kwargs, foreach=foreach), params, grads)

    params = _params()
    opt = cls(params, **kwargs, foreach=foreach)
    run_torch(opt, params, grads[:4])
    saved = _roundtrip(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(resumed_params, **kwargs, foreach=foreach)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    continued = run_torch(resumed, resumed_params, grads[4:])
    assert_trajectories_close(continued, uninterrupted[4:], rtol=0.0)


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_state_dict_is_deterministic_and_loadable_twice(cls: type, kwargs: dict[str, Any]) -> None:
    params = _params()
    opt = cls(params, **kwargs)
    run_torch(opt, params, random_grads(SHAPES, 3))
    first = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(first)
    second = opt.state_dict()
    assert first["param_groups"] == second["param_groups"]
    for i, state in first["state"].items():
        assert state.keys() == second["state"][i].keys()
        for key, value in state.items():
            assert torch.equal(value, second["state"][i][key])


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_deepcopy_continues_independently(cls: type, kwargs: dict[str, Any]) -> None:
    params = _params()
    opt = cls(params, **kwargs)
    grads = random_grads(SHAPES, 6)
    run_torch(opt, params, grads[:3])
    twin = copy.deepcopy(opt)
    twin_params = twin.param_groups[0]["params"]
    assert all(a is not b for a, b in zip(twin_params, params, strict=True))
    got = run_torch(twin, twin_params, grads[3:])
    want = run_torch(opt, params, grads[3:])
    assert_trajectories_close(got, want, rtol=0.0)


def test_state_is_cast_to_the_parameters_as_adam_does() -> None:
    for cls in (QHM, QHAdam):
        source = _params(F64)
        opt = cls(source, lr=0.1)
        run_torch(opt, source, random_grads(SHAPES, 2))
        target = _params(torch.float32)
        loaded = cls(target, lr=0.1)
        loaded.load_state_dict(opt.state_dict())
        for p in target:
            state = loaded.state[p]
            for key, value in state.items():
                if key == "step":  # a CPU float32 count, never cast (as torch's Adam)
                    assert value.dtype == torch.float32 and value.device.type == "cpu"
                else:
                    assert value.dtype == torch.float32, key
        run_torch(loaded, target, random_grads(SHAPES, 1, dtype=torch.float32))


@pytest.mark.parametrize("foreach", [False, True])
def test_complex_state_keeps_a_real_second_moment_when_loaded(foreach: bool) -> None:
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex128))
    opt = QHAdam([p], lr=0.1, nus=(0.7, 0.9))
    p.grad = torch.randn(3, dtype=torch.complex128)
    opt.step()
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    loaded = QHAdam([q], lr=0.1, foreach=foreach)
    loaded.load_state_dict(_roundtrip(opt.state_dict()))
    # torch casts no state of complex params; here it follows the param's precision.
    assert loaded.state[q]["exp_avg"].dtype == torch.complex64
    assert loaded.state[q]["exp_avg_sq"].dtype == torch.float32
    q.grad = torch.randn(3, dtype=torch.complex64)
    loaded.step()


@pytest.mark.parametrize(("cls", "kwargs"), CONFIGS, ids=IDS)
def test_older_state_dicts_without_flags_are_back_filled(cls: type, kwargs: dict[str, Any]) -> None:
    params = _params()
    opt = cls(params, **kwargs)
    grads = random_grads(SHAPES, 4)
    run_torch(opt, params, grads[:2])
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        for flag in FLAGS:
            del group[flag]
    for state in old["state"].values():  # older checkpoints stored the step as a number
        if "step" in state:
            state["step"] = float(state["step"])
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = cls(twin_params, **kwargs)
    twin.load_state_dict(old)
    for group in twin.param_groups:
        assert {f: group[f] for f in FLAGS} == {
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
        }
    for state in twin.state.values():
        if "step" in state:
            assert torch.is_tensor(state["step"]) and state["step"].dtype == torch.float32
    assert_trajectories_close(
        run_torch(twin, twin_params, grads[2:]), run_torch(opt, params, grads[2:]), rtol=0.0
    )


# ------------------------------------------------------------------- amsgrad
def _adam_pair(amsgrad: bool, seed: int = 0) -> tuple[Any, Any, list[Any], list[Any]]:
    """QHAdam with nus (1, 1) and torch's Adam, same hyperparameters and start."""
    params, twins = _params(seed=seed), _params(seed=seed)
    kwargs = {"lr": 0.01, "betas": (0.9, 0.9), "amsgrad": amsgrad}
    return QHAdam(params, **kwargs), torch.optim.Adam(twins, **kwargs), params, twins


@pytest.mark.parametrize(("saved", "loaded"), [(False, True), (True, False)])
def test_amsgrad_is_loaded_from_the_state_dict_as_torch_adam_does(
    saved: bool, loaded: bool
) -> None:
    # torch.optim.Adam's load_state_dict takes the saved param groups' amsgrad
    # (every hyperparameter comes from the state dict): QHAdam does the same.
    grads = random_grads(SHAPES, 6)
    ours, adam, params, twins = _adam_pair(saved)
    run_torch(ours, params, grads[:3])
    run_torch(adam, twins, grads[:3])
    ours_loaded, adam_loaded, params_l, twins_l = _adam_pair(loaded, seed=1)
    ours_loaded.load_state_dict(_roundtrip(ours.state_dict()))
    adam_loaded.load_state_dict(_roundtrip(adam.state_dict()))
    assert ours_loaded.param_groups[0]["amsgrad"] is adam_loaded.param_groups[0]["amsgrad"] is saved
    assert set(ours_loaded.state[params_l[0]]) == set(adam_loaded.state[twins_l[0]])
    with torch.no_grad():
        for p, q, r in zip(params_l, twins_l, params, strict=True):
            p.copy_(r)
            q.copy_(r)
    assert_trajectories_close(
        run_torch(ours_loaded, params_l, grads[3:]), run_torch(adam_loaded, twins_l, grads[3:])
    )


def test_amsgrad_switched_on_after_loading_starts_its_maximum() -> None:
    # A state dict saved without amsgrad, with amsgrad switched on after loading
    # (torch's Adam raises KeyError here): the running maximum starts at zero,
    # so it is the reference's amsgrad step from the loaded moments.
    kwargs = {"lr": 0.01, "betas": (0.9, 0.9), "nus": (0.7, 0.8)}
    grads = random_grads(SHAPES, 6)
    params = _params()
    opt = QHAdam(params, **kwargs)
    run_torch(opt, params, grads[:3])
    saved = _roundtrip(opt.state_dict())
    resumed = QHAdam(params, **kwargs, amsgrad=True)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["amsgrad"] is False
    resumed.param_groups[0]["amsgrad"] = True
    ref = reference.QHAdam(**kwargs, amsgrad=True)
    want = []
    for p in params:
        state = resumed.state[p]
        want.append(
            (
                p.detach().numpy().copy(),
                reference.QHAdamState(
                    int(state["step"]),
                    state["exp_avg"].numpy().copy(),
                    state["exp_avg_sq"].numpy().copy(),
                    np.zeros(p.shape),
                ),
            )
        )
    got = run_torch(resumed, params, grads[3:])
    for t, step_grads in enumerate(grads[3:]):
        for i, g in enumerate(step_grads):
            want[i] = ref.step(want[i][0], g.numpy(), want[i][1])
        assert_trajectories_close([got[t]], [[w[0] for w in want]])
    assert all("max_exp_avg_sq" in resumed.state[p] for p in params)


def test_amsgrad_state_of_a_complex_param_stays_real_when_loaded() -> None:
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.complex128))
    opt = QHAdam([p], lr=0.1, nus=(0.7, 0.9), amsgrad=True)
    p.grad = torch.randn(3, dtype=torch.complex128)
    opt.step()
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    loaded = QHAdam([q], lr=0.1, amsgrad=True)
    loaded.load_state_dict(_roundtrip(opt.state_dict()))
    assert loaded.state[q]["max_exp_avg_sq"].dtype == torch.float32
    q.grad = torch.randn(3, dtype=torch.complex64)
    loaded.step()


def test_a_wrong_running_maximum_is_refused() -> None:
    params = _params()
    opt = QHAdam(params, amsgrad=True)
    run_torch(opt, params, random_grads(SHAPES, 1))
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0]["max_exp_avg_sq"] = torch.zeros(7)
    with pytest.raises(ValueError, match="max_exp_avg_sq of parameter 0 has shape"):
        QHAdam(_params(), amsgrad=True).load_state_dict(bad)
    bad["state"][0]["max_exp_avg_sq"] = torch.zeros(3, 2, dtype=torch.complex128)
    with pytest.raises(ValueError, match="max_exp_avg_sq of parameter 0 has dtype"):
        QHAdam(_params(), amsgrad=True).load_state_dict(bad)
    bad["param_groups"][0]["amsgrad"] = "yes"
    with pytest.raises(TypeError, match="amsgrad must be a bool; received amsgrad='yes'"):
        QHAdam(_params(), amsgrad=True).load_state_dict(bad)


# ------------------------------------------------------------- qhoptim 1.1.0
@pytest.fixture(scope="module")
def qhoptim_110(tmp_path_factory: pytest.TempPathFactory) -> Any:
    try:
        return install_qhoptim_110(Path(tmp_path_factory.mktemp("qhoptim-1.1.0")))
    except (RuntimeError, OSError) as e:
        pytest.skip(f"qhoptim 1.1.0 cannot be installed here: {e}")


def _run_110(opt: Any, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> Any:
    with warnings.catch_warnings():
        # 1.1.0 calls the deprecated add_(Number, Tensor) overloads.
        warnings.filterwarnings("ignore", message="This overload of", category=UserWarning)
        return run_torch(opt, params, grads)


DIRECT = {"weight_decay": 0.1, "weight_decay_type": "direct"}  # 1.1.0's spelling
# qhoptim 1.1.0's classes against qhoptim.pyt's (1.1.0's signatures) and,
# through the checkpoint, qhoptim.torch's.
CHECKPOINTS_110 = [
    ("QHM", pyt.QHM, {"lr": 0.5, "momentum": 0.9, "nu": 0.7}),
    ("QHM", pyt.QHM, {"lr": 0.5, "momentum": 0.99, "nu": 1.1, "weight_decay": 0.1}),
    ("QHM", pyt.QHM, {"lr": 0.5, "momentum": 0.9, "nu": 0.7, **DIRECT}),
    ("QHM", QHM, {"lr": 0.5, "momentum": 0.9, "nu": 0.7}),
    ("QHAdam", pyt.QHAdam, {"lr": 0.01}),
    ("QHAdam", pyt.QHAdam, {"lr": 0.01, "nus": (0.7, 0.8), "weight_decay": 0.1}),
    ("QHAdam", QHAdam, {"lr": 0.01, "betas": (0.0, 0.99), "nus": (0.5, 0.9), "weight_decay": 0.1}),
    ("QHAdam", pyt.QHAdam, {"lr": 0.01, "betas": (0.0, 0.0), "nus": (0.5, 0.9)}),
    ("QHAdam", pyt.QHAdam, {"lr": 0.01, "nus": (0.5, 0.9), "decouple_weight_decay": True}),
    ("QHAdamW", pyt.QHAdamW, {"lr": 0.01, "nus": (0.7, 1.0), "weight_decay": 0.1}),
    ("QHAdamW", QHAdamW, {"lr": 0.01, "nus": (0.7, 1.0), "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("name", "cls", "kwargs"), CHECKPOINTS_110)
def test_a_qhoptim_1_1_0_checkpoint_continues_the_same_trajectory(
    qhoptim_110: Any, name: str, cls: type, kwargs: dict[str, Any]
) -> None:
    grads = random_grads(SHAPES, 10)
    params0 = _params()
    old_params = _params()
    old = getattr(qhoptim_110, name)(old_params, **kwargs)
    _run_110(old, old_params, grads[:6])
    checkpoint = _roundtrip(old.state_dict())

    params = [torch.nn.Parameter(p.detach().clone()) for p in old_params]
    new = cls(params, lr=1.0)  # the hyperparameters come from the checkpoint
    new.load_state_dict(checkpoint)
    if not issubclass(cls, QHM):
        steps = {float(s["step"]) for s in new.state.values()}
        # 1.1.0 keeps no count; it is recovered from sum(beta**i), or 1 when both betas
        # are 0 (then the bias corrections are 1 at every step anyway).
        assert steps == ({1.0} if max(kwargs.get("betas", (0.9,))) == 0 else {6.0})
        assert all("beta1_weight" not in s for s in new.state.values())
    continued = run_torch(new, params, grads[6:])

    # ... equals this package run from the start, and 1.1.0 continuing.
    fresh = _params()
    from_start = run_torch(cls(fresh, **kwargs), fresh, grads)
    assert_trajectories_close(continued, from_start[6:], rtol=1e-12)
    assert_trajectories_close(continued, _run_110(old, old_params, grads[6:]), rtol=1e-12)
    want = reference_trajectory(cls, kwargs, params0, grads)
    assert_trajectories_close(continued, want[6:], rtol=1e-12)


@pytest.mark.parametrize("steps", [1, 7, 5000, 200_000])
def test_a_hand_made_qhoptim_1_1_0_checkpoint_is_converted(steps: int) -> None:
    # 1.1.0's QHAdam state (qhoptim/pyt/qhadam.py) without installing it: Python
    # floats beta_weight_t = 1 + beta * beta_weight_{t-1} and bias-corrected moments.
    betas = (0.9, 0.999)
    w1 = w2 = 0.0
    for _ in range(steps):
        w1, w2 = 1.0 + betas[0] * w1, 1.0 + betas[1] * w2
    exp_avg_hat = torch.tensor([0.5, -1.0], dtype=F64)
    exp_avg_sq_hat = torch.tensor([0.25, 2.0], dtype=F64)
    group = {"lr": 0.01, "betas": betas, "nus": (0.7, 1.0), "weight_decay": 0.0}
    checkpoint = {
        "state": {
            0: {
                "beta1_weight": w1,
                "beta2_weight": w2,
                "exp_avg": exp_avg_hat.clone(),
                "exp_avg_sq": exp_avg_sq_hat.clone(),
            }
        },
        "param_groups": [{**group, "decouple_weight_decay": False, "eps": 1e-8, "params": [0]}],
    }
    p = torch.nn.Parameter(torch.zeros(2, dtype=F64))
    opt = QHAdam([p])
    opt.load_state_dict(_roundtrip(checkpoint))
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    step = float(state["step"])
    if steps <= 5000:
        assert step == steps
    else:  # beyond float64 resolution of beta2**t: any large t, bias corrections are 1
        assert step > 30_000
    for key, beta, hat in (("exp_avg", 0.9, exp_avg_hat), ("exp_avg_sq", 0.999, exp_avg_sq_hat)):
        torch.testing.assert_close(
            state[key] / rules.bias_correction(beta, step), hat, rtol=1e-12, atol=0
        )
