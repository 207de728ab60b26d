"""Time one optimizer step of qhoptim.mlx against MLX's own optimizers.

    python -m benchmarks.mlx_step [--repeats 40] [--suites resnet18 500x1k]
                                  [--state-dtype bfloat16]

For ResNet-18-shaped float32 parameters and 500 tensors of 1,000 elements
(``benchmarks/shapes.py``), every optimizer gets its own parameters and the
same fixed gradients; after 5 warm-up rounds (compilation included) they step
*interleaved*, one step each, round by round, so that machine noise hits all
of them alike. Each step is ``apply_gradients`` followed by ``mx.eval`` of
the parameters and the state (nothing else holds the old parameters and
state, as in a training step, so MLX may write over them), timed two ways:

* ``eager``: ``optimizer.apply_gradients`` as written;
* ``compiled``: the same call inside ``mx.compile`` with the optimizer's state
  as ``inputs`` and ``outputs`` (MLX's documented compiled training step).

Prints the median ms per step and the ratio of each QH optimizer to its MLX
counterpart: QHM vs ``SGD(momentum=0.9, nesterov=True)``, QHAdam vs
``Adam(bias_correction=True)`` (QHAdam is always bias-corrected).
The QH rows step with MLX's operations (``fused=False``); where qhoptim's C++
step builds (``qhoptim.mlx._extension``), ``-fused`` rows time ``fused=True``
against the same baselines. ``--state-dtype bfloat16`` adds each QH
optimizer with its state stored in bfloat16 (``state_dtype``, stochastically
rounded), timed in the same rounds, with its ratio to the float32-state step
of the same path.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim

import qhoptim.mlx as qhmlx
from benchmarks import positive_int
from benchmarks.shapes import SUITES
from qhoptim.mlx import _extension

QHM_ARGS: dict[str, Any] = {"learning_rate": 0.1, "momentum": 0.999, "nu": 0.7}
QHADAM_ARGS: dict[str, Any] = {"learning_rate": 1e-3, "nus": (0.7, 1.0)}
#: Each timed QH step: (its factory of a state dtype, its baseline's name). The
#: plain rows take MLX's operations (``fused=False``), the fused rows the C++ step.
PAIRS: dict[str, tuple[Callable[[Any], optim.Optimizer], str]] = {
    "qhm": (lambda dtype: qhmlx.QHM(**QHM_ARGS, fused=False), "sgd-nesterov"),
    "qhadam": (lambda dtype: qhmlx.QHAdam(**QHADAM_ARGS, fused=False), "adam"),
}
FUSED_PAIRS: dict[str, tuple[Callable[[Any], optim.Optimizer], str]] = {
    "qhm-fused": (lambda dtype: qhmlx.QHM(**QHM_ARGS, fused=True), "sgd-nesterov"),
    "qhadam-fused": (lambda dtype: qhmlx.QHAdam(**QHADAM_ARGS, fused=True), "adam"),
}
#: With ``--state-dtype``: each QH step with its state in that dtype, against
#: the float32-state step of the same path.
NARROW_PAIRS: dict[str, tuple[Callable[[Any], optim.Optimizer], str]] = {
    "qhm-{}": (lambda dtype: qhmlx.QHM(**QHM_ARGS, state_dtype=dtype, fused=False), "qhm"),
    "qhadam-{}": (
        lambda dtype: qhmlx.QHAdam(**QHADAM_ARGS, state_dtype=dtype, fused=False),
        "qhadam",
    ),
}
FUSED_NARROW_PAIRS: dict[str, tuple[Callable[[Any], optim.Optimizer], str]] = {
    "qhm-fused-{}": (
        lambda dtype: qhmlx.QHM(**QHM_ARGS, state_dtype=dtype, fused=True),
        "qhm-fused",
    ),
    "qhadam-fused-{}": (
        lambda dtype: qhmlx.QHAdam(**QHADAM_ARGS, state_dtype=dtype, fused=True),
        "qhadam-fused",
    ),
}
BASELINES: dict[str, Callable[[], optim.Optimizer]] = {
    "sgd-nesterov": lambda: optim.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optim.Adam(1e-3, bias_correction=True),
}


def _step_fn(opt: optim.Optimizer, compiled: bool) -> Callable[[Any, Any], Any]:
    def step(params: Any, grads: Any) -> Any:
        return opt.apply_gradients(grads, params)

    if not compiled:
        return step
    state = [opt.state]
    return mx.compile(step, inputs=state, outputs=state)


def pairs(state_dtype: str | None, fused: bool) -> dict[str, tuple[Any, str]]:
    """Every timed QH step by name: (its optimizer's factory, its baseline's name)."""
    dtype = getattr(mx, state_dtype) if state_dtype else None
    tables = [PAIRS, NARROW_PAIRS] if dtype else [PAIRS]
    if fused:
        tables += [FUSED_PAIRS, FUSED_NARROW_PAIRS] if dtype else [FUSED_PAIRS]
    return {
        name.format(state_dtype): (lambda make=make: make(dtype), base)
        for table in tables
        for name, (make, base) in table.items()
    }


def bench(
    shapes: list[tuple[int, ...]], compiled: bool, repeats: int, timed: dict[str, tuple[Any, str]]
) -> dict[str, float]:
    grads = {
        f"p{i}": mx.random.normal(s, key=mx.random.key(i)) * 1e-3 for i, s in enumerate(shapes)
    }
    mx.eval(grads)
    factories = {name: make for name, (make, _) in timed.items()} | BASELINES
    runs = {}
    for name, make in factories.items():
        opt = make()
        params = {f"p{i}": mx.ones(s, mx.float32) for i, s in enumerate(shapes)}
        opt.init(params)
        mx.eval(params, opt.state)
        runs[name] = [opt, _step_fn(opt, compiled), params]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats + 5):  # 5 warm-up rounds (compilation included)
        for name, run in runs.items():
            # The old parameters released before the step, as a training
            # step releases them (``model.update``): MLX may write over them.
            opt, step, params = run
            run[2] = None
            t0 = time.perf_counter()
            params = step(params, grads)
            mx.eval(params, opt.state)
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
            run[2] = params
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=positive_int, default=40)
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--state-dtype", default=None, help="also time state_dtype=this")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    fused = _extension.fused_extension_available()
    timed = pairs(args.state_dtype, fused)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, {platform.machine()}")
    if not fused:
        print("no fused rows: qhoptim.mlx's C++ step is not built here (needs nanobind and c++)")
    print(f"median of {args.repeats} steps, ms/step; ratio = qhoptim / baseline\n")
    print(
        f"{'params':<10}{'step':<10}{'optimizer':<22}{'ms':>9}{'baseline':>14}{'ms':>9}{'ratio':>8}"
    )
    for suite in args.suites:
        for compiled in (False, True):
            ms = bench(SUITES[suite], compiled, args.repeats, timed)
            mode = "compiled" if compiled else "eager"
            for name, (_, base) in timed.items():
                print(
                    f"{suite:<10}{mode:<10}{name:<22}{ms[name]:>9.2f}{base:>14}"
                    f"{ms[base]:>9.2f}{ms[name] / ms[base]:>8.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
