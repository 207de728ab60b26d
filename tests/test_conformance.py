"""The conformance harness itself: cases, problems, runner, numpy adapter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conformance import runner
from conformance.adapters import load_adapter
from conformance.adapters.numpy_rules import NumpyAdapter
from conformance.cases import load_cases, lr_factors
from conformance.problems import PROBLEMS, get_problem

CASES = load_cases()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_numpy_adapter_follows_the_reference(case, dtype) -> None:
    row = runner.check(NumpyAdapter(), case, dtype)
    assert row.passed, row


def test_cases_cover_the_required_regimes() -> None:
    hp = [(c.optimizer, c.hparams) for c in CASES]
    qhm = [h for o, h in hp if o == "qhm"]
    qhadam = [h for o, h in hp if o in ("qhadam", "qhadamw")]
    assert any(h["nu"] == 0 for h in qhm)  # SGD
    assert any(h["nu"] == 1 for h in qhm)  # momentum
    assert any(h["nu"] == h["momentum"] for h in qhm)  # NAG
    assert any(not 0 <= h["nu"] <= 1 for h in qhm)
    assert any(h["momentum"] == 0 for h in qhm)
    assert any(h["nus"][1] < 1 for h in qhadam)
    assert any(not 0 <= h["nus"][0] <= 1 for h in qhadam)
    assert {c.weight_decay_mode for c in CASES} == {"none", "coupled", "decoupled", "native"}
    assert {c.schedule.get("kind", "constant") for c in CASES} >= {"constant", "step", "warmup"}
    assert {c.problem_name for c in CASES} == {
        "quadratic",
        "rosenbrock",
        "logistic",
        "spiky",
        "matrices",
    }
    assert {c.optimizer for c in CASES} == {"qhm", "qhadam", "qhadamw", "qhmuon"}
    assert {c.optimizer for c in CASES if c.amsgrad} == {"qhadam", "qhadamw"}
    assert any(c.amsgrad and c.hparams["nus"][1] < 1 for c in CASES)
    assert all(c.steps >= 100 for c in CASES)


def test_qhmuon_cases_cover_muon_and_beyond() -> None:
    qhmuon = [c.hparams for c in CASES if c.optimizer == "qhmuon"]
    assert any(h["nu"] == h["momentum"] for h in qhmuon)  # Muon, Nesterov
    assert any(h["nu"] == 1 for h in qhmuon)  # Muon without
    assert any(h["nu"] == 0 for h in qhmuon)
    assert any(h["nu"] > 1 for h in qhmuon)
    assert any((h["nu"], h["momentum"]) == (0.7, 0.999) for h in qhmuon)  # the paper's
    assert any(h.get("weight_decay") for h in qhmuon)
    assert any(h.get("adjust_lr_fn") == "match_rms_adamw" for h in qhmuon)
    assert any(h.get("ns_steps", 5) != 5 for h in qhmuon)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.optimizer == "qhmuon"], ids=lambda c: c.name
)
def test_qhmuon_cases_keep_the_closed_loop_comparable(case) -> None:
    # float64 runs are compared closed loop, which means something only where
    # the loop does not amplify rounding: a start nudged by 1e-10 (relative)
    # must end within 1e-8. Muon's loop turns chaotic once a singular value of
    # its gradient nears zero (see the matrices problem): at twice the
    # learning rate the nu = 0 case already loses all digits.
    def spread(case) -> float:
        x0 = case.problem.x0
        nudged = x0 * (1 + 1e-10 * np.random.default_rng(0).standard_normal(x0.shape))
        return runner.max_relative_deviation(
            runner.reference_trajectory(case, start=nudged), runner.reference_trajectory(case)
        )

    assert spread(case) < 1e-8
    if case.name == "qhmuon-nu-zero-matrices":
        fast = dataclasses.replace(case, hparams=dict(case.hparams, lr=2 * case.hparams["lr"]))
        assert spread(fast) > 1e-4


# Each framework's Muon differs from the reference's default (torch's) form by
# design; the adapters tell the reference which. Each option must move the
# trajectory past the float64 tolerance, or a backend could pass with the wrong
# one. (Keras's unnormalized trace is the same direction scaled by 1/(1 - beta),
# which the orthogonalization removes: no option to test.)
@pytest.mark.parametrize(
    "options",
    [
        {"norm_guard": "add", "eps": 1e-8},
        {"bias_corrected": True},
        {"fan_in_first": True},
        {"decoupled_weight_decay": False},
        {"adjust_lr_fn": "match_rms_adamw", "rms": 0.25},
    ],
    ids=lambda o: "-".join(o),
)
def test_every_qhmuon_reference_option_changes_some_trajectory(options) -> None:
    deviations = [
        runner.max_relative_deviation(
            runner.reference_trajectory(case, options=options), runner.reference_trajectory(case)
        )
        for case in CASES
        if case.optimizer == "qhmuon"
    ]
    assert max(deviations) > 1e3 * runner.TOLERANCES["float64"]


def test_the_reference_options_reach_the_reference() -> None:
    case = next(c for c in CASES if c.name == "qhmuon-nu-above-one-decay-cosine")
    options = {"norm_guard": "add", "decoupled_weight_decay": False}
    opt = case.reference_optimizer(**options)
    assert (opt.norm_guard, opt.decoupled_weight_decay, opt.nu) == ("add", False, 1.3)


@pytest.mark.parametrize("case", [c for c in CASES if c.amsgrad], ids=lambda c: c.name)
def test_amsgrad_cases_exercise_the_running_maximum(case) -> None:
    # Without amsgrad the trajectory must differ by far more than either
    # tolerance, or a backend that ignored the flag would pass.
    hp = dict(case.hparams, amsgrad=False)
    plain = runner.reference_trajectory(dataclasses.replace(case, hparams=hp))
    assert runner.max_relative_deviation(plain, runner.reference_trajectory(case)) > 1e-3
    assert not dataclasses.replace(case, hparams=hp).amsgrad


@pytest.mark.parametrize(
    ("problem", "hparams", "message"),
    [
        ("matrices", "lr = 0.01, momentum = 0.9, nu = 0.7, eps = 1e-8", "received eps"),
        ("quadratic", "lr = 0.01, momentum = 0.9, nu = 0.7", "QHMuon steps matrices"),
    ],
)
def test_qhmuon_cases_are_checked(tmp_path, problem, hparams, message) -> None:
    bad = tmp_path / "cases.toml"
    bad.write_text(
        f'[[case]]\nname = "x"\nproblem = "{problem}"\noptimizer = "qhmuon"\n'
        f"hparams = {{ {hparams} }}\n"
    )
    with pytest.raises(ValueError, match=message):
        load_cases(bad)


def test_qhm_cases_cannot_ask_for_amsgrad(tmp_path) -> None:
    bad = tmp_path / "cases.toml"
    bad.write_text(
        '[[case]]\nname = "x"\nproblem = "quadratic"\noptimizer = "qhm"\n'
        "hparams = { lr = 0.1, momentum = 0.9, nu = 0.7, amsgrad = true }\n"
    )
    with pytest.raises(ValueError, match="amsgrad is a QHAdam variant"):
        load_cases(bad)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_trajectories_are_finite_and_make_progress(case) -> None:
    traj = runner.reference_trajectory(case)
    assert np.all(np.isfinite(traj))
    problem = case.problem
    assert problem.loss(traj[-1]) < problem.loss(traj[0])


def test_spiky_problem_has_rare_huge_spikes() -> None:
    p = get_problem("spiky")
    x = p.x0
    # At a fixed point only the noise varies with t.
    grads = np.stack([p.grad(x, t) for t in range(2000)])
    dev = np.abs(grads - np.median(grads, axis=0))
    typical = np.median(dev)
    frac_huge = np.mean(dev > 100 * typical)
    assert 0.002 < frac_huge < 0.05


# logistic and spiky have stochastic gradients (minibatches, noise): not d(loss)/dx.
@pytest.mark.parametrize(
    "name",
    [
        "quadratic",
        "rosenbrock",
        "matrices",
        "quadratic-kappa100",
        "rosenbrock-2d",
        "logistic-full-batch",
    ],
)
def test_problem_gradients_match_finite_differences(name) -> None:
    p = get_problem(name)
    x, h = p.x0, 1e-6
    g = p.grad(x, 0)
    fd = np.array([(p.loss(x + h * e) - p.loss(x - h * e)) / (2 * h) for e in np.eye(x.size)])
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-4)


def test_problem_split_join_round_trip() -> None:
    for name in PROBLEMS:
        p = get_problem(name)
        parts = p.split(p.x0)
        assert [q.shape for q in parts] == list(p.shapes)
        np.testing.assert_array_equal(p.join(parts), p.x0)


def test_schedules() -> None:
    assert lr_factors({"kind": "constant"}, 3) == [1.0] * 3
    assert lr_factors({"kind": "step", "milestones": [1, 2], "gamma": 0.5}, 4) == [
        1.0,
        0.5,
        0.25,
        0.25,
    ]
    assert lr_factors({"kind": "warmup", "warmup_steps": 2}, 3) == [0.5, 1.0, 1.0]
    cos = lr_factors({"kind": "cosine", "min_factor": 0.1}, 5)
    assert cos[0] == 1.0 and cos[-1] == pytest.approx(0.1) and cos == sorted(cos, reverse=True)
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_factors({"kind": "nope"}, 2)


# --- the harness must be able to fail -------------------------------------------------


class _PerturbedAdapter(NumpyAdapter):
    """The numpy adapter with one hyperparameter nudged by ``delta``."""

    def __init__(self, key: str, delta: float | None) -> None:
        self.key, self.delta = key, delta

    def run(self, case, dtype):
        hp = dict(case.hparams)
        if self.delta is None:  # a switch: flip it
            hp[self.key] = not hp[self.key]
        elif isinstance(hp[self.key], list):
            hp[self.key] = [hp[self.key][0] + self.delta, *hp[self.key][1:]]
        else:
            hp[self.key] = hp[self.key] + self.delta
        return super().run(dataclasses.replace(case, hparams=hp), dtype)


@pytest.mark.parametrize(
    ("case_name", "key", "delta"),
    [
        ("qhm-rule-of-thumb-quadratic", "nu", 1e-6),
        ("qhm-momentum-logistic", "momentum", 1e-6),
        ("qhadam-slow-beta1-quadratic", "nus", 1e-6),
        ("qhadam-nu2-spiky", "betas", 1e-6),
        ("qhadam-amsgrad-spiky", "amsgrad", None),
        ("qhmuon-rule-of-thumb-matrices", "nu", 1e-6),
        ("qhmuon-muon-nesterov-matrices", "momentum", 1e-6),
    ],
)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_runner_detects_a_slightly_wrong_optimizer(case_name, key, delta, dtype) -> None:
    case = next(c for c in CASES if c.name == case_name)
    delta = delta if dtype == "float64" or delta is None else 1e-3
    row = runner.check(_PerturbedAdapter(key, delta), case, dtype)
    assert not row.passed, row


def test_max_relative_deviation() -> None:
    ref = np.array([[1.0, 2.0], [2.0, 4.0]])
    assert runner.max_relative_deviation(ref, ref) == 0.0
    bumped = ref + np.array([[0.0, 0.0], [0.0, 0.4]])
    assert runner.max_relative_deviation(bumped, ref) == pytest.approx(0.1)
    assert runner.max_relative_deviation(ref * np.nan, ref) == np.inf
    with pytest.raises(ValueError, match="shape"):
        runner.max_relative_deviation(ref[:1], ref)


def test_cli_prints_table_and_fails_on_unknown_or_missing_backend(capsys, tmp_path) -> None:
    out = tmp_path / "t.md"
    assert runner.main(["--backends", "numpy", "-k", "rosenbrock", "--markdown", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| case | backend | dtype |" in text and "0 failed" in text
    assert out.read_text().startswith("| case |")
    with pytest.raises(KeyError, match="unknown backend"):
        runner.main(["--backends", "nope"])
    assert runner.main(["--backends", "numpy", "-k", "no-such-case"]) == 1


def test_unavailable_backend_is_an_error_when_requested(monkeypatch) -> None:
    import conformance.adapters as adapters

    monkeypatch.setitem(adapters.REGISTRY, "ghost", "no_such_framework_module:Adapter")
    assert not load_adapter("ghost").available()
    with pytest.raises(RuntimeError, match="not available"):
        runner.run(["ghost"])
