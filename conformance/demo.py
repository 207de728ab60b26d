"""One problem, every installed backend: do they all follow the same path?

Runs QHM and QHAdam on the 4-D Rosenbrock problem through the float64
reference and every backend whose framework is installed here, in float64,
and prints a few points of each trajectory next to the reference together
with the largest relative deviation over all steps.

    python -m conformance.demo
"""

from __future__ import annotations

import sys

from .adapters import REGISTRY, load_adapter
from .cases import Case, load_cases
from .runner import max_relative_deviation, reference_trajectory

DEMO_CASES = ("qhm-rule-of-thumb-quadratic", "qhadam-adam-rosenbrock")
SHOW_STEPS = (0, 1, 10, 50, 150)


def _show(case: Case) -> bool:
    problem = case.problem
    print(f"\n== {case.name}: {case.optimizer} {case.hparams} on {problem.description}")
    ref = reference_trajectory(case)
    print(
        f"{'backend':<16}"
        + "".join(f"{'x[0] @ step ' + str(s):>22}" for s in SHOW_STEPS)
        + f"{'max rel. dev.':>16}"
    )
    print(f"{'reference f64':<16}" + "".join(f"{ref[s, 0]:>22.15f}" for s in SHOW_STEPS))
    ok = True
    for name in REGISTRY:
        adapter = load_adapter(name)
        if not adapter.available() or not adapter.supports(case, "float64"):
            continue
        traj = adapter.run(case, "float64")
        dev = max_relative_deviation(traj, ref)
        ok &= dev <= 1e-12
        print(
            f"{name:<16}" + "".join(f"{traj[s, 0]:>22.15f}" for s in SHOW_STEPS) + f"{dev:>16.2e}"
        )
    print(
        f"loss: {problem.loss(ref[0]):.4g} -> {problem.loss(ref[-1]):.4g} after {case.steps} steps"
    )
    return ok


def main() -> int:
    by_name = {c.name: c for c in load_cases()}
    ok = all([_show(by_name[n]) for n in DEMO_CASES])
    installed = [n for n in REGISTRY if load_adapter(n).available()]
    print(f"\nbackends installed here: {', '.join(installed)}")
    print("all backends agree with the reference to 1e-12" if ok else "DISAGREEMENT (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
