"""The paper's parameter sweeps (section 5.1, appendix H), at small scale.

    python benchmarks/sweep.py                 # the full sweep, writes to artifacts/sweep
    python benchmarks/sweep.py --quick         # a smoke run (CI)
    python benchmarks/sweep.py --epochs 90     # the paper's length

Models: multinomial logistic regression and the paper's MLP (tanh 200-100-50,
softmax), cross-entropy plus L2 with coefficient 1/2 * 1e-4, minibatch 64.
Data: scikit-learn's bundled 8x8 digits (1,797 images, no download) with a
stratified 20% validation split -- a smaller stand-in for EMNIST digits.

Optimizers (``qhoptim.optax``), over the paper's full grid of
nu (15 values) x beta (14 values), 3 seeds each:

* QHM: alpha = 1, linear warm-up over the first epoch, decayed 10x at 1/3 and
  2/3 of training. The grid contains plain SGD (nu = 0), normalized momentum
  (nu = 1) and NAG (nu = beta).
* QHAdam: alpha = 1e-3 (same warm-up), eps = 1e-8, nu2 = 1, beta2 = 0.999,
  sweeping nu1 x beta1; nu1 = 1 is Adam.

All grid points and seeds train at once: the training step is ``jax.vmap``-ed
over hyperparameters (traced, as ``optax.inject_hyperparams`` would pass them)
and seeds, and ``jax.lax.scan``-ed over an epoch's minibatches. Seeds share
data order and initialization across hyperparameters (common random numbers).

Outputs (``--out``): ``results.csv`` / ``results.json`` (final metrics per grid
point, mean and std over seeds), ``curves.json`` (per-epoch curves of the
reference settings), ``heatmaps-<model>.png`` and ``curves-<model>.png``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import qhoptim.optax as qho

GRID_NU = (0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999, 0.9995, 1)
GRID_BETA = GRID_NU[:-1]
QUICK_NU, QUICK_BETA = (0.0, 0.7, 1.0), (0.0, 0.9, 0.999)
MODELS = {"logistic": (), "mlp": (200, 100, 50)}
OPTIMIZERS = ("qhm", "qhadam")
L2 = 0.5e-4
BATCH = 64
DEFAULT = (0.7, 0.999)  # the paper's QH default (nu, beta)


# ------------------------------------------------------------------------ data


def load_digits(seed: int = 0) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    x, y = _load(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return tuple(train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y))


# ----------------------------------------------------------------------- model


def init_params(key: jax.Array, hidden: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    return init_layers(key, (64, *hidden, 10))


def init_layers(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    """Dense layers ``sizes[i] -> sizes[i + 1]``, initialized as torch.nn.Linear."""
    # torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for W and b.
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        key, kw, kb = jax.random.split(key, 3)
        bound = 1.0 / math.sqrt(fan_in)
        w = jax.random.uniform(kw, (fan_in, fan_out), minval=-bound, maxval=bound)
        b = jax.random.uniform(kb, (fan_out,), minval=-bound, maxval=bound)
        params.append({"w": w, "b": b})
    return params


def logits_fn(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def objective(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits_fn(params, x))
    ce = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    return ce + L2 * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))


def error_rate(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits_fn(params, x), axis=1) != y)


# ------------------------------------------------------------------- optimizers


def schedule(opt: str, steps_per_epoch: int, epochs: int) -> Callable[[jax.Array], jax.Array]:
    base = 1.0 if opt == "qhm" else 1e-3
    warmup = optax.linear_schedule(0.0, base, steps_per_epoch)
    if opt == "qhadam":
        after: Any = optax.constant_schedule(base)
    else:
        third = epochs * steps_per_epoch // 3
        after = optax.piecewise_constant_schedule(base, {third: 0.1, 2 * third: 0.1})
    return optax.join_schedules([warmup, lambda n: after(n + steps_per_epoch)], [steps_per_epoch])


def make_tx(opt: str, nu: jax.Array, beta: jax.Array, lr: Any) -> optax.GradientTransformation:
    if opt == "qhm":
        return qho.qhm(lr, momentum=beta, nu=nu)
    return qho.qhadam(lr, b1=beta, b2=0.999, nu1=nu, nu2=1.0, eps=1e-8)


# ------------------------------------------------------------------------ sweep


def run_sweep(
    model: str, opt: str, nus: np.ndarray, betas: np.ndarray, seeds: int, epochs: int
) -> dict[str, np.ndarray]:
    """Train every (nu, beta) x seed; return per-epoch metrics of shape (seeds, runs, epochs)."""
    x_tr, x_va, y_tr, y_va = (jnp.asarray(a) for a in load_digits())
    steps = len(x_tr) // BATCH
    lr = schedule(opt, steps, epochs)
    hidden = MODELS[model]

    def init_one(nu: jax.Array, beta: jax.Array, key: jax.Array) -> Any:
        params = init_params(key, hidden)
        return params, make_tx(opt, nu, beta, lr).init(params)

    def epoch_one(nu: jax.Array, beta: jax.Array, carry: Any, idx: jax.Array) -> Any:
        tx = make_tx(opt, nu, beta, lr)

        def step(c: Any, batch: jax.Array) -> tuple[Any, None]:
            params, state = c
            grads = jax.grad(objective)(params, x_tr[batch], y_tr[batch])
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        carry, _ = jax.lax.scan(step, carry, idx)
        params = carry[0]
        metrics = jnp.stack(
            [
                objective(params, x_tr, y_tr),
                error_rate(params, x_tr, y_tr),
                error_rate(params, x_va, y_va),
            ]
        )
        return carry, metrics

    # vmap over the grid (nu, beta, carry) inside, over seeds (carry, idx) outside.
    init_all = jax.jit(jax.vmap(jax.vmap(init_one, in_axes=(0, 0, None)), in_axes=(None, None, 0)))
    epoch_all = jax.jit(
        jax.vmap(jax.vmap(epoch_one, in_axes=(0, 0, 0, None)), in_axes=(None, None, 0, 0))
    )
    keys = jax.random.split(jax.random.PRNGKey(20190101), seeds)
    carry = init_all(jnp.asarray(nus), jnp.asarray(betas), keys)
    rngs = [np.random.default_rng(s) for s in range(seeds)]
    history = []
    t0 = time.perf_counter()
    for e in range(epochs):
        idx = np.stack(
            [r.permutation(len(x_tr))[: steps * BATCH].reshape(steps, BATCH) for r in rngs]
        )
        carry, metrics = epoch_all(jnp.asarray(nus), jnp.asarray(betas), carry, jnp.asarray(idx))
        history.append(np.asarray(metrics))
        _progress(f"{model}/{opt}", e + 1, epochs, time.perf_counter() - t0)
    out = np.stack(history, axis=2)  # (seeds, runs, epochs, 3)
    return {"train_loss": out[..., 0], "train_error": out[..., 1], "val_error": out[..., 2]}


def _progress(label: str, done: int, total: int, elapsed: float) -> None:
    width = 30
    bar = "#" * (width * done // total) + "." * (width - width * done // total)
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r{label:<16} [{bar}] {done}/{total} epochs  {elapsed:6.1f}s{end}")
    sys.stderr.flush()


# ---------------------------------------------------------------------- analysis


def summarize(
    pairs: list[tuple[float, float]], metrics: dict[str, np.ndarray]
) -> list[dict[str, Any]]:
    """Final-epoch mean and std over seeds per grid point (NaN: diverged)."""
    rows = []
    for i, (nu, beta) in enumerate(pairs):
        row: dict[str, Any] = {"nu": float(nu), "beta": float(beta)}
        for name, m in metrics.items():
            final = m[:, i, -1]
            row[f"{name}_mean"] = float(np.mean(final))
            row[f"{name}_std"] = float(np.std(final))
        rows.append(row)
    return rows


def reference_settings(opt: str, rows: list[dict[str, Any]], metric: str) -> dict[str, int]:
    """Indices of the named settings, the best ones chosen by ``metric`` (lower is better)."""

    def best(pred: Callable[[dict[str, Any]], bool]) -> int:
        cands = [
            (r[f"{metric}_mean"], i)
            for i, r in enumerate(rows)
            if pred(r) and math.isfinite(r[f"{metric}_mean"])
        ]
        return min(cands)[1]

    def at(nu: float, beta: float) -> int:
        return next(i for i, r in enumerate(rows) if r["nu"] == nu and r["beta"] == beta)

    vanilla = "Adam" if opt == "qhadam" else "momentum"
    out = {
        f"best {vanilla}": best(lambda r: r["nu"] == 1),
        "QH default (0.7, 0.999)": at(*DEFAULT),
        "best QH": best(lambda r: True),
    }
    if opt == "qhm":
        out = {
            "plain SGD": at(0.0, 0.0),
            "best NAG": best(lambda r: r["nu"] == r["beta"]),
            **out,
        }
    return out


def write_outputs(out: Path, results: dict[str, Any], quick: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    flat = []
    for (model, opt), res in results.items():
        for row in res["rows"]:
            flat.append({"model": model, "optimizer": opt, **row})
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    (out / "results.json").write_text(json.dumps(flat, indent=1))
    curves = {
        f"{model}/{opt}/{metric}": {
            name: {
                "nu": res["rows"][i]["nu"],
                "beta": res["rows"][i]["beta"],
                "mean": np.mean(res["metrics"][metric][:, i], axis=0).tolist(),
                "std": np.std(res["metrics"][metric][:, i], axis=0).tolist(),
            }
            for name, i in reference_settings(opt, res["rows"], metric).items()
        }
        for (model, opt), res in results.items()
        for metric in ("train_loss", "val_error")
    }
    (out / "curves.json").write_text(json.dumps(curves, indent=1))
    _plot(out, results, curves, quick)


def _plot(out: Path, results: dict[str, Any], curves: dict[str, Any], quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for model in MODELS:
        fig, axes = plt.subplots(2, 2, figsize=(12, 10), constrained_layout=True)
        for col, opt in enumerate(OPTIMIZERS):
            res = results[(model, opt)]
            nus, betas = sorted(set(res["nus"])), sorted(set(res["betas"]))
            for row, metric in enumerate(("train_loss", "val_error")):
                grid = np.full((len(nus), len(betas)), np.nan)
                for r in res["rows"]:
                    grid[nus.index(r["nu"]), betas.index(r["beta"])] = r[f"{metric}_mean"]
                ax = axes[row, col]
                shown = np.log10(grid) if metric == "train_loss" else grid
                im = ax.imshow(shown, origin="lower", cmap="viridis_r", aspect="auto")
                ax.set_xticks(range(len(betas)), [f"{b:g}" for b in betas], rotation=90)
                ax.set_yticks(range(len(nus)), [f"{n:g}" for n in nus])
                sym = ("ν", "β") if opt == "qhm" else ("ν₁", "β₁")
                ax.set_xlabel(sym[1])
                ax.set_ylabel(sym[0])
                label = "log10 final train loss" if metric == "train_loss" else "final val error"
                ax.set_title(f"{model} / {opt}: {label}")
                fig.colorbar(im, ax=ax)
                if DEFAULT[0] in nus and DEFAULT[1] in betas:
                    ax.plot(betas.index(DEFAULT[1]), nus.index(DEFAULT[0]), "r*", ms=12)
        fig.suptitle(f"digits, {model}: mean over seeds (red star: QH default; blank: diverged)")
        fig.savefig(out / f"heatmaps-{model}.png", dpi=80)
        plt.close(fig)

        fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
        for col, opt in enumerate(OPTIMIZERS):
            for row, metric in enumerate(("train_loss", "val_error")):
                ax = axes[row, col]
                for name, c in curves[f"{model}/{opt}/{metric}"].items():
                    mean, std = np.array(c["mean"]), np.array(c["std"])
                    epochs = np.arange(1, len(mean) + 1)
                    label = f"{name}: ν={c['nu']:g}, β={c['beta']:g}"
                    ax.plot(epochs, mean, label=label)
                    ax.fill_between(epochs, mean - std, mean + std, alpha=0.2)
                ax.set_yscale("log")
                ax.set_xlabel("epoch")
                ax.set_title(f"{model} / {opt}: {metric.replace('_', ' ')}")
                ax.legend(fontsize=8)
        fig.suptitle(f"digits, {model}: mean ± std over seeds{' (quick run)' if quick else ''}")
        fig.savefig(out / f"curves-{model}.png", dpi=80)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3x3 grid, 1 seed, 3 epochs")
    parser.add_argument("--epochs", type=int, default=None, help="default 30 (quick: 3)")
    parser.add_argument("--seeds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/sweep"))
    args = parser.parse_args(argv)
    for name in ("epochs", "seeds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1; received {getattr(args, name)}")
    epochs = args.epochs or (3 if args.quick else 30)
    seeds = args.seeds or (1 if args.quick else 3)
    grid_nu, grid_beta = (QUICK_NU, QUICK_BETA) if args.quick else (GRID_NU, GRID_BETA)
    pairs = [(float(n), float(b)) for n in grid_nu for b in grid_beta]
    nus = np.array([n for n, _ in pairs], dtype=np.float32)
    betas = np.array([b for _, b in pairs], dtype=np.float32)
    print(f"{len(nus)} grid points x {seeds} seeds x {epochs} epochs, jax {jax.__version__}")
    t0 = time.perf_counter()
    results = {}
    for model in MODELS:
        for opt in OPTIMIZERS:
            metrics = run_sweep(model, opt, nus, betas, seeds, epochs)
            rows = summarize(pairs, metrics)
            results[(model, opt)] = {
                "rows": rows,
                "metrics": metrics,
                "nus": [r["nu"] for r in rows],
                "betas": [r["beta"] for r in rows],
            }
    wall = time.perf_counter() - t0
    write_outputs(args.out, results, args.quick)
    print(f"\nwall time {wall:.0f} s; outputs in {args.out}/")
    _print_table(results)
    return 0


def _print_table(results: dict[str, Any]) -> None:
    print(
        f"\n{'model':<9}{'optimizer':<8}{'setting':<26}{'ν':>8}{'β':>8}"
        f"{'train loss':>16}{'val error %':>16}"
    )
    for (model, opt), res in results.items():
        rows = res["rows"]
        for name, i in reference_settings(opt, rows, "val_error").items():
            r = rows[i]
            print(
                f"{model:<9}{opt:<8}{name:<26}{r['nu']:>8g}{r['beta']:>8g}"
                f"{r['train_loss_mean']:>9.4f} ±{r['train_loss_std']:.4f}"
                f"{100 * r['val_error_mean']:>9.2f} ±{100 * r['val_error_std']:.2f}"
            )


if __name__ == "__main__":
    sys.exit(main())
