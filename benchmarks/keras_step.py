"""Time one optimizer step of qhoptim.keras against Keras's own optimizers.

    python benchmarks/keras_step.py [--repeats 30] [--backends tensorflow jax torch]
                                    [--state-dtype bfloat16]

Each Keras backend runs in its own process (``KERAS_BACKEND`` is fixed at
import), the way ``model.fit`` applies gradients there:

* tensorflow: ``optimizer.apply`` inside ``tf.function`` (no XLA: ``model.fit``'s
  ``jit_compile="auto"`` turns XLA off on CPU-only machines);
* jax: ``optimizer.stateless_apply`` under ``jax.jit`` with the optimizer and
  model state donated (as Keras's JAX trainer does);
* torch: ``optimizer.apply`` eagerly under ``torch.no_grad()``, as Keras's torch
  trainer runs it. Keras's own ``SGD`` and ``Adam`` have hand-written
  ``torch._foreach`` versions on this backend; ours step through
  ``qhoptim.torch``'s multi-tensor kernels.

Parameters are ResNet-18-shaped (62 tensors, 11.7M floats) and 500 tensors of
1,000 elements, float32. The optimizers are interleaved round by round so they
share the machine's state; the table shows the median ms per step over
``--repeats`` rounds after warm-up, and the ratio of each QH optimizer to its
Keras counterpart: QHM vs ``SGD(momentum=0.9, nesterov=True)``, QHAdam vs
``Adam``. Tracing 500 variables into a ``tf.function`` dominates the run time
(about 3 minutes for the default backends on a 2-core machine).
``--state-dtype bfloat16`` adds each QH optimizer with its slots stored in
bfloat16 (``state_dtype``, stochastically rounded), with its ratio to the
float32-slot step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3

PAIRS = {"qhm": "sgd-nesterov", "qhadam": "adam"}


def _optimizers(state_dtype: str | None = None) -> dict[str, Any]:
    import keras

    import qhoptim.keras as qk

    optimizers = {
        "qhm": lambda: qk.QHM(0.1, momentum=0.999, nu=0.7),
        "qhadam": lambda: qk.QHAdam(1e-3, nu_1=0.7),
        "sgd-nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        "adam": lambda: keras.optimizers.Adam(1e-3),
    }
    if state_dtype is not None:
        optimizers[f"qhm-{state_dtype}"] = lambda: qk.QHM(
            0.1, momentum=0.999, nu=0.7, state_dtype=state_dtype
        )
        optimizers[f"qhadam-{state_dtype}"] = lambda: qk.QHAdam(
            1e-3, nu_1=0.7, state_dtype=state_dtype
        )
    return optimizers


def _stepper(backend: str, opt: Any, shapes: list[tuple[int, ...]], grads: list[Any]) -> Any:
    """A zero-argument callable taking one optimizer step and blocking until it is done."""
    import keras
    import numpy as np

    variables = [keras.Variable(np.ones(s, np.float32)) for s in shapes]
    opt.build(variables)
    if backend == "tensorflow":
        import tensorflow as tf

        apply = tf.function(opt.apply, jit_compile=False)

        def step() -> None:
            apply(grads)
            variables[0].numpy()  # wait for the step (reads one small result)

        return step
    if backend == "jax":
        import jax

        # The state donated in the order the step returns it (the variables,
        # then the optimizer's), as Keras's trainer donates its state: JAX
        # hands a donated buffer to the next output of its shape, and in
        # another order XLA copies what it cannot then update in place (124
        # copies for SGD on ResNet-18, 338 for Adam; Keras's optimizers and
        # QH's alike).
        apply = jax.jit(
            lambda params, opt_vars, grads: opt.stateless_apply(opt_vars, grads, params),
            donate_argnums=(0, 1),
        )
        state = [[v.value for v in variables], [v.value for v in opt.variables]]

        def step() -> None:
            state[:] = apply(state[0], state[1], grads)
            jax.block_until_ready(state[0])

        return step
    import torch

    def step() -> None:
        with torch.no_grad():
            opt.apply(grads)
        if variables[0].value.is_cuda:
            torch.cuda.synchronize()  # wait for the step's kernels

    return step


def run_backend(
    backend: str, repeats: int, state_dtype: str | None = None
) -> dict[str, dict[str, float]]:
    """Median ms per step of every optimizer on every suite, in this process's backend."""
    import keras
    import numpy as np
    from keras import ops

    from benchmarks.shapes import SUITES

    assert keras.backend.backend() == backend, (keras.backend.backend(), backend)
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, float]] = {}
    for suite, shapes in SUITES.items():
        grads = [
            ops.convert_to_tensor((1e-3 * rng.standard_normal(s)).astype(np.float32))
            for s in shapes
        ]
        steps = {
            name: _stepper(backend, make(), shapes, grads)
            for name, make in _optimizers(state_dtype).items()
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(WARMUP + repeats):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step()
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - t0)
        results[suite] = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
        del steps
    return results


def _versions(backend: str) -> str:
    import importlib

    import keras

    module = importlib.import_module(backend)
    where = ""
    if backend == "torch":  # Keras puts variables on the GPU when torch sees one
        import torch

        where = " on cuda" if torch.cuda.is_available() else " on cpu"
    return f"keras {keras.__version__}, {backend} {module.__version__}{where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["tensorflow", "jax", "torch"],
        choices=["tensorflow", "jax", "torch"],
    )
    parser.add_argument("--state-dtype", default=None, help="also time state_dtype=this")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one backend, print JSON
    args = parser.parse_args()

    if args.child:
        ms = run_backend(args.child, args.repeats, args.state_dtype)
        print(json.dumps({"versions": _versions(args.child), "ms": ms}))
        return

    versions = []
    header = f"{'backend':<12}{'params':<10}{'optimizer':<16}{'ms':>9}{'baseline':>14}{'ms':>9}"
    print(f"median of {args.repeats} steps, ms/step; ratio = qhoptim / Keras baseline\n")
    print(header + f"{'ratio':>8}")
    failed: list[str] = []
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT))
        narrow = ["--state-dtype", args.state_dtype] if args.state_dtype else []
        proc = subprocess.run(
            [sys.executable, __file__, "--child", backend, "--repeats", str(args.repeats), *narrow],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            print(f"{backend}: failed\n{proc.stderr[-2000:]}")
            failed.append(backend)
            continue
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        versions.append(out["versions"])
        for suite, ms in out["ms"].items():
            for name, base in PAIRS.items():
                print(
                    f"{backend:<12}{suite:<10}{name:<16}{ms[name]:>9.2f}{base:>14}"
                    f"{ms[base]:>9.2f}{ms[name] / ms[base]:>8.2f}"
                )
                narrow_name = f"{name}-{args.state_dtype}"
                if narrow_name in ms:
                    print(
                        f"{backend:<12}{suite:<10}{narrow_name:<16}{ms[narrow_name]:>9.2f}"
                        f"{name:>14}{ms[name]:>9.2f}{ms[narrow_name] / ms[name]:>8.2f}"
                    )
    print("\n" + "; ".join(versions))
    if failed:  # noted above; the exit status says so too
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
