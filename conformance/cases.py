"""Load the conformance cases (``cases.toml``) and build their lr sequences."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from qhoptim import reference

from .problems import Problem, get_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DEFAULT_STEPS", "OPTIMIZERS", "QHMUON_HPARAMS", "Case", "load_cases", "lr_factors"]

DEFAULT_STEPS = 150
CASES_FILE = Path(__file__).with_name("cases.toml")

# Optimizer name in the cases -> reference class.
OPTIMIZERS: dict[str, type[Any]] = {
    "qhm": reference.QHM,
    "qhadam": reference.QHAdam,
    "qhadamw": reference.QHAdamW,
    "qhmuon": reference.QHMuon,
}
# QHMuon's hyperparameters in the cases: the ones every backend's QHMuon takes.
# The rest of a Muon is its framework's (norm guard and epsilon, momentum form,
# kind of weight decay, the shape's learning-rate ratio unless a case names
# ``adjust_lr_fn``): each adapter tells the reference (``reference_options``).
QHMUON_HPARAMS = frozenset({"lr", "momentum", "nu", "weight_decay", "ns_steps", "adjust_lr_fn"})


def lr_factors(schedule: dict[str, Any], steps: int) -> list[float]:
    """Multipliers of the base lr for steps ``0 .. steps-1``."""
    kind = schedule.get("kind", "constant")
    if kind == "constant":
        return [1.0] * steps
    if kind == "step":
        gamma, milestones = schedule["gamma"], schedule["milestones"]
        return [gamma ** sum(t >= m for m in milestones) for t in range(steps)]
    if kind == "warmup":
        w = schedule["warmup_steps"]
        return [min(1.0, (t + 1) / w) for t in range(steps)]
    if kind == "cosine":
        lo = schedule.get("min_factor", 0.0)
        last = max(steps - 1, 1)
        return [lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t / last)) for t in range(steps)]
    raise ValueError(f"unknown schedule kind {kind!r}")


@dataclass(frozen=True)
class Case:
    """One conformance case. ``lrs[t]`` is the learning rate of step ``t``."""

    name: str
    problem_name: str
    optimizer: str
    hparams: dict[str, Any] = field(hash=False)
    schedule: dict[str, Any] = field(hash=False)
    steps: int = DEFAULT_STEPS

    @property
    def problem(self) -> Problem:
        return get_problem(self.problem_name)

    @property
    def lrs(self) -> list[float]:
        base = self.hparams["lr"]
        return [base * f for f in lr_factors(self.schedule, self.steps)]

    def reference_optimizer(self, **options: Any) -> Any:
        """The float64 reference optimizer configured with this case's hparams
        and a backend's ``options`` (QHMuon's framework form, see :data:`QHMUON_HPARAMS`)."""
        hp = dict(self.hparams, **options)
        for key in ("betas", "nus"):
            if key in hp:
                hp[key] = tuple(hp[key])
        if self.optimizer == "qhmuon":
            hp.setdefault("weight_decay", 0.0)
        return OPTIMIZERS[self.optimizer](**hp)

    @property
    def amsgrad(self) -> bool:
        """Whether the case runs QHAdam's AMSGrad variant (``amsgrad = true``)."""
        return bool(self.hparams.get("amsgrad", False))

    @property
    def weight_decay_mode(self) -> str:
        """``"none"``, ``"coupled"`` or ``"decoupled"`` (what backends must configure);
        QHMuon's weight decay is its framework's kind: ``"native"``."""
        if not self.hparams.get("weight_decay"):
            return "none"
        if self.optimizer == "qhmuon":
            return "native"
        decoupled = self.optimizer == "qhadamw" or self.hparams.get("decoupled_weight_decay")
        return "decoupled" if decoupled else "coupled"


