"""The paper's comparison of QHM and Aggregated Momentum (appendix H), at small scale.

    python benchmarks/aggmo.py                 # the full run, writes to artifacts/aggmo
    python benchmarks/aggmo.py --quick         # a smoke run (CI)

Ma & Yarats (2019), App. H, take the best AggMo setting of Lucas et al.'s
autoencoder sweep ("AggMo-Best": discounts [0, 0.9, 0.99, 0.999], lr 0.1), turn
it into a QHM setting by hand ("QHM-Converted": alpha = the effective step size
27.775, rounded to 28, nu = 0.97, beta = 0.999) and report that QHM-Converted
reaches a lower training, validation and test MSE (15 runs). This script
repeats the procedure on a task that ships with scikit-learn:

* Data: the bundled 8x8 digits (1,797 images, pixels scaled to [0, 1]); the
  stratified 20% split of ``benchmarks/sweep.py`` is the test set, and 10% of
  the rest is held out for validation (as the paper does).
* Model, in the spirit of Lucas et al.'s (encoder 784-1000-500-250-30, ReLU
  between layers, a linear code, mirrored decoder, sigmoid output, binary
  cross-entropy): encoder 64-128-16, decoder 16-128-64, the same activations,
  loss and torch's default initialization. (Deeper variants such as
  64-128-64-16 mostly stayed on the mean-image plateau within this budget.)
  The reported metric is Lucas et al.'s MSE: squared error summed over the 64
  pixels, averaged over images.
* Schedule: minibatch 64, 300 epochs, learning rate divided by 10 at 20%, 40%
  and 80% of training (Lucas et al.: epochs 200, 400 and 800 of 1000).
* Step 1, "AggMo-Best": sweep AggMo over Lucas et al.'s discount sets
  [0, 0.9], [0, 0.9, 0.99], [0, 0.9, 0.99, 0.999] and a grid of learning
  rates; the best setting by mean final validation MSE over the sweep seeds.
* Step 2, "QHM-Converted": alpha = ``qhoptim.convert.aggmo_effective_lr`` of
  AggMo-Best (not rounded), nu = 0.97, beta = 0.999, as the paper chose them.
  Both then train on fresh seeds (not the sweep's), sharing initializations and
  data orders seed by seed.

AggMo is ``conformance.sources.AggMo`` -- the naive AggMo of the recovery
suite, written from the appendix -- applied to the flattened parameters; QHM is
``qhoptim.optax.qhm``. All runs of a step train at once (``jax.vmap`` over
settings and seeds, ``jax.lax.scan`` over an epoch's minibatches).

Outputs (``--out``): ``summary.txt`` (what this prints), ``sweep.csv`` (step 1,
every setting), ``results.json`` (step 2: final metrics per seed, per-epoch
curves), ``curves.png`` (step 2: mean +- std bands).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # conformance/ and benchmarks/ from this checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import qhoptim.optax as qho  # noqa: E402
from benchmarks import positive_int  # noqa: E402
from benchmarks.sweep import _progress, init_layers, load_digits  # noqa: E402
from conformance.sources import AggMo  # noqa: E402
from qhoptim.convert import aggmo_effective_lr  # noqa: E402

# Lucas et al.'s discount sets: betas = [1 - a**i for i < K] with a = 0.1, K = 2, 3, 4.
DISCOUNT_SETS = ((0.0, 0.9), (0.0, 0.9, 0.99), (0.0, 0.9, 0.99, 0.999))
AGGMO_LRS = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
QUICK_SETS, QUICK_LRS = DISCOUNT_SETS[-1:], (0.3, 1.0)
QHM_NU, QHM_BETA = 0.97, 0.999  # the paper's hand-picked QHM-Converted nu and beta
HIDDEN = (128, 16)  # encoder widths; the last is the code
BATCH = 64
DECAY_AT = (0.2, 0.4, 0.8)  # fractions of training (Lucas et al.: 200, 400, 800 of 1000)
EVAL_SEED = 100  # step 2 uses seeds EVAL_SEED, EVAL_SEED + 1, ...
METRICS = ("train_mse", "val_mse", "test_mse")
PAPER = {  # Ma & Yarats (2019), App. H, Table: EMNIST autoencoders, 15 runs
    "AggMo-Best": (2.0823, 0.0312, 2.2895, 0.0236, 2.2827, 0.0247),
    "QHM-Converted": (1.7330, 0.0102, 2.0921, 0.0078, 2.0851, 0.0071),
}


# ------------------------------------------------------------------------ data


def load_splits() -> dict[str, jax.Array]:
    """Train / validation / test: sweep.py's 20% test split, 10% of the rest for validation."""
    from sklearn.model_selection import train_test_split

    x_rest, x_test, y_rest, _ = load_digits()
    x_train, x_val = train_test_split(x_rest, test_size=0.1, random_state=0, stratify=y_rest)
    return {"train": jnp.asarray(x_train), "val": jnp.asarray(x_val), "test": jnp.asarray(x_test)}


