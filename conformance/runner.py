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
import concurrent.futures
import functools
import json
import multiprocessing
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .adapters import REGISTRY, Adapter, load_adapter
from .cases import Case, load_cases

__all__ = [
    "DTYPES",
    "TOLERANCES",
    "Row",
    "format_table",
    "main",
    "max_relative_deviation",
    "record",
    "reference_trajectory",
    "run",
    "write_table",
]

TOLERANCES = {"float64": 1e-12, "float32": 1e-5}
DTYPES = tuple(TOLERANCES)


def reference_trajectory(
    case: Case,
    grads_at: np.ndarray | None = None,
    options: Mapping[str, Any] | None = None,
    *,
    start: np.ndarray | None = None,
) -> np.ndarray:
    """The float64 reference trajectory of ``case``, shape ``(steps + 1, n)``.

    With ``grads_at`` (a backend trajectory) the reference is the *shadow* of
    that run: it starts at ``grads_at[0]`` and step ``t`` uses the gradient
    evaluated at ``grads_at[t]``. ``options`` are a backend's reference options
    (its Muon's form); ``start`` replaces the problem's first point in a closed
    loop. The reference steps each of the problem's tensors on its own.
    """
    problem, opt = case.problem, case.reference_optimizer(**(options or {}))
    if grads_at is not None:
        x = np.asarray(grads_at[0], dtype=np.float64)
    else:
        x = problem.x0 if start is None else np.asarray(start, dtype=np.float64)
    parts = problem.split(x)
    states = [opt.init(p) for p in parts]
    out = [x]
    for t, lr in enumerate(case.lrs):
        grads = problem.split(problem.grad(x if grads_at is None else grads_at[t], t))
        steps = [opt.step(p, g, s, lr) for p, g, s in zip(parts, grads, states, strict=True)]
        parts, states = [p for p, _ in steps], [s for _, s in steps]
        x = problem.join(parts)
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
    ref = reference_trajectory(
        case, None if dtype == "float64" else trajectory, adapter.reference_options(case)
    )
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
    jobs: int = 1,
) -> list[Row]:
    """Every supported (case, backend, dtype) triple; unavailable backends raise.

    ``jobs > 1`` spreads the rows over that many worker processes (each imports
    the backends once); the rows come back in the same order as with one.
    """
    cases = load_cases() if cases is None else cases
    triples, adapters = [], {}
    for name in backends:
        adapter = adapters[name] = load_adapter(name)
        if not adapter.available():
            reason = (
                getattr(adapter, "reason", "") or "its framework (or its build) is missing here"
            )
            raise RuntimeError(f"backend {name!r} is not available: {reason}")
        triples += [
            (name, case, dtype)
            for case in cases
            for dtype in dtypes
            if adapter.supports(case, dtype)
        ]
    if jobs <= 1 or len(triples) <= 1:
        return [check(adapters[name], case, dtype) for name, case, dtype in triples]
    # Spawned, not forked: a framework that has started its threads (torch,
    # XLA) must not be copied mid-flight into a child.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        return list(pool.map(_check_by_name, triples))


@functools.cache
def _adapter(name: str) -> Adapter:
    # A worker's adapters: one per backend, kept for the worker's rows.
    return load_adapter(name)


def _check_by_name(triple: tuple[str, Case, str]) -> Row:
    name, case, dtype = triple
    return check(_adapter(name), case, dtype)


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


def write_table(rows: Sequence[Row], markdown: Path | None, json_path: Path | None) -> None:
    """Write the rows as the Markdown table and as JSON (each where a path is given)."""
    if markdown:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(format_table(rows) + "\n")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = [asdict(r) | {"passed": r.passed} for r in rows]
        json_path.write_text(json.dumps(payload, indent=1))


def read_table(json_path: Path) -> list[Row]:
    """The rows :func:`write_table` wrote as JSON to ``json_path``."""
    names = [f.name for f in fields(Row)]
    return [Row(**{name: r[name] for name in names}) for r in json.loads(json_path.read_text())]


# Where a test that ran a backend's rows keeps its table (``TABLE.md`` and
# ``TABLE.json``): nox sets it, so each session's table comes from the rows its
# tests ran instead of running them a second time.
RECORD_DIRECTORY = "QHOPTIM_CONFORMANCE_OUT"


def record(rows: Sequence[Row], table: str) -> None:
    """Keep ``rows`` as ``table``'s files under ``$QHOPTIM_CONFORMANCE_OUT`` (when it is set)."""
    if directory := os.environ.get(RECORD_DIRECTORY):
        write_table(rows, Path(directory, f"{table}.md"), Path(directory, f"{table}.json"))


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
    parser.add_argument(
        "--jobs", type=int, default=1, help="worker processes to spread the rows over (default 1)"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)

    if args.backends is None:
        backends = [n for n in REGISTRY if load_adapter(n).available()]
    else:
        backends = args.backends
    cases = [c for c in load_cases() if args.pattern in c.name]
    rows = run(backends, args.dtypes, cases, jobs=args.jobs)
    print(format_table(rows))
    write_table(rows, args.markdown, args.json)
    if not rows:
        print("no conformance rows ran", file=sys.stderr)
        return 1
    return 0 if all(r.passed for r in rows) else 1