@cache
def load_cases(path: Path = CASES_FILE) -> tuple[Case, ...]:
    with open(path, "rb") as f:
        raw = tomllib.load(f)["case"]
    cases = tuple(
        Case(
            name=c["name"],
            problem_name=c["problem"],
            optimizer=c["optimizer"],
            hparams=dict(c["hparams"]),
            schedule=dict(c.get("schedule", {"kind": "constant"})),
            steps=int(c.get("steps", DEFAULT_STEPS)),
        )
        for c in raw
    )
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError("duplicate case names in cases.toml")
    for c in cases:
        if c.optimizer not in OPTIMIZERS:
            raise ValueError(f"{c.name}: unknown optimizer {c.optimizer!r}")
        if c.optimizer == "qhm" and "amsgrad" in c.hparams:
            raise ValueError(f"{c.name}: amsgrad is a QHAdam variant; QHM has none")
        if c.optimizer == "qhmuon":
            if unknown := set(c.hparams) - QHMUON_HPARAMS:
                raise ValueError(
                    f"{c.name}: QHMuon cases take {', '.join(sorted(QHMUON_HPARAMS))}; "
                    f"received {', '.join(sorted(unknown))}"
                )
            if any(len(shape) != 2 for shape in c.problem.shapes):
                raise ValueError(f"{c.name}: QHMuon steps matrices; {c.problem_name} has others")
    return cases


# ------------------------------------------------------------- narrow state
def narrow_state_cases(optimizers: tuple[str, ...] = ("qhm", "qhadam", "qhadamw")) -> list[Case]:
    """The cases on which every backend's tests run bfloat16 state against
    float32 state (``state_dtype``): those of ``optimizers`` (QHM, QHAdam and
    QHAdamW, or QHMuon) at a constant learning rate."""
    return [
        c
        for c in load_cases()
        if c.optimizer in optimizers and c.schedule.get("kind") == "constant"
    ]


def narrow_state_tolerance(case: Case) -> float:
    """How far (relative) 100 steps with bfloat16 state may stray from float32
    state's: 1%, and 2% where |nu| > 1 weights the rounded buffer by more than 1
    (QHM at nu = 1.3 reaches 1.2%, measured)."""
    return 2e-2 if case.name == "qhm-nu-above-one-quadratic" else 1e-2


def eight_bit_tolerance(case: Case) -> float:
    """How far (relative) 100 steps with 8-bit state may stray from float32
    state's. Each step adds unbiased rounding noise of up to 12.5% of a value
    (the ladder's spacing), which an average with beta near one keeps for
    about ``1 / (1 - beta)`` steps: measured worst in torch 9.2% (QHM at nu =
    1.3) and 7.1% (QHAdam, beta1 = 0.9999999), and 13% (QHAdamW, betas near
    one) with the ladder of equal ratios before; QHMuon's matrices 1.1% (its
    orthogonalization keeps a direction, not a size). About twice the worst
    either ladder gave."""
    return 0.1 if case.optimizer == "qhmuon" else 0.25


def stored_state_tolerance(case: Case, eight_bit: bool) -> float:
    """How far (relative) a narrow state, read back as float32 after each of the
    100 steps, may lie from the float32 state of the same steps. The
    trajectories' check alone cannot see a lost state where the trajectory
    barely depends on it (QHMuon's matrices strayed 0.7% with the buffer
    reset at every step; QHM at nu = 0, none at all); a state lost, zeroed or
    read from the wrong place lies 100% away. Measured in torch: bfloat16 at
    most 7.5% (QHM at nu = 1.3, whose trajectory strays most), 3% otherwise;
    8-bit 48% at nu = 1.3, 16% otherwise. About twice those."""
    if case.name == "qhm-nu-above-one-quadratic":
        return 0.7 if eight_bit else 0.15
    return 0.35 if eight_bit else 0.06


def relative_state_distance(narrow: list[Any], wide: list[Any]) -> float:
    """The largest ``|narrow - wide| / |wide|`` over the steps, of the flat
    float arrays of each step's states (steps where ``wide`` is 0 are skipped)."""
    import numpy as np

    largest = 0.0
    for a, b in zip(narrow, wide, strict=True):
        norm = float(np.linalg.norm(b))
        if norm > 0:
            largest = max(largest, float(np.linalg.norm(np.asarray(a) - np.asarray(b))) / norm)
    return largest
