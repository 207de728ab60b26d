"""Figures of the documentation site, computed from the code at build time.

    python docs/_ext/figures.py analysis OUTDIR      # qhoptim.analysis figures
    python docs/_ext/figures.py trajectories OUTDIR RUNSDIR  # one case, every backend
    python docs/_ext/figures.py benchmarks OUTDIR BENCHDIR   # each recorded benchmark's ratios

Run by ``docs/_ext/qhdocs.py`` in subprocesses. The trajectories come from the
``trajectory-*.npz`` files that ``conformance_job.py`` saved in RUNSDIR (each
backend's adapter ran the case in its own process). Writes SVG files and, for
the trajectories, a JSON sidecar with the plotted backends' deviations.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# The case drawn on the conformance page: Adam (QHAdam with nus = (1, 1)) on
# the chained Rosenbrock function, 300 steps.
TRAJECTORY_CASE = "qhadam-adam-rosenbrock"

PURPLE, ORANGE, TEAL, GREY = "#5b3cc4", "#e66100", "#1a9c8c", "#6b6b6b"
# The settings of the "bound against nu2" figure and table (docs/analysis.md).
NU2_NU1S, NU2_BETA2S = (1.0, 0.9, 0.8, 0.7), (0.98, 0.999)

plt.rcParams.update(
    {
        "figure.dpi": 100,
        "font.size": 10,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "grid.alpha": 0.25,
        "svg.hashsalt": "qhoptim-docs",  # reproducible SVG ids
        "svg.fonttype": "none",
    }
)


def _save(fig: plt.Figure, path: Path) -> None:
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


# ------------------------------------------------------------------ analysis
def analysis(out: Path) -> None:
    from qhoptim import analysis as an

    # The paper's figure (App. G): the limit bound vs nu2 at nu1 = 0.8,
    # beta1 = 0.95, beta2 = 0.98 (the WMT16 EN-DE QHAdam setting but nu2).
    nu1, b1, b2 = 0.8, 0.95, 0.98
    nu2 = np.linspace(0.02, 1.0, 491)
    limit = [an.qhadam_update_bound(nu1, b1, float(v), b2) for v in nu2]
    t10 = [an.qhadam_update_bound(nu1, b1, float(v), b2, t=10) for v in nu2]
    star, best = an.qhadam_bound_optimal_nu2(nu1, b1, b2)
    at_one = an.qhadam_update_bound(nu1, b1, 1.0, b2)
    at_paper = an.qhadam_update_bound(nu1, b1, 0.7, b2)
    adam = an.adam_update_bound(b1, b2)

    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    ax.plot(nu2, limit, color=PURPLE, lw=2.2, label=r"QHAdam bound, $t \to \infty$")
    ax.plot(nu2, t10, color=PURPLE, lw=1.2, ls=":", label=r"QHAdam bound, $t = 10$")
    ax.axhline(
        adam,
        color=GREY,
        ls="--",
        lw=1.2,
        label=rf"Adam with the same $\beta_1, \beta_2$: {adam:.2f}",
    )
    ax.plot([star], [best], "o", color=ORANGE, ms=7, zorder=5)
    ax.annotate(
        rf"minimum {best:.3f} at $\nu_2 = {star:.3f}$",
        (star, best),
        xytext=(star - 0.46, best + 2.3),
        arrowprops={"arrowstyle": "->", "color": ORANGE},
        color=ORANGE,
    )
    ax.plot([1.0], [at_one], "s", color=PURPLE, ms=6, zorder=5)
    ax.annotate(
        rf"$\nu_2 = 1$: {at_one:.3f}",
        (1.0, at_one),
        xytext=(0.9, at_one + 1.0),
        arrowprops={"arrowstyle": "->", "color": PURPLE},
        color=PURPLE,
    )
    ax.plot([0.7], [at_paper], "D", color=TEAL, ms=6, zorder=5)
    ax.annotate(
        rf"paper's NMT run, $\nu_2 = 0.7$: {at_paper:.3f}",
        (0.7, at_paper),
        xytext=(0.17, at_paper + 1.35),
        arrowprops={"arrowstyle": "->", "color": TEAL},
        color=TEAL,
    )
    ax.set_ylim(0.8, 6.0)
    ax.set_xlim(0.0, 1.02)
    ax.set_xlabel(r"$\nu_2$")
    ax.set_ylabel(r"bound on $|\mathrm{update}| / \alpha$")
    ax.set_title(
        rf"QHAdam's tight per-step bound, $\nu_1 = {nu1}$, $\beta_1 = {b1}$, $\beta_2 = {b2}$",
        fontsize=10,
    )
    ax.legend(loc="upper right", frameon=False)
    _save(fig, out / "qhadam_bound.svg")

    # The bound against nu2 for several nu1, at beta1 = 0.9 and beta2 = 0.98 / 0.999:
    # what nu2 does on its own (nu1 = 1) and paired with nu1 < 1.
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.0), gridspec_kw={"wspace": 0.25})
    b1 = 0.9
    grid = np.linspace(0.3, 1.0, 351)
    for ax, b2 in zip(axes, NU2_BETA2S, strict=True):
        adam = an.adam_update_bound(b1, b2)
        for n1, color in zip(NU2_NU1S, (PURPLE, "#7a5cd6", TEAL, ORANGE), strict=True):
            ax.plot(
                grid,
                [an.qhadam_update_bound(n1, b1, float(v), b2) for v in grid],
                color=color,
                lw=2.0 if n1 == 1.0 else 1.4,
                label=rf"$\nu_1 = {n1:g}$",
            )
            star, best = an.qhadam_bound_optimal_nu2(n1, b1, b2)
            ax.plot([star], [best], "o", color=color, ms=5, zorder=5)
        ax.axhline(adam, color=GREY, ls="--", lw=1.2, label=f"Adam: {adam:.3f}")
        ax.set_xlabel(r"$\nu_2$")
        ax.set_title(rf"$\beta_1 = {b1}$, $\beta_2 = {b2}$ (dots: the minimizing $\nu_2$)",
                     fontsize=10)  # fmt: skip
        ax.set_ylim(0.8 * an.qhadam_bound_optimal_nu2(0.7, b1, b2)[1], 1.6 * adam)
        ax.legend(frameon=False, fontsize=9, loc="upper right")
    axes[0].set_ylabel(r"bound on $|\mathrm{update}| / \alpha$, $t \to \infty$")
    _save(fig, out / "qhadam_bound_nu1_nu2.svg")

    # rho over (nu, beta): heat map of log10 rho, and rho vs beta for a few nu.
    betas = 1 - np.logspace(np.log10(0.5), -4, 400)  # 0.5 .. 0.9999, even on a logit axis
    nus = np.linspace(0.0, 1.0, 201)
    rho = np.array([[an.qhwma_variance_factor(float(n), float(b)) for b in betas] for n in nus])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.0), gridspec_kw={"wspace": 0.3})
    mesh = ax1.pcolormesh(
        betas, nus, np.log10(rho), cmap="viridis", shading="auto", rasterized=True
    )
    levels = [-3, -2, -1.5, -1, -0.5]
    cs = ax1.contour(betas, nus, np.log10(rho), levels=levels, colors="white", linewidths=0.7)
    ax1.clabel(cs, fmt=lambda v: f"{10**v:.3g}", fontsize=8)
    cb = fig.colorbar(mesh, ax=ax1)
    cb.set_label(r"$\log_{10} \rho$")
    marks = [
        (0.999, 0.7, "rule of thumb\n" + r"$\nu=0.7, \beta=0.999$", (0.97, 0.28)),
        (0.9, 1.0, r"momentum $\beta=0.9$", (0.985, 0.9)),
        (0.9, 0.9, r"NAG $\beta=0.9$", (0.53, 0.62)),
    ]
    for b, n, label, xy in marks:
        ax1.plot([b], [n], "o", color=ORANGE, ms=6, mec="white", zorder=5)
        ax1.annotate(
            label,
            (b, n),
            xytext=xy,
            color="white",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "color": "white", "lw": 0.8},
        )
    ax1.set_xscale("logit")
    ax1.set_xlim(0.5, 0.9999)
    ax1.set_xlabel(r"$\beta$ (logit scale)")
    ax1.set_ylabel(r"$\nu$")
    ax1.set_title(r"$\rho(\nu, \beta)$: variance factor of the QHWMA", fontsize=10)
    ax1.grid(False)

    b_line = 1 - np.logspace(0, -4, 400)[1:]  # beta from ~0 to 0.9999
    for n, color in zip(
        (0.0, 0.5, 0.7, 0.9, 1.0), ("#b8b8b8", TEAL, ORANGE, "#7a5cd6", PURPLE), strict=True
    ):
        ax2.plot(
            b_line,
            [an.qhwma_variance_factor(n, float(b)) for b in b_line],
            color=color,
            lw=2.0 if n in (0.7, 1.0) else 1.3,
            label=rf"$\nu = {n:g}$",
        )
        if 0 < n < 1:
            ax2.axhline((1 - n) ** 2, color=color, lw=0.8, ls=":")
    ax2.set_xscale("logit")
    ax2.set_yscale("log")
    ax2.set_xlim(0.5, 0.9999)
    ax2.set_xlabel(r"$\beta$ (logit scale)")
    ax2.set_ylabel(r"$\rho$")
    ax2.set_title(r"$\rho$ vs $\beta$; dotted: the floor $(1-\nu)^2$", fontsize=10)
    ax2.legend(frameon=False, fontsize=9, loc="lower left")
    _save(fig, out / "qhwma_rho.svg")


# -------------------------------------------------------------- trajectories
def trajectories(out: Path, runs_dir: Path) -> None:
    """Draw the saved runs (``conformance_job.py`` writes ``trajectory-*.npz``)."""
    from conformance.cases import load_cases
    from conformance.runner import max_relative_deviation, reference_trajectory

    case = next(c for c in load_cases() if c.name == TRAJECTORY_CASE)
    ref = reference_trajectory(case)
    order = {"numpy": 0, "torch": 1, "torch-foreach": 2, "torch-fused": 3, "optax": 4, "keras": 5}
    files = sorted(
        runs_dir.glob("trajectory-*.npz"),
        key=lambda f: order.get(f.stem.removeprefix("trajectory-"), 9),
    )
    runs: dict[str, dict[str, np.ndarray]] = {}
    for f in files:
        with np.load(f) as data:
            runs[str(data["label"])] = {k: data[k] for k in ("float64", "float32") if k in data}

    steps = np.arange(ref.shape[0])
    loss_ref = np.array([case.problem.loss(x) for x in ref])
    styles = ["-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (1, 1))]
    colors = [PURPLE, ORANGE, TEAL, "#c0392b", "#2c7fb8", "#7f8c8d"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.2), gridspec_kw={"wspace": 0.28})
    ax1.plot(steps, loss_ref, color="#d9d2f5", lw=7, label="float64 reference", zorder=1)
    for i, (label, traj) in enumerate(runs.items()):
        if "float64" not in traj:
            continue
        loss = np.array([case.problem.loss(x) for x in traj["float64"]])
        ax1.plot(
            steps,
            loss,
            color=colors[i % len(colors)],
            ls=styles[i % len(styles)],
            lw=1.6,
            label=f"{label} (float64)",
            zorder=2 + i,
        )
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (chained Rosenbrock)")
    ax1.set_title(f"{case.name}: every backend on top of the reference", fontsize=10)
    ax1.legend(frameon=False, fontsize=8.5, loc="upper right")

    floor = 1e-18
    summary = {}
    for i, (label, traj) in enumerate(runs.items()):
        summary[label] = {}
        for dtype, marker_ls in (("float64", "-"), ("float32", ":")):
            if dtype not in traj:
                continue
            shadow = ref if dtype == "float64" else reference_trajectory(case, traj[dtype])
            num = np.max(np.abs(traj[dtype] - shadow), axis=1)
            den = np.max(np.abs(shadow), axis=1)
            dev = np.maximum(num / den, floor)
            summary[label][dtype] = max_relative_deviation(traj[dtype], shadow)
            ax2.plot(
                steps,
                dev,
                color=colors[i % len(colors)],
                ls=marker_ls,
                lw=1.3,
                label=f"{label} {dtype}",
            )
    ax2.axhline(1e-12, color=GREY, lw=0.9, ls="--")
    ax2.axhline(1e-5, color=GREY, lw=0.9, ls="--")
    ax2.text(steps[-1], 1e-12, "float64 tolerance", ha="right", va="bottom", fontsize=8, color=GREY)
    ax2.text(steps[-1], 1e-5, "float32 tolerance", ha="right", va="bottom", fontsize=8, color=GREY)
    ax2.set_yscale("log")
    ax2.set_ylim(floor / 3, 1e-3)
    ax2.set_xlabel("step")
    ax2.set_ylabel(r"$\max|x - x_{ref}| / \max|x_{ref}|$")
    ax2.set_title("per-step deviation from the reference (0 drawn at 1e-18)", fontsize=10)
    ax2.legend(frameon=False, fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    _save(fig, out / "trajectories.svg")
    meta = {
        "case": case.name,
        "problem": case.problem.description,
        "optimizer": case.optimizer,
        "hparams": case.hparams,
        "steps": case.steps,
        "backends": summary,
    }
    (out / "trajectories.json").write_text(json.dumps(meta, indent=1, default=str))


# ---------------------------------------------------------------- benchmarks
# A recorded run's ratios, in the two forms the benchmarks print: a line
# "QHAdam fused / torch Adam fused = 0.86x (target ...)", under a "### case"
# heading; or a table whose last column is "ratio" (qhoptim / the baseline).
_RATIO_LINE = re.compile(r"^(?P<qh>.+?) / (?P<base>.+?) = (?P<ratio>[0-9.]+)x")


def benchmark_ratios(text: str) -> list[tuple[str, str, float]]:
    """``(case, "qhoptim vs baseline", ratio)`` for every ratio ``text`` records."""
    found: list[tuple[str, str, float]] = []
    case, header = "", None
    for line in text.splitlines():
        if line.startswith("### "):
            case = line[4:].split(":")[0].strip()
            continue
        match = _RATIO_LINE.match(line)
        if match:
            found.append((case, f"{match['qh']} vs {match['base']}", float(match["ratio"])))
            continue
        words = line.split()
        if words and words[-1] == "ratio":
            header = words
            continue
        if header and len(words) == len(header):
            row = dict(zip(header, words, strict=True))
            try:
                ratio = float(row["ratio"])
            except ValueError:
                continue
            keys = [w for w in header if w not in ("ms", "ratio", "baseline", "optimizer")]
            label = f"{row.get('optimizer', '?')} vs {row.get('baseline', '?')}"
            found.append((" ".join(row[k] for k in keys), label, ratio))
        elif not words:
            header = None
    return found


def _device(text: str) -> str:
    """The machine a recorded file names in its header ("GPU ..." where it has one)."""
    for line in text.splitlines()[:3]:
        if line.startswith("# recorded"):
            gpu = re.search(r"GPU ([^,]+)", line)
            cpu = re.search(r" on ([^,]+),", line)
            return f"GPU {gpu[1]}" if gpu else (cpu[1] if cpu else "")
    return ""


def benchmarks(out: Path, recorded: Path) -> None:
    """One figure per recorded run with ratios: each ratio a bar, the 1.0 line marked."""
    for f in sorted(recorded.glob("*.txt")):
        text = f.read_text()
        ratios = benchmark_ratios(text)
        target = out / f"bench-{f.stem}.svg"
        if not ratios:
            target.unlink(missing_ok=True)
            continue
        labels = [f"{case}: {label}" if case else label for case, label, _ in ratios]
        values = [r for _, _, r in ratios]
        fig, ax = plt.subplots(figsize=(8.0, 0.9 + 0.26 * len(values)))
        y = np.arange(len(values))[::-1]
        colors = [TEAL if v <= 1.0 else ORANGE for v in values]
        ax.barh(y, values, color=colors, height=0.7)
        ax.axvline(1.0, color=GREY, lw=1.2, ls="--")
        ax.set_yticks(y, labels, fontsize=7.5)
        ax.set_xlabel("time ratio, qhoptim / the framework's built-in (below 1: faster)")
        for yi, v in zip(y, values, strict=True):
            ax.text(v, yi, f" {v:.2f}", va="center", fontsize=7)
        ax.set_xlim(0, max(1.2, 1.12 * max(values)))
        ax.set_title(f"{f.stem} ({_device(text)})", fontsize=9.5)
        ax.grid(axis="y", visible=False)
        _save(fig, target)


if __name__ == "__main__":
    what, target = sys.argv[1], Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    if what == "analysis":
        analysis(target)
    elif what == "benchmarks":
        benchmarks(target, Path(sys.argv[3]))
    else:
        trajectories(target, Path(sys.argv[3]))
