"""One backend's conformance rows, plus its trajectories of the case the site plots.

    python docs/_ext/conformance_job.py BACKEND OUTDIR [--rows ROWS.json]

Runs ``conformance.runner.run([BACKEND])`` -- what ``python -m conformance
--backends BACKEND --json`` runs -- and writes ``OUTDIR/conformance-BACKEND.json``
(the same rows; with ``--rows``, the rows a nox session of the same run ran
and kept, ``conformance.runner.record``'s JSON, instead of running them
again), then runs the plotted case (``figures.TRAJECTORY_CASE``) once
more per dtype through the backend's adapter and saves the trajectories to
``OUTDIR/trajectory-BACKEND.npz`` for ``figures.py trajectories``. One process
per backend, so each framework is imported once. Exit status: 0 if every row
passed, 1 if some failed, 3 if the backend is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import TRAJECTORY_CASE  # noqa: E402

from conformance.adapters import load_adapter  # noqa: E402
from conformance.cases import load_cases  # noqa: E402
from conformance.runner import Row, read_table, run, write_table  # noqa: E402


def kept_rows(path: Path, label: str) -> list[Row]:
    """The rows of the backend named ``label`` in its rows that
    ``conformance.runner.record`` kept in ``path``."""
    rows = read_table(path)
    if not rows or any(r.backend != label for r in rows):
        raise SystemExit(f"{path} does not hold the rows of {label}")
    return rows


def main(backend: str, out: Path, rows_path: Path | None = None) -> int:
    adapter = load_adapter(backend)
    if not adapter.available():
        print(
            f"backend {backend!r} is not available: {getattr(adapter, 'reason', '')}",
            file=sys.stderr,
        )
        return 3
    label = getattr(adapter, "name", backend)
    rows = run([backend]) if rows_path is None else kept_rows(rows_path, label)
    write_table(rows, None, out / f"conformance-{backend}.json")

    case = next(c for c in load_cases() if c.name == TRAJECTORY_CASE)
    runs = {
        dtype: np.asarray(adapter.run(case, dtype), dtype=np.float64)
        for dtype in ("float64", "float32")
        if adapter.supports(case, dtype)
    }
    np.savez(out / f"trajectory-{backend}.npz", label=np.array(label), **runs)
    failed = [f"{r.case} {r.dtype}" for r in rows if not r.passed]
    if failed:
        print("failed rows: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    rows_path = Path(sys.argv[4]) if sys.argv[3:4] == ["--rows"] else None
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), rows_path))