# ----------------------------------------------------------------------- model


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
    # Encoder 64 -> HIDDEN, mirrored decoder back to 64.
    return init_layers(key, (64, *HIDDEN, *HIDDEN[-2::-1], 64))


_, UNRAVEL = ravel_pytree(init_params(jax.random.PRNGKey(0)))


def logits_fn(flat: jax.Array, x: jax.Array) -> jax.Array:
    # ReLU after every layer but the code (Lucas et al.'s encoder ends in a linear layer) and
    # the output; sigmoid(logits) is the reconstruction.
    layers = UNRAVEL(flat)
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i != len(HIDDEN) - 1 and i != len(layers) - 1:
            x = jax.nn.relu(x)
    return x


def bce(flat: jax.Array, x: jax.Array) -> jax.Array:
    """Lucas et al.'s training loss: binary cross-entropy, mean over images and pixels."""
    z = logits_fn(flat, x)
    return jnp.mean(jnp.logaddexp(0.0, z) - x * z)  # = BCE(sigmoid(z), x), stably


def mse(flat: jax.Array, x: jax.Array) -> jax.Array:
    """Lucas et al.'s metric: squared error summed over pixels, averaged over images."""
    return jnp.sum(jnp.mean((jax.nn.sigmoid(logits_fn(flat, x)) - x) ** 2, axis=0))


# ------------------------------------------------------------------- optimizers


@dataclass(frozen=True)
class OptaxQHM:
    """``qhoptim.optax.qhm`` behind the protocol of ``conformance.sources`` (init/point/update)."""

    lr: Any
    nu: Any
    momentum: Any

    def _tx(self) -> optax.GradientTransformation:
        return qho.qhm(self.lr, momentum=self.momentum, nu=self.nu)

    def init(self, x0: jax.Array) -> dict[str, Any]:
        return {"x": x0, "opt": self._tx().init(x0)}

    def point(self, s: dict[str, Any]) -> jax.Array:
        return s["x"]

    def update(self, s: dict[str, Any], g: jax.Array) -> dict[str, Any]:
        updates, opt = self._tx().update(g, s["opt"], s["x"])
        return {"x": optax.apply_updates(s["x"], updates), "opt": opt}


# An optimizer family: hyperparameters (traced scalars) and the lr multiplier -> optimizer.
Family = Callable[[dict[str, jax.Array], jax.Array], Any]


def aggmo_family(betas: tuple[float, ...]) -> Family:
    return lambda hp, scale: AggMo(hp["lr"] * scale, betas)


def qhm_family(hp: dict[str, jax.Array], scale: jax.Array) -> Any:
    return OptaxQHM(hp["lr"] * scale, hp["nu"], hp["beta"])


def lr_scale(epoch: int, epochs: int) -> float:
    return 0.1 ** sum(epoch >= round(f * epochs) for f in DECAY_AT)


# ---------------------------------------------------------------------- training


