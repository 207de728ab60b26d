"""Time one QHMuon step against the framework's own Muon, interleaved.

Usage::

    python -m benchmarks.muon_step --framework torch [--steps 30] [--warmup 5] [--device cuda]
    python -m benchmarks.muon_step --framework optax
    python -m benchmarks.muon_step --framework mlx
    KERAS_BACKEND=jax python -m benchmarks.muon_step --framework keras

The matrices of a small transformer (four blocks of width 128: attention's
four 128 x 128 projections and the MLP's 512 x 128 and 128 x 512, in the
framework's layout) each get the same fixed gradients. After a warm-up the
two optimizers step interleaved (one step each, round robin) so that machine
noise hits both alike; the median of ``--steps`` steps is reported with the
ratio QHMuon / Muon. The target: QHMuon within 5% of Muon (the orthogonalization
dominates; QH's mix is one more element-wise operation per matrix).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks import positive_int

WIDTH, BLOCKS = 128, 4
# (fan_out, fan_in) of each matrix: attention's q, k, v, o and the MLP's two.
MATRICES = [(WIDTH, WIDTH)] * 4 + [(4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)]
SHAPES = MATRICES * BLOCKS


def _interleaved(steps: dict[str, Callable[[], None]], n: int, warmup: int) -> dict[str, float]:
    """The median seconds of each of ``steps`` over ``n`` round-robin calls."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def torch_steps(device: str = "cpu") -> dict[str, Callable[[], None]]:
    import torch

    from qhoptim.torch import QHMuon

    gen = torch.Generator().manual_seed(0)

    def params() -> list[torch.Tensor]:
        out = []
        for shape in SHAPES:
            p = torch.randn(shape, generator=gen).to(device).requires_grad_()
            p.grad = torch.randn(shape, generator=gen).to(device)
            out.append(p)
        return out

    def timed(step: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            step()
            if device != "cpu":
                torch.cuda.synchronize()

        return run

    muon = torch.optim.Muon(params(), lr=0.02)
    qhmuon = QHMuon(params(), lr=0.02, momentum=0.999, nu=0.7)
    return {"Muon": timed(muon.step), "QHMuon": timed(qhmuon.step)}


def optax_steps() -> dict[str, Callable[[], None]]:
    import jax
    import jax.numpy as jnp
    import optax

    import qhoptim.optax as qho

    key = jax.random.PRNGKey(0)
    # optax's layout is (fan_in, fan_out).
    params = {
        f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (fan_in, fan_out))
        for i, (fan_out, fan_in) in enumerate(SHAPES)
    }
    grads = jax.tree.map(lambda x: jnp.cos(x), params)

    def stepper(tx: optax.GradientTransformation) -> Callable[[], None]:
        state = [tx.init(params), params]

        @jax.jit
        def step(state: Any, params: Any) -> Any:
            updates, state = tx.update(grads, state, params)
            return state, optax.apply_updates(params, updates)

        def run() -> None:
            state[0], state[1] = step(state[0], state[1])
            jax.block_until_ready(state[1])

        return run

    return {
        "Muon": stepper(optax.contrib.muon(0.02)),
        "QHMuon": stepper(qho.qhmuon(0.02, beta=0.999, nu=0.7)),
    }


def mlx_steps() -> dict[str, Callable[[], None]]:
    import mlx.core as mx
    import mlx.optimizers as optim

    import qhoptim.mlx as qhmlx

    mx.random.seed(0)
    params = {f"w{i}": mx.random.normal(shape) for i, shape in enumerate(SHAPES)}
    grads = {k: mx.cos(v) for k, v in params.items()}

    def stepper(opt: optim.Optimizer) -> Callable[[], None]:
        state = [dict(params)]
        opt.init(state[0])

        def run() -> None:
            state[0] = opt.apply_gradients(grads, state[0])
            mx.eval(state[0], opt.state)

        return run

    return {
        "Muon": stepper(optim.Muon(0.02)),
        "QHMuon": stepper(qhmlx.QHMuon(0.02, momentum=0.999, nu=0.7)),
    }


def keras_steps() -> dict[str, Callable[[], None]]:
    """Keras on its active backend, each step the way ``model.fit`` applies one:
    ``stateless_apply`` under ``jax.jit``, ``apply`` in a ``tf.function``, or
    ``apply`` eagerly under ``torch.no_grad()``."""
    import keras
    import numpy as np

    import qhoptim.keras as qk

    rng = np.random.default_rng(0)
    # Keras's layout is (fan_in, fan_out).
    values = [
        rng.standard_normal((fan_in, fan_out)).astype("float32") for fan_out, fan_in in SHAPES
    ]
    grads = [keras.ops.convert_to_tensor(np.cos(v)) for v in values]
    backend = keras.backend.backend()

    def stepper(opt: keras.optimizers.Optimizer) -> Callable[[], None]:
        variables = [keras.Variable(v, name=f"w{i}") for i, v in enumerate(values)]
        opt.build(variables)
        if backend == "jax":
            import jax

            apply = jax.jit(opt.stateless_apply)
            state = [[v.value for v in opt.variables], [v.value for v in variables]]

            def run() -> None:
                state[1], state[0] = apply(state[0], grads, state[1])
                jax.block_until_ready(state[1])

            return run
        if backend == "tensorflow":
            import tensorflow as tf

            # The variables are captured, not arguments (tf.function would trace them).
            return tf.function(lambda: opt.apply(grads, variables), jit_compile=False)
        import torch

        def eager() -> None:
            with torch.no_grad():
                opt.apply(grads, variables)

        return eager

    return {
        "Muon": stepper(keras.optimizers.Muon(0.02)),
        "QHMuon": stepper(qk.QHMuon(0.02, momentum=0.999, nu=0.7)),
    }


FRAMEWORKS = {"torch": torch_steps, "optax": optax_steps, "mlx": mlx_steps, "keras": keras_steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.muon_step", description=__doc__)
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="torch only: cpu or cuda")
    args = parser.parse_args(argv)
    if args.framework == "torch" and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False here)")
    steps = torch_steps(args.device) if args.framework == "torch" else FRAMEWORKS[args.framework]()
    medians = _interleaved(steps, args.steps, args.warmup)
    values = sum(a * b for a, b in SHAPES)
    label = args.framework
    if args.framework == "keras":
        import keras

        label = f"keras ({keras.backend.backend()} backend)"
    print(
        f"### {label}: {len(SHAPES)} matrices ({values:,} values), median of "
        f"{args.steps} interleaved steps after {args.warmup}; "
        f"{args.device if args.framework == 'torch' else 'its default device'}, "
        f"{platform.machine()}, {platform.system()}"
    )
    for name, seconds in medians.items():
        print(f"{name:7s} {seconds * 1e3:9.2f} ms")
    print(f"QHMuon / Muon = {medians['QHMuon'] / medians['Muon']:.3f}x (target <= 1.05x)")


if __name__ == "__main__":
    main()
