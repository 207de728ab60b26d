"""Muon against QHMuon at a few (nu, beta), each with its learning rate tuned, at small scale.

    python benchmarks/muon.py                  # the full run, writes to artifacts/muon
    python benchmarks/muon.py --quick          # a smoke run (CI's sweep session)

QHMuon puts QHM's immediate discount nu into Muon (``qhoptim.optax.qhmuon``);
Muon's Nesterov direction is the point nu = beta. This study asks whether
other points -- the paper's rule of thumb (nu, beta) = (0.7, 0.999) among them
-- train better than Muon's own (0.95, 0.95), on a task that runs on two CPU
cores in minutes:

* Data: the bundled 8x8 digits (1,797 images, pixels scaled to [0, 1]); the
  stratified 20% split of ``benchmarks/sweep.py`` is the test set, and 10% of
  the rest is held out for validation.
* Model: a tanh MLP 64-128-128-10 (``benchmarks/sweep.py``'s layers and
  initialization), cross-entropy. Its three weight matrices step by Muon or
  QHMuon, its biases by AdamW (optax's Muon routes every array that is not a
  matrix so, and ``qhmuon`` likewise), with the same learning rate.
* Training: minibatch 128, ``--epochs`` epochs, the learning rate decayed to
  0 on a cosine over the run (``optax.cosine_decay_schedule``; with a constant
  rate Muon's fixed-size orthogonal steps keep the loss at a floor set by the rate).
* Methods: ``optax.contrib.muon`` (Nesterov, beta 0.95: Muon's defaults) and
  ``qhoptim.optax.qhmuon`` at (nu, beta) = (0.7, 0.999), (0.7, 0.95) and
  (0.9, 0.99).
* Tuning: each method's learning rate is the one of ``--lrs`` with the lowest
  final validation loss, mean over the tuning seeds; then every method trains
  on fresh seeds (not the tuning ones), sharing initializations and data orders
  seed by seed, and the final test loss and accuracy are reported as mean and
  standard deviation over those seeds.

All seeds of a (method, learning rate) train at once (``jax.vmap`` over seeds,
``jax.lax.scan`` over an epoch's minibatches). Outputs (``--out``):
``summary.txt`` (what this prints), ``results.json`` (every run's final
metrics and the tuning table).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ from this checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import qhoptim.optax as qho  # noqa: E402
from benchmarks import positive_int  # noqa: E402
from benchmarks.sweep import init_layers, load_digits, logits_fn  # noqa: E402

HIDDEN = (128, 128)
BATCH = 128
LRS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
QUICK_LRS = (0.01, 0.05)
TUNE_SEEDS, EVAL_SEED = 3, 100  # evaluation seeds are EVAL_SEED, EVAL_SEED + 1, ...


Schedule = Callable[[jax.Array], jax.Array]


def _muon(lr: Schedule) -> optax.GradientTransformation:
    return optax.contrib.muon(lr, beta=0.95, nesterov=True)


def _qhmuon(nu: float, beta: float) -> Callable[[Schedule], optax.GradientTransformation]:
    def make(lr: Schedule) -> optax.GradientTransformation:
        return qho.qhmuon(lr, beta=beta, nu=nu)

    return make


BASELINE = "Muon (Nesterov, beta 0.95)"
METHODS: dict[str, Callable[[Schedule], optax.GradientTransformation]] = {
    BASELINE: _muon,
    "QHMuon nu 0.7, beta 0.999": _qhmuon(0.7, 0.999),
    "QHMuon nu 0.7, beta 0.95": _qhmuon(0.7, 0.95),
    "QHMuon nu 0.9, beta 0.99": _qhmuon(0.9, 0.99),
}


# ------------------------------------------------------------------------ data
def load_splits() -> dict[str, tuple[jax.Array, jax.Array]]:
    """Train / validation / test: sweep.py's 20% test split, 10% of the rest for validation."""
    from sklearn.model_selection import train_test_split

    x_rest, x_test, y_rest, y_test = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        x_rest, y_rest, test_size=0.1, random_state=0, stratify=y_rest
    )
    return {
        name: (jnp.asarray(x), jnp.asarray(y))
        for name, (x, y) in {
            "train": (x_train, y_train),
            "val": (x_val, y_val),
            "test": (x_test, y_test),
        }.items()
    }


# ----------------------------------------------------------------------- model
def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits_fn(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def accuracy(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits_fn(params, x), axis=1) == y)