def train(
    family: Family,
    hparams: dict[str, np.ndarray],
    seeds: list[int],
    epochs: int,
    data: dict[str, jax.Array],
    label: str,
) -> np.ndarray:
    """Train every setting x seed; per-epoch metrics of shape (settings, seeds, epochs, 3)."""
    x_tr = data["train"]
    steps = len(x_tr) // BATCH

    def init_one(hp: dict[str, jax.Array], key: jax.Array) -> Any:
        x0, _ = ravel_pytree(init_params(key))
        return family(hp, jnp.float32(1.0)).init(x0)

    def epoch_one(hp: dict[str, jax.Array], scale: jax.Array, state: Any, idx: jax.Array) -> Any:
        opt = family(hp, scale)

        def step(s: Any, batch: jax.Array) -> tuple[Any, None]:
            return opt.update(s, jax.grad(bce)(opt.point(s), x_tr[batch])), None

        state, _ = jax.lax.scan(step, state, idx)
        x = opt.point(state)
        return state, jnp.stack([mse(x, data[split]) for split in ("train", "val", "test")])

    # vmap over settings (hp, state) outside, seeds (key / state, idx) inside.
    init_all = jax.jit(jax.vmap(jax.vmap(init_one, in_axes=(None, 0)), in_axes=(0, None)))
    epoch_all = jax.jit(
        jax.vmap(
            jax.vmap(epoch_one, in_axes=(None, None, 0, 0)),
            in_axes=(0, None, 0, None),
        )
    )
    hp = {k: jnp.asarray(v, dtype=jnp.float32) for k, v in hparams.items()}
    keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
    state = init_all(hp, keys)
    rngs = [np.random.default_rng(s) for s in seeds]
    history = []
    t0 = time.perf_counter()
    for e in range(epochs):
        idx = np.stack(
            [r.permutation(len(x_tr))[: steps * BATCH].reshape(steps, BATCH) for r in rngs]
        )
        scale = jnp.float32(lr_scale(e, epochs))
        state, metrics = epoch_all(hp, scale, state, jnp.asarray(idx))
        history.append(np.asarray(metrics))
        _progress(label, e + 1, epochs, time.perf_counter() - t0)
    return np.stack(history, axis=2)


def _final(metrics: np.ndarray) -> np.ndarray:
    """Final-epoch metrics, NaN (diverged) as inf."""
    out = metrics[..., -1, :].astype(np.float64)
    return np.where(np.isfinite(out), out, np.inf)


# ---------------------------------------------------------------------- the study


def sweep_aggmo(
    sets: tuple[tuple[float, ...], ...],
    lrs: tuple[float, ...],
    seeds: list[int],
    epochs: int,
    data: dict[str, jax.Array],
) -> list[dict[str, Any]]:
    rows = []
    for betas in sets:
        metrics = train(
            aggmo_family(betas),
            {"lr": np.array(lrs)},
            seeds,
            epochs,
            data,
            f"sweep K={len(betas)}",
        )
        final = _final(metrics)  # (lrs, seeds, 3)
        for i, lr in enumerate(lrs):
            row: dict[str, Any] = {"betas": list(betas), "lr": lr}
            for j, name in enumerate(METRICS):
                with np.errstate(invalid="ignore"):  # std of inf (diverged) is nan
                    row[f"{name}_mean"] = float(np.mean(final[i, :, j]))
                    row[f"{name}_std"] = float(np.std(final[i, :, j]))
            rows.append(row)
    return rows


def compare(
    best: dict[str, Any], seeds: list[int], epochs: int, data: dict[str, jax.Array]
) -> dict[str, Any]:
    betas = tuple(best["betas"])
    alpha = aggmo_effective_lr(best["lr"], betas)
    runs = {
        "AggMo-Best": (
            aggmo_family(betas),
            {"lr": np.array([best["lr"]])},
            {"lr": best["lr"], "betas": list(betas)},
        ),
        "QHM-Converted": (
            qhm_family,
            {"lr": np.array([alpha]), "nu": np.array([QHM_NU]), "beta": np.array([QHM_BETA])},
            {"lr": alpha, "nu": QHM_NU, "beta": QHM_BETA},
        ),
    }
    out: dict[str, Any] = {}
    for name, (family, hp, setting) in runs.items():
        metrics = train(family, hp, seeds, epochs, data, name)[0]  # (seeds, epochs, 3)
        final = _final(metrics[None])[0]  # (seeds, 3)
        out[name] = {
            "setting": setting,
            "final": {m: final[:, j].tolist() for j, m in enumerate(METRICS)},
            "curves": {
                m: {
                    "mean": np.mean(metrics[..., j], axis=0).tolist(),
                    "std": np.std(metrics[..., j], axis=0).tolist(),
                }
                for j, m in enumerate(METRICS)
            },
        }
    return out


