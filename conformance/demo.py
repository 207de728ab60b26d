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
from collections.abc import Iterator

import numpy as np

from .adapters import REGISTRY, load_adapter
from .cases import Case, load_cases
from .runner import max_relative_deviation, reference_trajectory

DEMO_CASES = ("qhm-rule-of-thumb-quadratic", "qhadam-slow-beta1-quadratic")
SHOW_STEPS = (0, 1, 10, 50, 150)
KERAS_BACKENDS = ("tensorflow", "jax", "torch")

# Run in a child process with KERAS_BACKEND set: prints the trajectory as JSON.
_KERAS_CHILD = """
import json, sys
from conformance.adapters import load_adapter
from conformance.cases import load_cases
case = {c.name: c for c in load_cases()}[sys.argv[1]]
print(json.dumps(load_adapter("keras").run(case, "float64").tolist()))
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


def _keras_trajectory(case: Case, backend: str) -> np.ndarray:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-c", _KERAS_CHILD, case.name],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return np.asarray(json.loads(out.stdout.strip().splitlines()[-1]), np.float64)


def trajectories(case: Case) -> Iterator[tuple[str, np.ndarray]]:
    """``(row label, float64 trajectory)`` of every installed backend that runs ``case``."""
    for name in REGISTRY:
        if name == "keras":
            for backend in installed_keras_backends():
                yield f"keras-{backend}", _keras_trajectory(case, backend)
            continue
        adapter = load_adapter(name)
        if adapter.available() and adapter.supports(case, "float64"):
            yield name, adapter.run(case, "float64")


def _show(case: Case) -> tuple[bool, list[str]]:
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
    for label, traj in trajectories(case):
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
    results = [_show(by_name[n]) for n in DEMO_CASES]
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
