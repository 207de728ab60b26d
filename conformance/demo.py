"""The same problems through every installed backend: do they all follow one path?

Runs QHM (the paper's rule of thumb, ν = 0.7, β = 0.999) and QHAdam (ν₁ = 0.7,
a QH setting, not Adam) on two of the conformance problems, through the
float64 reference and every backend whose framework is installed here, in
float64. It prints a few points of each trajectory next to the reference
together with the largest relative deviation over all steps.

Keras runs once per installed Keras backend (TensorFlow, JAX, torch), each in
its own process, because a process holds one Keras backend; its rows are
labelled ``keras-<backend>``.

    python -m conformance.demo
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .adapters import REGISTRY, load_adapter
from .cases import Case, load_cases
from .runner import max_relative_deviation, reference_trajectory

DEMO_CASES = ("qhm-rule-of-thumb-quadratic", "qhadam-slow-beta1-quadratic")
SHOW_STEPS = (0, 1, 10, 50, 150)
KERAS_BACKENDS = ("tensorflow", "jax", "torch")

# Run in a child process with KERAS_BACKEND set: prints the trajectory of each
# case named in its arguments, as one JSON object by case name.
_KERAS_CHILD = """
import json, sys
from conformance.adapters import load_adapter
from conformance.cases import load_cases
cases = {c.name: c for c in load_cases()}
keras = load_adapter("keras")
print(json.dumps({name: keras.run(cases[name], "float64").tolist() for name in sys.argv[1:]}))
"""


def _installed(package: str) -> bool:
    # A regular package has an origin (its __init__.py); a bare directory of
    # that name on sys.path (tests/keras under pytest) is a namespace package.
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


def installed_keras_backends() -> list[str]:
    """The Keras backends whose framework is installed here (none without Keras)."""
    if not _installed("keras"):
        return []
    return [b for b in KERAS_BACKENDS if _installed(b)]


class KerasRuns:
    """The Keras rows of ``cases``: one child process per Keras backend (each
    installed one, or ``backends``) runs them all (each imports its framework
    once), every child started at once, while the other backends run here."""

    def __init__(self, cases: Sequence[str], backends: Sequence[str] | None = None) -> None:
        self._children = {
            backend: subprocess.Popen(
                [sys.executable, "-c", _KERAS_CHILD, *cases],
                env=dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for backend in (installed_keras_backends() if backends is None else backends)
        }
        self._runs: dict[str, dict[str, list[Any]]] = {}

    def trajectory(self, case: Case, backend: str) -> np.ndarray:
        if backend not in self._runs:
            child = self._children[backend]
            out, err = child.communicate()
            if child.returncode:
                raise subprocess.CalledProcessError(child.returncode, child.args, out, err)
            self._runs[backend] = json.loads(out.strip().splitlines()[-1])
        return np.asarray(self._runs[backend][case.name], np.float64)


def _keras_trajectory(case: Case, backend: str) -> np.ndarray:
    return KerasRuns([case.name], [backend]).trajectory(case, backend)


def trajectories(case: Case, keras: KerasRuns | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(row label, float64 trajectory)`` of every installed backend that runs
    ``case``; the Keras rows from ``keras`` where given (its children run
    ``case``), else each from a child process of its own."""
    for name in REGISTRY:
        if name == "keras":
            for backend in installed_keras_backends():
                traj = (
                    _keras_trajectory(case, backend)
                    if keras is None
                    else keras.trajectory(case, backend)
                )
                yield f"keras-{backend}", traj
            continue
        adapter = load_adapter(name)
        if adapter.available() and adapter.supports(case, "float64"):
            yield name, adapter.run(case, "float64")


def _show(case: Case, keras: KerasRuns) -> tuple[bool, list[str]]:
    problem = case.problem
    print(f"\n== {case.name}: {case.optimizer} {case.hparams} on {problem.description}")
    ref = reference_trajectory(case)
    print(
        f"{'backend':<18}"
        + "".join(f"{'x[0] @ step ' + str(s):>22}" for s in SHOW_STEPS)
        + f"{'max rel. dev.':>16}"
    )
    print(f"{'reference f64':<18}" + "".join(f"{ref[s, 0]:>22.15f}" for s in SHOW_STEPS))
    ok, rows = True, []
    for label, traj in trajectories(case, keras):
        dev = max_relative_deviation(traj, ref)
        ok &= dev <= 1e-12
        rows.append(label)
        print(
            f"{label:<18}" + "".join(f"{traj[s, 0]:>22.15f}" for s in SHOW_STEPS) + f"{dev:>16.2e}"
        )
    print(
        f"loss: {problem.loss(ref[0]):.4g} -> {problem.loss(ref[-1]):.4g} after {case.steps} steps"
    )
    return ok, rows


def main() -> int:
    by_name = {c.name: c for c in load_cases()}
    keras = KerasRuns(DEMO_CASES)
    results = [_show(by_name[n], keras) for n in DEMO_CASES]
    ok = all(r[0] for r in results)
    labels = list(dict.fromkeys(label for _, rows in results for label in rows))
    print(f"\nproblems: {len(DEMO_CASES)}; backends installed here: {', '.join(labels)}")
    print(
        "every backend agrees with the reference to 1e-12 on every problem"
        if ok
        else "DISAGREEMENT (see above)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