def _pm(values: list[float]) -> str:
    a = np.asarray(values)
    return f"{np.mean(a):.4f} ±{np.std(a):.4f}"


def report(
    sweep_rows: list[dict[str, Any]],
    best: dict[str, Any],
    results: dict[str, Any],
    config: dict[str, Any],
) -> str:
    lines = [
        f"$ {config['command']}",
        f"wall time {config['wall_s']:.0f} s on {config['machine']}",
        "",
        f"{config['sweep_settings']} AggMo settings x {config['sweep_seeds']} seeds (step 1), "
        f"then 2 settings x {config['seeds']} fresh seeds (step 2); {config['epochs']} epochs "
        f"of {config['steps_per_epoch']} steps; jax {jax.__version__}",
        "",
        "Step 1, AggMo sweep: final MSE, mean ± std over the sweep seeds",
        f"{'betas':<26}{'lr':>7}{'train MSE':>20}{'val MSE':>20}",
    ]
    for r in sweep_rows:
        mark = "  <- AggMo-Best" if r is best else ""
        lines.append(
            f"{r['betas']!s:<26}{r['lr']:>7g}"
            f"{r['train_mse_mean']:>11.4f} ±{r['train_mse_std']:.4f}"
            f"{r['val_mse_mean']:>11.4f} ±{r['val_mse_std']:.4f}{mark}"
        )
    lrs = sorted({r["lr"] for r in sweep_rows})
    for betas in {tuple(r["betas"]) for r in sweep_rows}:
        rows = [r for r in sweep_rows if tuple(r["betas"]) == betas]
        top = min(rows, key=lambda r: r["val_mse_mean"])
        if len(lrs) > 1 and top["lr"] in (lrs[0], lrs[-1]):
            lines.append(f"(the best lr for betas {list(betas)} is at the edge of the grid)")
    lines += [
        "",
        f"Step 2: final MSE over {config['seeds']} seeds (mean ± std), lower is better",
        f"{'optimizer':<15}{'setting':<40}{'train MSE':>18}{'val MSE':>18}{'test MSE':>18}",
    ]
    for name, res in results.items():
        s = res["setting"]
        if "betas" in s:
            setting = f"lr={s['lr']:g}, betas={s['betas']}"
        else:
            setting = f"lr={s['lr']:.6g}, nu={s['nu']:g}, beta={s['beta']:g}"
        lines.append(
            f"{name:<15}{setting:<40}" + "".join(f"{_pm(res['final'][m]):>18}" for m in METRICS)
        )
    a, q = (results[n]["final"] for n in ("AggMo-Best", "QHM-Converted"))
    wins = {m: sum(qv < av for qv, av in zip(q[m], a[m], strict=True)) for m in METRICS}
    diff = {m: np.subtract(q[m], a[m]) for m in METRICS}
    lines += [
        "",
        "QHM-Converted minus AggMo-Best, seed by seed (same init and data order), "
        "mean ± std: "
        + ", ".join(
            f"{m.split('_')[0]} {np.mean(diff[m]):+.4f} ±{np.std(diff[m]):.4f}" for m in METRICS
        ),
        "QHM-Converted lower on: "
        + ", ".join(f"{m.split('_')[0]} {wins[m]}/{config['seeds']} seeds" for m in METRICS),
        "",
        "The paper (EMNIST, 784 pixels, 15 runs): AggMo-Best train/val/test "
        "{:.4f} ±{:.4f} / {:.4f} ±{:.4f} / {:.4f} ±{:.4f};".format(*PAPER["AggMo-Best"]),
        "QHM-Converted {:.4f} ±{:.4f} / {:.4f} ±{:.4f} / {:.4f} ±{:.4f}.".format(
            *PAPER["QHM-Converted"]
        ),
    ]
    return "\n".join(lines)


