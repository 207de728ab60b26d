"""Hypothesis strategies for fuzzing every backend against the float64 reference.

A drawn :class:`FuzzCase` holds valid hyperparameters under their neutral names
-- discounts in ``[0, 1)`` including 0 and 0.99999, ``nu``/``nu1`` also outside
``[0, 1]`` (as conversions produce), ``eps`` including 0 -- a parameter shape,
a starting point and a stream of gradients. The gradients are bounded away from
zero, so ``eps = 0`` never meets the 0/0 of an all-zero coordinate (that case
has its own tests). Backends compare with :func:`conformance.runner.max_relative_deviation`
within :func:`tolerance`.

Under ``CI`` the examples are derandomized (hypothesis's ``"ci"`` profile,
loaded on import): every CI run checks the same examples and a red run can be
reproduced; elsewhere each run draws new ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import assume, settings
from hypothesis import strategies as st

from conformance.runner import TOLERANCES
from qhoptim import reference

__all__ = ["FuzzCase", "fuzz_cases", "reference_run", "tolerance"]

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI", "").lower() in ("1", "true"):
    settings.load_profile("ci")


@dataclass(frozen=True)
class FuzzCase:
    family: str  # "qhm" | "qhadam" | "qhadamw"
    hparams: dict[str, float]  # neutral names: lr, momentum, nu, beta1, beta2, nu1, nu2, eps, wd
    x0: np.ndarray
    grads: np.ndarray  # (steps, *x0.shape)
    resume_at: int  # a step in [1, steps) at which to checkpoint and resume

    @property
    def steps(self) -> int:
        return len(self.grads)


_discount = st.one_of(st.just(0.0), st.just(0.99999), st.floats(0.0, 0.999))


@st.composite
def fuzz_cases(draw: Any, families: tuple[str, ...] = ("qhm", "qhadam", "qhadamw")) -> FuzzCase:
    family = draw(st.sampled_from(families))
    hp: dict[str, float] = {
        "lr": draw(st.floats(1e-4, 0.5)),
        "weight_decay": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.1))),
    }
    if family == "qhm":
        hp["momentum"] = draw(_discount)
        hp["nu"] = draw(st.floats(-1.0, 2.0))
    else:
        hp["beta1"], hp["beta2"] = draw(_discount), draw(_discount)
        hp["nu1"] = draw(st.floats(-1.0, 2.0))
        hp["nu2"] = draw(st.floats(0.0, 1.0))
        hp["eps"] = draw(st.one_of(st.just(0.0), st.floats(1e-10, 1e-3)))
    shape = draw(st.sampled_from([(1,), (3,), (2, 3), (4, 1)]))
    steps = draw(st.integers(2, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sign = lambda size: rng.choice([-1.0, 1.0], size)  # noqa: E731
    x0 = rng.uniform(1.0, 2.0, shape) * sign(shape)
    grads = rng.uniform(0.05, 1.0, (steps, *shape)) * sign((steps, *shape))
    case = FuzzCase(family, hp, x0, grads, draw(st.integers(1, steps - 1)))
    # The deviation is relative to max|x_t|: keep every iterate away from the origin.
    for decoupled in (False, True):
        assume(np.min(np.max(np.abs(reference_run(case, decoupled=decoupled)), axis=1)) >= 0.25)
    return case


def reference_optimizer(case: FuzzCase, *, decoupled: bool) -> Any:
    hp = case.hparams
    if case.family == "qhm":
        return reference.QHM(
            lr=hp["lr"],
            momentum=hp["momentum"],
            nu=hp["nu"],
            weight_decay=hp["weight_decay"],
            decoupled_weight_decay=decoupled,
        )
    return reference.QHAdam(
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        nus=(hp["nu1"], hp["nu2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        decoupled_weight_decay=decoupled,
    )


def reference_run(case: FuzzCase, *, decoupled: bool) -> np.ndarray:
    """The float64 reference trajectory on the case's gradients, shape ``(steps + 1, n)``."""
    opt = reference_optimizer(case, decoupled=decoupled)
    x, state = case.x0, opt.init(case.x0)
    out = [x.ravel()]
    for g in case.grads:
        x, state = opt.step(x, g, state)
        out.append(x.ravel())
    return np.stack(out)


#: The largest ``beta / (1 - beta)`` the conformance cases use (beta = 0.999),
#: which their float64 tolerance covers.
_CONFORMANCE_KAPPA = 1e3


def tolerance(case: FuzzCase, dtype: str = "float64") -> float:
    """The conformance tolerance for ``case``, widened where the bias correction is ill-conditioned.

    ``1 - beta**t`` turns a last-bit difference in ``beta**t`` (a backend's
    ``pow`` is not Python's) into a relative difference of ``beta / (1 - beta)``
    times as many bits: 1e5 at beta = 0.99999, where float64 backends then
    differ from the reference by up to ~1e-12, against ~5e-15 for beta <= 0.999.
    The float64 tolerance grows in proportion beyond the conformance cases'
    beta = 0.999; QHM has no bias correction.
    """
    base = TOLERANCES[dtype]
    if case.family == "qhm" or dtype != "float64":
        return base
    kappa = max(b / (1 - b) for b in (case.hparams["beta1"], case.hparams["beta2"]))
    return base * max(1.0, kappa / _CONFORMANCE_KAPPA)
