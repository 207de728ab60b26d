"""Run backends through the cases and compare every step with the reference.

Comparison rules
----------------
* **float64** runs are compared with an *independent* closed-loop float64
  reference trajectory: both follow their own gradients from the same start,
  so the check covers the whole feedback loop. Tolerance 1e-12.
* **float32** runs are compared with a *shadow* reference: the float64
  reference fed the gradients evaluated at the backend's own iterates, from
  the backend's own (rounded) start. Closed-loop float32 trajectories of an
  ill-conditioned problem legitimately drift from float64 by far more than
  rounding, because the problem amplifies perturbations; shadowing measures
  only what the optimizer contributes. Tolerance 1e-5.

The deviation of a step is ``max|x_backend - x_ref| / max|x_ref|`` (the
problems keep ``x`` away from the origin), and a case's deviation is the
maximum over all its steps. Non-finite values count as infinite deviation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .adapters import REGISTRY, Adapter, load_adapter
from .cases import Case, load_cases

__all__ = [
    "TOLERANCES",
    "Row",
    "format_table",
    "main",
    "max_relative_deviation",
    "reference_trajectory",
    "run",
]

TOLERANCES = {"float64": 1e-12, "float32": 1e-5}
DTYPES = tuple(TOLERANCES)


def reference_trajectory(case: Case, grads_at: np.ndarray | None = None) -> np.ndarray:
    """The float64 reference trajectory of ``case``, shape ``(steps + 1, n)``.

    With ``grads_at`` (a backend trajectory) the reference is the *shadow* of
    that run: it starts at ``grads_at[0]`` and step ``t`` uses the gradient
    evaluated at ``grads_at[t]``.
    """
    problem, opt = case.problem, case.reference_optimizer()
    x = problem.x0 if grads_at is None else np.asarray(grads_at[0], dtype=np.float64)
    state = opt.init(x)
    out = [x]
    for t, lr in enumerate(case.lrs):
        g = problem.grad(x if grads_at is None else grads_at[t], t)
        x, state = opt.step(x, g, state, lr)
        out.append(x)
    return np.stack(out)


def max_relative_deviation(trajectory: np.ndarray, ref: np.ndarray) -> float:
    """``max_t  max|x_t - r_t| / max|r_t|`` (``inf`` if anything is non-finite; 0/0 is 0)."""
    trajectory, ref = np.asarray(trajectory, np.float64), np.asarray(ref, np.float64)
    if trajectory.shape != ref.shape:
        raise ValueError(f"trajectory shape {trajectory.shape} != reference {ref.shape}")
    if not (np.all(np.isfinite(trajectory)) and np.all(np.isfinite(ref))):
        return float("inf")
    num = np.max(np.abs(trajectory - ref), axis=1)
    den = np.max(np.abs(ref), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        # A step where both are exactly 0 (a start at the origin) deviates by 0.
        dev = np.where(num == 0, 0.0, num / den)
    return float(np.max(dev))


@dataclass(frozen=True)
class Row:
    case: str
    backend: str
    dtype: str
    steps: int
    deviation: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.deviation <= self.tolerance


def check(adapter: Adapter, case: Case, dtype: str) -> Row:
    """Run one case on one backend in one dtype and compare with the reference."""
    trajectory = adapter.run(case, dtype)
    ref = reference_trajectory(case, None if dtype == "float64" else trajectory)
    return Row(
        case.name,
        adapter.name,
        dtype,
        case.steps,
        max_relative_deviation(trajectory, ref),
        TOLERANCES[dtype],
    )


def run(
    backends: Iterable[str],
    dtypes: Sequence[str] = DTYPES,
    cases: Sequence[Case] | None = None,
) -> list[Row]:
    """Every supported (case, backend, dtype) triple; unavailable backends raise."""
    rows = []
    for name in backends:
        adapter = load_adapter(name)
        if not adapter.available():
            raise RuntimeError(
                f"backend {name!r} is not available: {getattr(adapter, 'reason', '')}"
            )
        for case in load_cases() if cases is None else cases:
            for dtype in dtypes:
                if adapter.supports(case, dtype):
                    rows.append(check(adapter, case, dtype))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table: case, backend, dtype, steps, max rel. deviation, tolerance, pass."""
    head = "| case | backend | dtype | steps | max rel. deviation | tolerance | pass |"
    lines = [head, "|---|---|---|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.backend} | {r.dtype} | {r.steps} | {r.deviation:.2e} "
            f"| {r.tolerance:.0e} | {'yes' if r.passed else '**NO**'} |"
        )
    n_ok = sum(r.passed for r in rows)
    lines.append("")
    lines.append(f"{n_ok} passed, {len(rows) - n_ok} failed")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        help=f"backends to run (default: every available one of {', '.join(REGISTRY)})",
    )
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument(
        "-k", dest="pattern", default="", help="only cases whose name contains this"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)

    if args.backends is None:
        backends = [n for n in REGISTRY if load_adapter(n).available()]
    else:
        backends = args.backends
    cases = [c for c in load_cases() if args.pattern in c.name]
    rows = run(backends, args.dtypes, cases)
    table = format_table(rows)
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = [asdict(r) | {"passed": r.passed} for r in rows]
        args.json.write_text(json.dumps(payload, indent=1))
    if not rows:
        print("no conformance rows ran", file=sys.stderr)
        return 1
    return 0 if all(r.passed for r in rows) else 1
