"""Time one jitted optimizer step (update + apply) of qhoptim.optax against optax.

    python -m benchmarks.optax_step [--repeats 40] [--scale [--sizes 1e6 1e7 1e8]]
                                    [--state-dtype bfloat16] [--layout flax]

For ResNet-18-shaped float32 parameters and 500 tensors of 1,000 elements,
with the parameters and the state donated to the step (``all``), without
donation (``none``) and, with ``--state-dtype``, with the parameters alone
donated (``params``: XLA's CPU backend copies each donated narrow state
before its step, see docs/state_dtype.md), interleaving the optimizers round by round
so they share the machine's state; prints the median ms per step and the ratio
of each QH optimizer to its optax counterpart (QHM vs
``optax.sgd(momentum=0.9, nesterov=True)``, QHAdam vs ``optax.adam``).
``--scale`` times one flat tensor of each size instead (with donation).
``--layout flax`` gives ResNet-18's kernels flax's layout (channels last).
``--state-dtype bfloat16`` (or ``uint8``, 8-bit) adds each QH optimizer with
its state stored in that dtype (``state_dtype``, stochastically rounded), timed
in the same rounds, with its ratio to the float32-state step: on the default
path (on the CPU, the C++ state step, ``fused=None``) and, as ``-xla``, in
XLA's operations (``fused=False``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import qhoptim.optax as qho
from benchmarks import positive_float, positive_int
from benchmarks.shapes import SUITES

PAIRS = {
    "qhm": (lambda: qho.qhm(0.1, 0.999, 0.7), "sgd-nesterov"),
    "qhadam": (lambda: qho.qhadam(1e-3, nu1=0.7), "adam"),
}
BASELINES: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd-nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-3),
}


#: What each ``donate`` mode gives the jitted step to overwrite: its arguments'
#: positions (params, state).
DONATE = {"all": (0, 1), "params": (0,), "none": ()}


def _step_fn(tx: optax.GradientTransformation, donate: str) -> Callable[..., Any]:
    def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=DONATE[donate])


NARROW = {
    "qhm": lambda dtype, **kw: qho.qhm(0.1, 0.999, 0.7, state_dtype=dtype, **kw),
    "qhadam": lambda dtype, **kw: qho.qhadam(1e-3, nu1=0.7, state_dtype=dtype, **kw),
}


def bench(
    shapes: list[tuple[int, ...]], donate: str, repeats: int, state_dtype: str | None = None
) -> dict[str, float]:
    key = jax.random.PRNGKey(0)
    grads = [jax.random.normal(jax.random.fold_in(key, i), s) * 1e-3 for i, s in enumerate(shapes)]
    factories = {name: make for name, (make, _) in PAIRS.items()} | BASELINES
    if state_dtype is not None:
        for name, make_narrow in NARROW.items():
            factories[f"{name}-{state_dtype}"] = lambda m=make_narrow: m(state_dtype)
            if state_dtype in ("bfloat16", "uint8"):  # a C++ state step stores these
                factories[f"{name}-{state_dtype}-xla"] = lambda m=make_narrow: m(
                    state_dtype, fused=False
                )
    runs = {}
    for name, make in factories.items():
        tx = make()
        params = [jnp.ones(s, jnp.float32) for s in shapes]
        runs[name] = [_step_fn(tx, donate), params, tx.init(params)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats + 5):  # 5 warm-up rounds (compilation included)
        for name, run in runs.items():
            step, params, state = run
            t0 = time.perf_counter()
            params, state = step(params, state, grads)
            jax.block_until_ready(params)
            if i >= 5:
                times[name].append(time.perf_counter() - t0)
            run[1], run[2] = params, state
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def flax_layout(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Shapes in flax's layout: convolution kernels (kh, kw, in, out), dense (in, out).

    XLA's CPU loops over torch's (out, in, 3, 3) kernels run along their small
    trailing dimensions; flax's kernels end in the channels."""

    def flax(shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) == 4:
            out, inp, kh, kw = shape
            return (kh, kw, inp, out)
        return tuple(reversed(shape)) if len(shape) == 2 else shape

    return [flax(s) for s in shapes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=positive_int, default=40)
    parser.add_argument("--scale", action="store_true", help="one flat tensor per size")
    parser.add_argument("--sizes", nargs="+", type=positive_float, default=[1e6, 1e7, 1e8])
    parser.add_argument("--state-dtype", default=None, help="also time state_dtype=this")
    parser.add_argument(
        "--layout",
        choices=("torch", "flax"),
        default="torch",
        help="ResNet-18's kernels as torch stores them (out, in, kh, kw) or as flax does "
        "(kh, kw, in, out; dense kernels (in, out))",
    )
    args = parser.parse_args()
    suites = SUITES if args.layout == "torch" else {k: flax_layout(v) for k, v in SUITES.items()}
    if args.scale:
        suites = {f"{int(n):,}": [(int(n),)] for n in args.sizes}
    print(f"jax {jax.__version__}, optax {optax.__version__}, device {jax.devices()[0]}")
    print(f"layout of the kernels: {args.layout}")
    print(f"median of {args.repeats} steps, ms/step; ratio = qhoptim / optax baseline\n")
    print(
        f"{'params':<10}{'donate':<8}{'optimizer':<20}{'ms':>9}{'baseline':>14}{'ms':>9}{'ratio':>8}"
    )
    for suite, shapes in suites.items():
        modes = ("all", "params", "none") if args.state_dtype else ("all", "none")
        for donate in ("all",) if args.scale else modes:
            ms = bench(shapes, donate, args.repeats, args.state_dtype)
            for name, (_, base) in PAIRS.items():
                print(
                    f"{suite:<10}{donate:<8}{name:<20}{ms[name]:>9.2f}{base:>14}"
                    f"{ms[base]:>9.2f}{ms[name] / ms[base]:>8.2f}"
                )
                for narrow in (f"{name}-{args.state_dtype}", f"{name}-{args.state_dtype}-xla"):
                    if narrow in ms:
                        print(
                            f"{suite:<10}{donate:<8}{narrow:<20}{ms[narrow]:>9.2f}{name:>14}"
                            f"{ms[name]:>9.2f}{ms[narrow] / ms[name]:>8.2f}"
                        )


if __name__ == "__main__":
    main()
