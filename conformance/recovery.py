"""Recovery suite: QHM / QHAdam reproduce the algorithms Ma & Yarats (2019) connect them to.

For every case of ``conformance/recovery.toml`` the naive source algorithm
(:mod:`conformance.sources`, written from its own paper) and the float64
reference QHM / QHAdam (:mod:`qhoptim.reference`, configured by
:mod:`qhoptim.convert`) run side by side, closed-loop, on the same problem. The
case's deviation is

    max_t ||x_src_t - x_qh_t||_inf / max(||x_src_t||_inf, 1e-300)

over the trajectories of gradient-evaluation points (non-finite values count
as infinite); it must be at most :data:`TOLERANCE`.

:func:`errata_rows` re-runs the affected cases with the formulas *as printed*
in the paper, to show how the suite detects each erratum recorded in
``docs/conversions.md`` (those deviations are expected to be large).

Run ``python -m conformance.recovery`` for the table; the exit status is
nonzero if any case fails.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from qhoptim import convert as conversions
from qhoptim.reference import QHM, QHAdam, QHMState

from .problems import PROBLEMS as PROBLEM_NAMES
from .problems import Problem, get_problem
from .runner import max_relative_deviation
from .sources import F64, SOURCES, AccSGD, run, run_source

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "CASES_FILE",
    "TOLERANCE",
    "ErratumRow",
    "RecoveryCase",
    "Row",
    "errata_rows",
    "format_table",
    "load_cases",
    "main",
    "qh_trajectory",
    "recovery_rows",
    "run_case",
]

TOLERANCE = 1e-10
CASES_FILE = Path(__file__).with_name("recovery.toml")
EXACTNESS = ("exact", "modulo bias correction")


@dataclass(frozen=True)
class RecoveryCase:
    """One row of ``recovery.toml``."""

    name: str
    source: str
    convert: str
    params: dict[str, Any] = field(hash=False)
    problem: str
    steps: int
    exactness: str
    source_params: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def bias_correction(self) -> bool:
        return self.exactness == "exact"

    def converted(self) -> conversions.QHMParams | conversions.QHAdamParams:
        params = dict(self.params)
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        result: conversions.QHMParams | conversions.QHAdamParams = getattr(
            conversions, self.convert
        )(**params)
        return result

    def initial_buffer(self, x0: F64) -> F64 | None:
        """QHM's starting buffer ``g_0`` (only the two-state optimizer needs one)."""
        if self.source != "two_state":
            return None
        scale = conversions.two_state_initial_buffer(**self.params)
        a0 = self.source_params.get("a0_scale", 0.0) * x0 + self.source_params.get("a0_shift", 0.0)
        return scale.a_scale * a0 + scale.theta_scale * x0  # type: ignore[no-any-return]

    def source_trajectory(self, **overrides: Any) -> F64:
        p = get_problem(self.problem)
        params = {**self.params, **self.source_params, **overrides}
        return run_source(self.source, p.grad, p.x0, self.steps, **params)


@cache
def load_cases(path: Path = CASES_FILE) -> tuple[RecoveryCase, ...]:
    """Parse and sanity-check ``recovery.toml``."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)["case"]
    cases = tuple(RecoveryCase(**row) for row in raw)
    names = [c.name for c in cases]
    for c in cases:
        if names.count(c.name) != 1:
            raise ValueError(f"duplicate recovery case name {c.name!r}")
        if c.source not in SOURCES or not hasattr(conversions, c.convert):
            raise ValueError(f"{c.name}: unknown source {c.source!r} or conversion {c.convert!r}")
        if c.problem not in PROBLEM_NAMES or c.exactness not in EXACTNESS or c.steps < 100:
            raise ValueError(f"{c.name}: bad problem, exactness or steps (< 100)")
    return cases


def qh_trajectory(
    params: conversions.QHMParams | conversions.QHAdamParams,
    problem: Problem,
    steps: int,
    *,
    bias_correction: bool = True,
    initial_buffer: F64 | None = None,
) -> F64:
    """Closed-loop trajectory of the reference QHM / QHAdam with converted ``params``."""
    x: Any = np.array(problem.x0, dtype=np.float64)
    traj = [x]
    if isinstance(params, conversions.QHMParams):
        qhm = QHM(params.lr, params.momentum, params.nu)
        state = qhm.init(x) if initial_buffer is None else QHMState(initial_buffer)
        for t in range(steps):
            x, state = qhm.step(x, problem.grad(x, t), state)
            traj.append(x)
    else:
        qhadam = QHAdam(params.lr, params.betas, params.nus, params.eps)
        astate = qhadam.init(x)
        for t in range(steps):
            g = problem.grad(x, t)
            x, astate = qhadam.step(x, g, astate, bias_correction=bias_correction)
            traj.append(x)
    return np.stack(traj)


@dataclass(frozen=True)
class Row:
    """One computed recovery case."""

    case: str
    source: str
    exactness: str
    steps: int
    max_rel_dev: float
    tolerance: float = TOLERANCE

    @property
    def passed(self) -> bool:
        return self.max_rel_dev <= self.tolerance


def run_case(case: RecoveryCase) -> Row:
    """Run the source and QHM / QHAdam side by side and measure the deviation."""
    problem = get_problem(case.problem)
    qh = qh_trajectory(
        case.converted(),
        problem,
        case.steps,
        bias_correction=case.bias_correction,
        initial_buffer=case.initial_buffer(problem.x0),
    )
    dev = max_relative_deviation(case.source_trajectory(), qh)
    return Row(case.name, case.source, case.exactness, case.steps, dev)


def recovery_rows() -> list[Row]:
    """Every case of ``recovery.toml``, computed."""
    return [run_case(c) for c in load_cases()]


# ------------------------------------------------------------------------ errata
@dataclass(frozen=True)
class ErratumRow:
    """A case re-run with the paper's printed formula (``printed``) and ours (``corrected``)."""

    erratum: str
    case: str
    printed_dev: float
    corrected_dev: float