def plot(out: Path, results: dict[str, Any], quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"train_mse": "training MSE", "val_mse": "validation MSE"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, (metric, title) in zip(axes, titles.items(), strict=True):
        for name, res in results.items():
            c = res["curves"][metric]
            mean, std = np.array(c["mean"]), np.array(c["std"])
            epochs = np.arange(1, len(mean) + 1)
            s = res["setting"]
            if "betas" in s:
                label = f"{name}: lr {s['lr']:g}, betas {s['betas']}"
            else:
                label = f"{name}: lr {s['lr']:.4g}, ν {s['nu']:g}, β {s['beta']:g}"
            ax.plot(epochs, mean, label=label)
            ax.fill_between(epochs, mean - std, mean + std, alpha=0.25)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel("MSE (squared error summed over pixels)")
        ax.set_title(title)
        ax.legend(fontsize=9)
    n = len(next(iter(results.values()))["final"]["val_mse"])
    fig.suptitle(f"digits autoencoder: mean ± std over {n} seeds{' (quick run)' if quick else ''}")
    fig.savefig(out / "curves.png", dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one discount set, 2 lrs, 1 seed, 3 epochs"
    )
    parser.add_argument("--epochs", type=positive_int, default=None, help="default 300 (quick: 3)")
    parser.add_argument("--sweep-seeds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--seeds", type=positive_int, default=None, help="step 2; default 15 (quick: 1)"
    )
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=None, help="AggMo's lr grid (step 1)"
    )
    parser.add_argument(
        "--discounts",
        type=int,
        nargs="+",
        choices=(2, 3, 4),
        default=None,
        help="sweep only these discount sets, by K (4: the paper's [0, 0.9, 0.99, 0.999])",
    )
    parser.add_argument("--out", type=Path, default=Path("artifacts/aggmo"))
    args = parser.parse_args(argv)
    epochs = args.epochs or (3 if args.quick else 300)
    sweep_seeds = list(range(args.sweep_seeds or (1 if args.quick else 3)))
    n_eval = args.seeds or (1 if args.quick else 15)
    seeds = list(range(EVAL_SEED, EVAL_SEED + n_eval))
    sets, lrs = (QUICK_SETS, QUICK_LRS) if args.quick else (DISCOUNT_SETS, AGGMO_LRS)
    lrs = tuple(args.lrs) if args.lrs else lrs
    if args.discounts:
        sets = tuple(b for b in DISCOUNT_SETS if len(b) in args.discounts)

    data = load_splits()
    t0 = time.perf_counter()
    sweep_rows = sweep_aggmo(sets, lrs, sweep_seeds, epochs, data)
    best = min(sweep_rows, key=lambda r: r["val_mse_mean"])
    if not math.isfinite(best["val_mse_mean"]):
        print("every AggMo setting diverged", file=sys.stderr)
        return 1
    results = compare(best, seeds, epochs, data)
    wall = time.perf_counter() - t0

    config = {
        "epochs": epochs,
        "steps_per_epoch": len(data["train"]) // BATCH,
        "batch": BATCH,
        "sweep_settings": len(sweep_rows),
        "sweep_seeds": len(sweep_seeds),
        "seeds": n_eval,
        "splits": {k: int(v.shape[0]) for k, v in data.items()},
        "quick": args.quick,
        "wall_s": round(wall, 1),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs "
        f"({jax.default_backend()})",
        "command": " ".join(["python benchmarks/aggmo.py", *(argv or sys.argv[1:])]),
    }
    text = report(sweep_rows, best, results, config)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.txt").write_text(text + "\n")
    with open(args.out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(sweep_rows[0]))
        writer.writeheader()
        writer.writerows({**r, "betas": " ".join(map(str, r["betas"]))} for r in sweep_rows)
    payload = {"config": config, "aggmo_best": best, "results": results}
    (args.out / "results.json").write_text(json.dumps(payload, indent=1))
    plot(args.out, results, args.quick)
    print(f"\nwall time {wall:.0f} s; outputs in {args.out}/\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