# ---------------------------------------------------------------------- training
def trainer(
    make: Callable[[Schedule], optax.GradientTransformation], epochs: int, data: dict[str, Any]
) -> Callable[[float, list[int]], dict[str, np.ndarray]]:
    """``train(lr, seeds)``: one model per seed at once, trained with ``make``'s
    optimizer under a cosine decay from ``lr``; the final metrics, one per seed.

    Compiled once per method (and per number of seeds): the peak lr is an
    argument of the compiled program, not a constant of it.
    """
    x_train, y_train = data["train"]
    n_batches = x_train.shape[0] // BATCH

    def run(peak_lr: jax.Array, seed: jax.Array) -> dict[str, jax.Array]:
        tx = make(optax.cosine_decay_schedule(peak_lr, epochs * n_batches))
        key = jax.random.PRNGKey(seed)
        key, init_key = jax.random.split(key)
        params = init_layers(init_key, (64, *HIDDEN, 10))
        state = tx.init(params)

        def batch_step(carry: Any, batch: Any) -> Any:
            params, state = carry
            x, y = batch
            grads = jax.grad(loss_fn)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        def epoch(carry: Any, epoch_key: jax.Array) -> Any:
            order = jax.random.permutation(epoch_key, x_train.shape[0])[: n_batches * BATCH]
            xb = x_train[order].reshape(n_batches, BATCH, -1)
            yb = y_train[order].reshape(n_batches, BATCH)
            carry, _ = jax.lax.scan(batch_step, carry, (xb, yb))
            return carry, None

        (params, _), _ = jax.lax.scan(epoch, (params, state), jax.random.split(key, epochs))
        out = {}
        for split in ("train", "val", "test"):
            x, y = data[split]
            out[f"{split}_loss"] = loss_fn(params, x, y)
            out[f"{split}_acc"] = accuracy(params, x, y)
        return out

    compiled = jax.jit(jax.vmap(run, in_axes=(None, 0)))

    def train(lr: float, seeds: list[int]) -> dict[str, np.ndarray]:
        metrics = compiled(jnp.float32(lr), jnp.asarray(seeds))
        return {k: np.asarray(v, dtype=np.float64) for k, v in metrics.items()}

    return train


def _stat(values: np.ndarray) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values))


def study(
    lrs: tuple[float, ...], tune_seeds: list[int], eval_seeds: list[int], epochs: int
) -> dict[str, Any]:
    data = load_splits()
    tuning: dict[str, dict[str, float]] = {}
    results: dict[str, Any] = {}
    for name, make in METHODS.items():
        train = trainer(make, epochs, data)
        tuning[name] = {}
        for lr in lrs:
            val = train(lr, tune_seeds)["val_loss"]
            tuning[name][str(lr)] = float(np.mean(val)) if np.all(np.isfinite(val)) else math.inf
            print(f"  tuning {name:28s} lr {lr:<6g} val loss {tuning[name][str(lr)]:.4f}")
        best = min(lrs, key=lambda lr: tuning[name][str(lr)])
        final = train(best, eval_seeds)
        results[name] = {"lr": best, **{k: v.tolist() for k, v in final.items()}}
    return {"tuning": tuning, "results": results}


def summary(out: dict[str, Any], config: dict[str, Any]) -> str:
    lines = [
        f"digits, MLP 64-{'-'.join(map(str, HIDDEN))}-10 (tanh), minibatch {BATCH}, "
        f"{config['epochs']} epochs, cosine decay of the lr to 0; lr tuned on the "
        f"validation loss over {config['tune_seeds']} seeds from {config['lrs']}; "
        f"test metrics over {config['eval_seeds']} fresh seeds (mean +- sd)",
        "",
        f"{'method':28s} {'lr':>6s} {'test loss':>17s} {'test accuracy':>17s} "
        f"{'train loss':>17s}  test loss - Muon's, seed by seed",
    ]
    baseline = np.asarray(out["results"][BASELINE]["test_loss"])
    for name, r in out["results"].items():
        cells = []
        columns = (("test_loss", 1, ".4f"), ("test_acc", 100, ".2f"), ("train_loss", 1, ".4f"))
        for key, scale, fmt in columns:
            mean, sd = _stat(np.asarray(r[key]) * scale)
            cells.append(f"{mean:{fmt}} +- {sd:{fmt}}".rjust(17))
        paired = np.asarray(r["test_loss"]) - baseline
        mean, sd = _stat(paired)
        lower = int(np.sum(paired < 0))
        versus = (
            "" if name == BASELINE else f"  {mean:+.4f} +- {sd:.4f}, lower on {lower}/{len(paired)}"
        )
        lines.append(f"{name:28s} {r['lr']:>6g} {' '.join(cells)}{versus}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 lrs, 1+1 seeds, 2 epochs")
    parser.add_argument("--epochs", type=positive_int, default=None, help="default 40 (quick: 2)")
    parser.add_argument(
        "--seeds", type=positive_int, default=None, help="evaluation seeds; default 8"
    )
    parser.add_argument("--lrs", type=float, nargs="+", default=None)
    parser.add_argument("--out", type=Path, default=Path("artifacts/muon"))
    args = parser.parse_args(argv)
    epochs = args.epochs or (2 if args.quick else 40)
    lrs = tuple(args.lrs) if args.lrs else (QUICK_LRS if args.quick else LRS)
    tune_seeds = list(range(1 if args.quick else TUNE_SEEDS))
    eval_seeds = list(range(EVAL_SEED, EVAL_SEED + (args.seeds or (1 if args.quick else 8))))

    start = time.perf_counter()
    out = study(lrs, tune_seeds, eval_seeds, epochs)
    wall = time.perf_counter() - start
    config = {
        "epochs": epochs,
        "lrs": list(lrs),
        "tune_seeds": len(tune_seeds),
        "eval_seeds": len(eval_seeds),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "machine": f"{platform.machine()}, {platform.system()}",
    }
    text = summary(out, config)
    print()
    print(text)
    print(f"\nwall time {wall:.0f} s on {config['machine']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.txt").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"config": config, **out}, indent=1))
    failed = [n for n, r in out["results"].items() if not np.all(np.isfinite(r["test_loss"]))]
    if failed:
        print("diverged at their tuned lr: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
