"""qhoptim.torch in timm's optimizer factory (``register_with_timm``)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

timm_optim = pytest.importorskip("timm.optim")

import qhoptim.torch as qht  # noqa: E402
from qhoptim import reference  # noqa: E402

NAMES = ["qhm", "qhadam", "qhadamw"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


@pytest.fixture(scope="module", autouse=True)
def registered() -> list[str]:
    return qht.register_with_timm()


def test_the_names_are_in_timms_registry(registered: list[str]) -> None:
    assert registered == NAMES
    assert set(NAMES) <= set(timm_optim.list_optimizers())
    assert timm_optim.get_optimizer_class("qhadamw") is qht.QHAdamW


def _first_step(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, np.ndarray]:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    before = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
    grads = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}
    opt.step()
    return before, grads


def test_qhadamw_by_name_takes_timms_no_decay_groups_and_qh_steps() -> None:
    model = Net()
    opt = timm_optim.create_optimizer_v2(
        model, opt="qhadamw", lr=1e-2, weight_decay=0.05, nus=(0.7, 1.0), betas=(0.95, 0.999)
    )
    assert type(opt) is qht.QHAdamW
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    # timm's split: biases and normalization weights (1-d) take no weight decay.
    assert {n for n, p in names.items() if decay_of[id(p)] == 0} == {
        "fc.bias", "norm.weight", "norm.bias",
    }  # fmt: skip
    assert {decay_of[id(names[n])] for n in ("fc.weight", "head.weight")} == {0.05}
    before, grads = _first_step(opt, model)
    for n, p in names.items():
        ref = reference.QHAdamW(
            lr=1e-2, betas=(0.95, 0.999), nus=(0.7, 1.0), weight_decay=decay_of[id(p)]
        )
        want, _ = ref.step(before[n], grads[n], ref.init(before[n]))
        np.testing.assert_allclose(p.detach().double().numpy(), want, rtol=1e-5, atol=1e-7)


def test_qhm_takes_timms_momentum_and_qhadam_its_eps_and_betas() -> None:
    qhm = timm_optim.create_optimizer_v2(Net(), opt="qhm", lr=0.5)
    assert type(qhm) is qht.QHM
    # timm's momentum default (0.9, as for SGD); QHM's nu default.
    assert {(g["momentum"], g["nu"]) for g in qhm.param_groups} == {(0.9, 0.7)}
    qhm = timm_optim.create_optimizer_v2(Net(), opt="qhm", lr=0.5, momentum=0.999, eps=1e-3)
    assert {g["momentum"] for g in qhm.param_groups} == {0.999}  # eps dropped: QHM has none
    qhadam = timm_optim.create_optimizer_v2(
        Net(), opt="qhadam", lr=1e-3, eps=1e-6, betas=(0.9, 0.99), weight_decay=1e-4
    )
    assert type(qhadam) is qht.QHAdam
    assert {(g["eps"], g["betas"]) for g in qhadam.param_groups} == {(1e-6, (0.9, 0.99))}


def test_lookahead_wraps_a_qh_optimizer() -> None:
    opt = timm_optim.create_optimizer_v2(Net(), opt="lookahead_qhadam", lr=1e-3)
    assert type(opt).__name__ == "Lookahead"
    # Lookahead shares its base optimizer's groups, QHAdam's hyperparameters in them.
    assert all("nus" in g for g in opt.param_groups)
    model = Net()
    opt = timm_optim.create_optimizer_v2(model, opt="lookahead_qhadam", lr=1e-3)
    for _ in range(7):  # past Lookahead's k = 6 fast steps
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    state = opt.state_dict()  # the base optimizer's, Lookahead's slow weights in it
    assert [float(s["step"]) for s in state["state"].values()] == [7.0] * 5
    assert all("lookahead_slow_buff" in s for s in state["state"].values())
    # A timm checkpoint resumes: the slow weights load with QHAdam's state.
    resumed = timm_optim.create_optimizer_v2(model, opt="lookahead_qhadam", lr=1e-3)
    resumed.load_state_dict(state)
    assert [float(s["step"]) for s in resumed.state_dict()["state"].values()] == [7.0] * 5


def test_a_registry_of_ones_own() -> None:
    registry = timm_optim.OptimizerRegistry()
    assert qht.register_with_timm(registry) == NAMES
    assert registry.get_optimizer_info("qhm").opt_class is qht.QHM


def test_importing_qhoptim_torch_does_not_import_timm() -> None:
    code = "import sys, qhoptim.torch; print('timm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