def _printed_an_pid(case: RecoveryCase) -> float:
    # App. E prints nu = 1 - k_D (1 - beta)^2 / (r beta).
    r, k_d, beta = case.params["r"], case.params["k_d"], case.params["beta"]
    printed = conversions.QHMParams(r / (1 - beta), 1 - k_d * (1 - beta) ** 2 / (r * beta), beta)
    p = get_problem(case.problem)
    return max_relative_deviation(case.source_trajectory(), qh_trajectory(printed, p, case.steps))


def _printed_accsgd(case: RecoveryCase) -> float:
    # Sec. 4.4 / App. C.5 print the update rule with each line's weights swapped;
    # its QHM conversion (computed for the original rule) cannot match it.
    p = get_problem(case.problem)
    src = run(AccSGD(**case.params, printed=True), p.grad, p.x0, case.steps)
    return max_relative_deviation(src, qh_trajectory(case.converted(), p, case.steps))


def _printed_two_state(case: RecoveryCase) -> float:
    # App. D: alpha, nu, beta and g_0 = c a_0 as printed (valid only if h - q + phi = 0).
    h, k, l, m, q, z = (case.params[n] for n in "hklmqz")  # noqa: E741
    phi, psi = math.sqrt((h - q) ** 2 + 4 * k * m), k * m - h * q
    common = (h - q - phi) * (l * m - h * z) + 2 * m * (l * q - k * z)
    printed = conversions.QHMParams(
        common / (2 * psi * phi), 2 * m * (l * q - k * z) / common, (h + q - phi) / 2
    )
    c = -(2 - (h + q - phi)) * psi / ((h + q - phi) * (l * q - k * z))
    p = get_problem(case.problem)
    sp = case.source_params
    g0 = c * (sp.get("a0_scale", 0.0) * p.x0 + sp.get("a0_shift", 0.0))
    qh = qh_trajectory(printed, p, case.steps, initial_buffer=g0)
    return max_relative_deviation(case.source_trajectory(), qh)


_ERRATA: dict[str, tuple[Callable[[RecoveryCase], bool], Callable[[RecoveryCase], float]]] = {
    "An-PID nu sign (App. E)": (lambda c: c.source == "an_pid", _printed_an_pid),
    "AccSGD update rule (Sec. 4.4, App. C.5)": (lambda c: c.source == "accsgd", _printed_accsgd),
    "TSO nu and g_0 outside h - q + phi = 0 (App. D)": (
        lambda c: c.source == "two_state" and "general" in c.name,
        _printed_two_state,
    ),
}


def errata_rows() -> list[ErratumRow]:
    """Affected cases re-run with the paper's printed formulas (expected to fail)."""
    rows = []
    for label, (applies, printed) in _ERRATA.items():
        for case in load_cases():
            if applies(case):
                with np.errstate(all="ignore"):  # printed formulas may diverge
                    dev = printed(case)
                rows.append(ErratumRow(label, case.name, dev, run_case(case).max_rel_dev))
    return rows


# ------------------------------------------------------------------------- table
def format_table(rows: Sequence[Row]) -> str:
    """Plain-text table of recovery rows."""
    head = ("case", "source", "exactness", "steps", "max rel dev", "tolerance", "pass")
    body = [
        (
            r.case,
            r.source,
            r.exactness,
            str(r.steps),
            f"{r.max_rel_dev:.2e}",
            f"{r.tolerance:.0e}",
            "PASS" if r.passed else "FAIL",
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in [head]]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in body]
    return "\n".join(lines)


def format_errata(rows: Sequence[ErratumRow]) -> str:
    """Plain-text table of erratum detections."""
    out = [f"{'erratum':48}  {'case':36}  {'printed dev':>11}  {'corrected dev':>13}"]
    for r in rows:
        out.append(f"{r.erratum:48}  {r.case:36}  {r.printed_dev:11.2e}  {r.corrected_dev:13.2e}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.recovery", description=__doc__)
    parser.add_argument("--errata", action="store_true", help="also show the errata detections")
    args = parser.parse_args(argv)
    rows = recovery_rows()
    print(format_table(rows))
    failed = [r.case for r in rows if not r.passed]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} recovery cases within {TOLERANCE:g}.")
    if args.errata:
        print("\nPaper's printed formulas on the affected cases (large = erratum detected):\n")
        print(format_errata(errata_rows()))
    if failed:
        print("FAILED: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
