"""qhdocs: what the qhoptim site computes while it builds.

At ``builder-inited`` it runs, in parallel subprocesses,

* the conformance suite, one process per installed backend
  (``docs/_ext/conformance_job.py``: ``conformance.runner.run`` plus one case's
  trajectories for the figure),
* the figures (``docs/_ext/figures.py``: the analysis figures, and that case
  drawn for every backend),
* every example script under ``docs/examples`` whose requirements are installed,

and in-process the recovery and errata tables (``conformance.recovery``), the
analysis numbers (``qhoptim.analysis``) and the advisor's tables
(``advisor_tables.py``: ``qhoptim.convert`` and ``qhoptim.analysis`` on common
settings). Results land in ``docs/_generated`` (not versioned): Markdown
fragments under ``inc/`` that pages ``{include}``, figures under ``fig/``,
example outputs under ``examples/``. The site ships no JavaScript of its own.

A failing conformance row, recovery case, example or figure script is reported
as a Sphinx warning, so ``sphinx-build -W`` fails on it.

Directives:

``qh-example PATH``
    Show an example script and the output it printed during this build.
``qh-toctree``
    A toctree that keeps only the entries that exist (backend guides written
    by other people may not be there yet); ``:missing:`` is shown otherwise.
``qh-automodule MODULE``
    ``automodule`` if the module is in the checkout, a note otherwise.
``qh-benchmarks``
    Every ``docs/benchmarks/*.txt`` recorded benchmark output, verbatim, under a
    figure of its ratios (``figures.py benchmarks``, drawn at build time).
"""

from __future__ import annotations

import concurrent.futures as futures
import importlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.directives.code import container_wrapper
from sphinx.directives.other import TocTree
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
GEN = DOCS / "_generated"
INC, FIG, EXAMPLES_OUT = GEN / "inc", GEN / "fig", GEN / "examples"
EXAMPLES = DOCS / "examples"
BENCHMARKS = DOCS / "benchmarks"
JOB_TIMEOUT = 420  # seconds, per subprocess

# qhoptim backend module -> the framework it needs.
BACKENDS = {
    "qhoptim.torch": "torch",
    "qhoptim.keras": "keras",
    "qhoptim.optax": "optax",
    "qhoptim.mlx": "mlx",
}
FRAMEWORKS = {"torch", "keras", "optax", "jax", "mlx"}
# Conformance rows that run under Triton's interpreter only: the triton nox
# session prints them; the site's build does not wait for them.
INTERPRETER_ROWS = frozenset({"torch-triton"})
# conformance adapter -> the qhoptim module it tests (None: the core).
ADAPTER_MODULES = {
    "torch": "qhoptim.torch",
    "torch-foreach": "qhoptim.torch",
    "torch-fused": "qhoptim.torch",
    "optax": "qhoptim.optax",
    "keras": "qhoptim.keras",
    "mlx": "qhoptim.mlx",
    "mlx-fused": "qhoptim.mlx",
}


def _warn(msg: str) -> None:
    logger.warning(msg, type="qhdocs", subtype="generated")


def _write(path: Path, text: str) -> None:
    """Write only when the content changed (keeps incremental builds incremental)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("KERAS_BACKEND", "jax")
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # The jobs run side by side: one thread each (torch's intra-op pool only
    # spins on a 2-core machine).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# ----------------------------------------------------------------- examples
def example_requirements(script: Path) -> list[str]:
    """The ``# requires: a, b`` header of an example (module names)."""
    for line in script.read_text().splitlines()[:15]:
        if line.startswith("# requires:"):
            return [m.strip() for m in line.split(":", 1)[1].split(",") if m.strip()]
    return []


def example_status(script: Path) -> tuple[bool, str, bool]:
    """``(runnable, reason, strict_failure)`` for an example script.

    A missing ``qhoptim.*`` backend module means the backend has not landed in
    this checkout: the example is shown, not run, never an error. A missing
    framework while the backend module exists is an error in strict builds.
    """
    reqs = example_requirements(script)
    missing_backend = [m for m in reqs if m.startswith("qhoptim.") and not _exists(m)]
    if missing_backend:
        return False, f"{', '.join(missing_backend)} is not part of this checkout yet", False
    missing = [m for m in reqs if not _exists(m)]
    if missing:
        framework = any(m in FRAMEWORKS for m in missing)
        return False, f"{', '.join(missing)} is not installed in the docs environment", framework
    return True, "", False


# --------------------------------------------------------------- subprocess
def _run(name: str, cmd: list[str]) -> tuple[str, subprocess.CompletedProcess[str] | None, float]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return name, None, time.perf_counter() - t0
    return name, proc, time.perf_counter() - t0


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return "inf" if x > 0 else "nan"
    return f"{x:.1e}"


# ---------------------------------------------------------------- generation
def generate(app: Sphinx) -> None:
    if app.builder.format != "html" and app.builder.name not in ("dummy", "linkcheck"):
        return
    for d in (INC, FIG, EXAMPLES_OUT):
        d.mkdir(parents=True, exist_ok=True)
    strict = bool(app.config.qhdocs_strict)
    py = sys.executable

    from conformance.adapters import REGISTRY

    # One conformance job per backend (they run in parallel; the slowest first),
    # which reads the rows a nox session of the same run kept where there are
    # some (noxfile.py sets QHOPTIM_DOCS_CONFORMANCE_ROWS) and runs them otherwise.
    kept = dict(
        item.split("=", 1)
        for item in os.environ.get("QHOPTIM_DOCS_CONFORMANCE_ROWS", "").split(os.pathsep)
        if "=" in item
    )
    jobs: dict[str, list[str]] = {}
    slow_first = {"optax": 0, "keras": 1, "torch-fused": 2, "torch": 3, "torch-foreach": 4}
    for name in sorted(REGISTRY, key=lambda n: slow_first.get(n, 9)):
        if name in INTERPRETER_ROWS:
            continue
        (GEN / "runs" / f"conformance-{name}.json").unlink(missing_ok=True)
        (GEN / "runs" / f"trajectory-{name}.npz").unlink(missing_ok=True)
        jobs[f"conformance:{name}"] = [
            py,
            str(DOCS / "_ext" / "conformance_job.py"),
            name,
            str(GEN / "runs"),
            *(["--rows", kept[name]] if name in kept else []),
        ]
    jobs["figures:analysis"] = [py, str(DOCS / "_ext" / "figures.py"), "analysis", str(FIG)]
    jobs["figures:benchmarks"] = [
        py,
        str(DOCS / "_ext" / "figures.py"),
        "benchmarks",
        str(FIG),
        str(BENCHMARKS),
    ]
    for script in sorted(EXAMPLES.glob("*.py")):
        runnable, reason, strict_failure = example_status(script)
        if runnable:
            jobs[f"example:{script.stem}"] = [py, str(script)]
        else:
            (EXAMPLES_OUT / f"{script.stem}.skipped").write_text(reason)
            (EXAMPLES_OUT / f"{script.stem}.out").unlink(missing_ok=True)
            if strict and strict_failure:
                _warn(f"example {script.name} cannot run: {reason}")

    t0 = time.perf_counter()
    workers = max(2, min(6, (os.cpu_count() or 2) + 1))
    with futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending = [pool.submit(_run, name, cmd) for name, cmd in jobs.items()]
        # In-process work while the subprocesses run.
        _recovery_tables()
        _analysis_numbers()
        _advisor_tables()
        results = [f.result() for f in pending]
        # The trajectory figure needs every backend's saved run.
        results.append(
            _run(
                "figures:trajectories",
                [
                    py,
                    str(DOCS / "_ext" / "figures.py"),
                    "trajectories",
                    str(FIG),
                    str(GEN / "runs"),
                ],
            )
        )
    logger.info(f"[qhdocs] generated content in {time.perf_counter() - t0:.1f} s")

    unavailable: dict[str, str] = {}
    for name, proc, seconds in results:
        logger.info(f"[qhdocs] {name}: {seconds:.1f} s")
        if proc is None:
            _warn(f"{name} timed out after {JOB_TIMEOUT} s")
            continue
        if name.startswith("example:"):
            stem = name.split(":", 1)[1]
            (EXAMPLES_OUT / f"{stem}.skipped").unlink(missing_ok=True)
            _write(EXAMPLES_OUT / f"{stem}.out", proc.stdout)
        if proc.returncode == 0:
            continue
        tail = (proc.stderr or proc.stdout)[-3000:]
        if name.startswith("conformance:"):
            backend = name.split(":", 1)[1]
            if proc.returncode == 3 and "is not available" in tail:
                unavailable[backend] = tail.strip().splitlines()[-1]
                module = ADAPTER_MODULES.get(backend)
                if strict and module and _exists(module):
                    _warn(f"conformance backend {backend} is not available: {unavailable[backend]}")
                continue
            if (GEN / "runs" / f"conformance-{backend}.json").exists():
                _warn(f"conformance: rows of {backend} failed (exit {proc.returncode})\n{tail}")
                continue
        _warn(f"{name} failed (exit {proc.returncode}):\n{tail}")
    _conformance_tables(unavailable)
    _trajectory_table()


def _recovery_tables() -> None:
    from conformance import recovery

    rows = recovery.recovery_rows()
    lines = [
        "| case | source | exactness | steps | max rel. deviation | tolerance | pass |",
        "|---|---|---|---:|---:|---:|:---:|",
    ]
    for r in rows:
        ok = "yes" if r.passed else "**NO**"
        lines.append(
            f"| `{r.case}` | {r.source} | {r.exactness} | {r.steps} | {_fmt(r.max_rel_dev)} "
            f"| {r.tolerance:.0e} | {ok} |"
        )
    failed = [r.case for r in rows if not r.passed]
    lines += [
        "",
        f"**{len(rows) - len(failed)} of {len(rows)} recovery cases within "
        f"{recovery.TOLERANCE:g}.**",
        "",
    ]
    _write(INC / "recovery.md", "\n".join(lines))
    if failed:
        _warn(f"recovery cases failed: {', '.join(failed)}")

    errata = recovery.errata_rows()
    lines = [
        "| erratum | case | deviation with the printed formula | with the corrected one |",
        "|---|---|---:|---:|",
    ]
    for e in errata:
        lines.append(
            f"| {e.erratum} | `{e.case}` | {_fmt(e.printed_dev)} | {_fmt(e.corrected_dev)} |"
        )
    _write(INC / "errata.md", "\n".join(lines) + "\n")
    undetected = [e.case for e in errata if not e.printed_dev > 1e-3]
    if undetected:
        _warn(f"errata no longer detected on: {', '.join(undetected)}")


def _analysis_numbers() -> None:
    from qhoptim import analysis as an

    nu2_star, best = an.qhadam_bound_optimal_nu2(0.8, 0.95, 0.98)
    rows = [
        (
            "Adam, β = (0.9, 0.999): tight bound",
            "adam_update_bound(0.9, 0.999)",
            an.adam_update_bound(0.9, 0.999),
        ),
        (
            "Adam, β = (0.9, 0.999): Kingma & Ba's claimed bound",
            "kingma_ba_claimed_bound(0.9, 0.999)",
            an.kingma_ba_claimed_bound(0.9, 0.999),
        ),
        (
            "Adam, β = (0.9, 0.98) (the paper's NMT baseline)",
            "adam_update_bound(0.9, 0.98)",
            an.adam_update_bound(0.9, 0.98),
        ),
        (
            "QHAdam ν₁ = 0.8, β₁ = 0.95, ν₂ = 1, β₂ = 0.98",
            "qhadam_update_bound(0.8, 0.95, 1, 0.98)",
            an.qhadam_update_bound(0.8, 0.95, 1.0, 0.98),
        ),
        (
            "… ν₂ = 0.7 (the paper's NMT setting)",
            "qhadam_update_bound(0.8, 0.95, 0.7, 0.98)",
            an.qhadam_update_bound(0.8, 0.95, 0.7, 0.98),
        ),
        (
            f"… the minimizing ν₂ = {nu2_star:.4f}",
            "qhadam_bound_optimal_nu2(0.8, 0.95, 0.98)",
            best,
        ),
        ("ρ, EWMA β = 0.9 (1/19)", "ewma_variance_factor(0.9)", an.ewma_variance_factor(0.9)),
        ("ρ, EWMA β = 0.999", "ewma_variance_factor(0.999)", an.ewma_variance_factor(0.999)),
        (
            "ρ, QHWMA ν = 0.7, β = 0.999 (rule of thumb)",
            "qhwma_variance_factor(0.7, 0.999)",
            an.qhwma_variance_factor(0.7, 0.999),
        ),
        (
            "ρ, QHWMA ν = 0.9, β = 0.9 (NAG, β = 0.9)",
            "qhwma_variance_factor(0.9, 0.9)",
            an.qhwma_variance_factor(0.9, 0.9),
        ),
    ]
    lines = ["| quantity | call | value |", "|---|---|---:|"]
    lines += [f"| {q} | `{call}` | {v:.4f} |" for q, call, v in rows]
    _write(INC / "analysis-numbers.md", "\n".join(lines) + "\n")

    # What nu2 does to the bound, alone (nu1 = 1) and with nu1 < 1: the
    # settings of the figure beside it (docs/_ext/figures.py).
    from figures import NU2_BETA2S, NU2_NU1S

    b1 = 0.9
    lines = [
        "| β₂ | ν₁ | Adam | ν₂ = 1 | ν₂ = 0.7 | best ν₂ | bound there | vs Adam |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b2 in NU2_BETA2S:
        adam = an.adam_update_bound(b1, b2)
        for n1 in NU2_NU1S:
            star, best = an.qhadam_bound_optimal_nu2(n1, b1, b2)
            at_one = an.qhadam_update_bound(n1, b1, 1.0, b2)
            at_07 = an.qhadam_update_bound(n1, b1, 0.7, b2)
            lines.append(
                f"| {b2:g} | {n1:g} | {adam:.3f} | {at_one:.3f} | {at_07:.3f} | {star:.3f} "
                f"| {best:.3f} | {100 * (best / adam - 1):+.1f}% |"
            )
    _write(INC / "analysis-nu2.md", "\n".join(lines) + "\n")


def _advisor_tables() -> None:
    import advisor_tables

    _write(INC / "advisor.md", advisor_tables.markdown())


def _conformance_tables(unavailable: dict[str, str]) -> None:
    rows = []
    for path in sorted((GEN / "runs").glob("conformance-*.json")):
        rows += json.loads(path.read_text())
    order = {"numpy": 0, "torch": 1, "torch-foreach": 2, "torch-fused": 3, "optax": 4}
    rows.sort(key=lambda r: order.get(r["backend"], 9))
    if not rows:
        _warn("the conformance suite produced no rows")
        _write(INC / "conformance.md", "*The conformance suite did not produce a table.*\n")
        return
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["case"], r["backend"], r["dtype"]): r for r in rows}
    n_ok = sum(r["passed"] for r in rows)
    out = [
        f"**{n_ok} passed, {len(rows) - n_ok} failed**: {len(cases)} cases × "
        f"{len(backends)} backends ({', '.join(backends)}) in float64 and float32, run "
        "during this build. A dash: the backend does not run that case in that dtype "
        "(QHMuon has one torch implementation; Keras's Muon steps float32; MLX's Muon "
        "has no other shape scale).",
        "",
    ]
    if unavailable:
        out += [
            "Not installed in this build, so not in the table: "
            + ", ".join(f"`{b}`" for b in sorted(unavailable))
            + ".",
            "",
        ]
    for dtype, how in (
        ("float64", "closed loop against the independent float64 reference"),
        ("float32", "against the float64 reference shadowing the run"),
    ):
        tol = next((r["tolerance"] for r in rows if r["dtype"] == dtype), None)
        out += [
            f"### {dtype}",
            "",
            f"Max relative deviation over all steps, {how}; tolerance {tol:.0e}."
            if tol is not None
            else "",
            "",
        ]
        out.append("| case | steps | " + " | ".join(backends) + " |")
        out.append("|---|---:|" + "---:|" * len(backends))
        for case in cases:
            steps = next(r["steps"] for r in rows if r["case"] == case)
            cells = []
            for b in backends:
                r = cell.get((case, b, dtype))
                if r is None:
                    cells.append("—")
                elif r["passed"]:
                    cells.append(_fmt(r["deviation"]))
                else:
                    cells.append(f"**{_fmt(r['deviation'])} ✗**")
            out.append(f"| `{case}` | {steps} | " + " | ".join(cells) + " |")
        out.append("")
    _write(INC / "conformance.md", "\n".join(out))


def _trajectory_table() -> None:
    path = FIG / "trajectories.json"
    if not path.exists():
        _write(INC / "trajectories.md", "")
        return
    meta = json.loads(path.read_text())
    hp = ", ".join(f"{k} = {v}" for k, v in meta["hparams"].items())
    lines = [
        f"Case `{meta['case']}`: {meta['optimizer']} ({hp}) on the {meta['problem']}, "
        f"{meta['steps']} steps.",
        "",
        "| backend | float64 max rel. deviation | float32 max rel. deviation |",
        "|---|---:|---:|",
    ]
    for b, devs in meta["backends"].items():
        lines.append(
            f"| {b} | {_fmt(devs.get('float64', math.nan)) if 'float64' in devs else '—'} "
            f"| {_fmt(devs['float32']) if 'float32' in devs else '—'} |"
        )
    _write(INC / "trajectories.md", "\n".join(lines) + "\n")


# --------------------------------------------------------------- directives
class ExampleDirective(SphinxDirective):
    """``qh-example PATH``: an example's source and the output of its run in this build."""

    required_arguments = 1
    option_spec: ClassVar[dict[str, Any]] = {
        "no-source": directives.flag,
        "caption": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        _, abspath = self.env.relfn2path(self.arguments[0], self.env.docname)
        script = Path(abspath).resolve()
        if not script.is_file():
            raise self.error(f"qh-example: no such file {self.arguments[0]}")
        rel = script.relative_to(DOCS).as_posix()
        self.env.note_dependency(str(script))
        result: list[nodes.Node] = []
        if "no-source" not in self.options:
            source = "\n".join(
                line
                for line in script.read_text().splitlines()
                if not line.startswith("# requires:")
            ).strip("\n")
            block = nodes.literal_block(source, source, language="python")
            block["classes"].append("qh-example-source")
            self.set_source_info(block)
            caption = self.options.get("caption") or f"docs/{rel}"
            result.append(container_wrapper(self, block, caption))
        out = EXAMPLES_OUT / f"{script.stem}.out"
        skipped = EXAMPLES_OUT / f"{script.stem}.skipped"
        if skipped.exists():
            note = nodes.note()
            note += nodes.paragraph(
                text=f"Not run in this build: {skipped.read_text().strip()}. "
                "The docs build runs it when the backend is installed."
            )
            result.append(note)
        elif out.exists():
            self.env.note_dependency(str(out))
            text = out.read_text().rstrip("\n") or "(no output)"
            block = nodes.literal_block(text, text, language="text")
            block["classes"].append("qh-example-output")
            result.append(
                container_wrapper(self, block, "Output, printed when the docs were built")
            )
        return result


class ConditionalTocTree(TocTree):
    """``qh-toctree``: a toctree of the entries that exist; ``:missing:`` text otherwise."""

    option_spec: ClassVar[dict[str, Any]] = dict(TocTree.option_spec, missing=directives.unchanged)

    def run(self) -> list[nodes.Node]:
        from sphinx.util import docname_join

        kept = []
        for line in self.content:
            entry = line.strip()
            target = entry.split("<")[-1].rstrip(">").strip() if entry.endswith(">") else entry
            if target.startswith("/"):
                docname = target[1:]
            else:
                docname = docname_join(self.env.docname, target)
            if not entry or docname in self.env.found_docs:
                kept.append(line)
        if not any(line.strip() for line in kept):
            missing = self.options.get("missing")
            if not missing:
                return []
            para = nodes.paragraph()
            text_nodes, messages = self.state.inline_text(missing, self.lineno)
            para += text_nodes
            return [para, *messages]
        self.content = StringList(kept, source=self.content.source(0) if self.content else "")
        self.options.pop("missing", None)
        return super().run()


class AutomoduleIfPresent(SphinxDirective):
    """``qh-automodule MODULE``: ``automodule`` if the module exists and imports."""

    required_arguments = 1
    option_spec: ClassVar[dict[str, Any]] = {
        "members": directives.unchanged,
        "no-members": directives.flag,
    }

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        if not _exists(module):
            return [self._note(f"{module} is not part of this checkout yet.")]
        try:
            importlib.import_module(module)
        except ImportError as e:
            framework = BACKENDS.get(module, "")
            if self.config.qhdocs_strict:
                _warn(f"{module} exists but cannot be imported: {e}")
            return [
                self._note(
                    f"{module} cannot be imported in the docs environment "
                    f"({framework or e}): its reference is not rendered here."
                )
            ]
        lines = [f".. automodule:: {module}"]
        if "no-members" in self.options:
            lines.append("   :no-members:")
        elif self.options.get("members"):
            lines.append(f"   :members: {self.options['members']}")
        else:
            lines.append("   :members:")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="qh-automodule"), node)
        return list(node.children)

    def _note(self, text: str) -> nodes.Node:
        note = nodes.note()
        note += nodes.paragraph(text=text)
        return note


class BenchmarksDirective(SphinxDirective):
    """``qh-benchmarks``: every recorded ``docs/benchmarks/*.txt``, verbatim."""

    def run(self) -> list[nodes.Node]:
        files = sorted(BENCHMARKS.glob("*.txt"))
        if not files:
            note = nodes.note()
            note += nodes.paragraph(
                text="No benchmark output is recorded in docs/benchmarks yet; see "
                "“Recording a run” below."
            )
            return [note]
        result: list[nodes.Node] = []
        for f in files:
            self.env.note_dependency(str(f))
            text = f.read_text().rstrip("\n")
            section = nodes.section(ids=[f"bench-{f.stem}"])
            section += nodes.title(text=f.stem.replace("_", " "))
            figure = FIG / f"bench-{f.stem}.svg"
            if figure.exists():
                # Each ratio the run recorded, drawn from the file at build time.
                uri = os.path.relpath(figure, DOCS)
                section += nodes.image(
                    uri=uri,
                    alt=f"{f.stem}: every ratio to the framework's built-in, the 1.0 line marked",
                )
            section += nodes.paragraph(text=f"docs/benchmarks/{f.name}, verbatim:")
            block = nodes.literal_block(text, text, language="text")
            section += block
            result.append(section)
        return result


# ------------------------------------------------------------ API coverage
def check_api_coverage(app: Sphinx, exception: Exception | None) -> None:
    """Every name in every documented module's ``__all__`` has an API entry."""
    if exception is not None or app.builder.format != "html":
        return
    objects = set(app.env.get_domain("py").objects)
    documented_modules = {
        name for name, obj in app.env.get_domain("py").objects.items() if obj.objtype == "module"
    }
    missing = []
    for module in sorted(documented_modules):
        if module in ("qhoptim", "qhoptim.pyt"):
            continue  # lazy submodules / re-exports, listed on their pages
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", []):
            if f"{module}.{name}" not in objects:
                missing.append(f"{module}.{name}")
    if missing:
        _warn("public names without an API entry: " + ", ".join(missing))


_TORCH_REF = re.compile(r":ref:`([^`<]+?)\s*<[^`>]+>`")
_INTRAWORD_EMPHASIS = re.compile(r"(?<=[\w-])\*(\w+)\*(?=\w)")


def clean_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Make two kinds of docstring text render without warnings.

    * ``torch.optim``'s shared argument docs (``_foreach_doc`` etc., which
      qhoptim.torch reuses so its arguments read like torch's) link to labels of
      torch's own site (``:ref:`accelerators<accelerators>```): shown as text,
      since this site has no torch inventory.
    * reST has no intra-word emphasis (``bias-*un*corrected``): shown plain.
    """
    if not name.startswith("qhoptim.torch"):
        return
    for i, line in enumerate(lines):
        line = _TORCH_REF.sub(r"\1", line)
        lines[i] = _INTRAWORD_EMPHASIS.sub(r"\1", line)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("qhdocs_strict", False, "env")
    app.connect("builder-inited", generate)
    app.connect("build-finished", check_api_coverage)
    app.connect("autodoc-process-docstring", clean_docstring)
    app.add_directive("qh-example", ExampleDirective)
    app.add_directive("qh-toctree", ConditionalTocTree)
    app.add_directive("qh-automodule", AutomoduleIfPresent)
    app.add_directive("qh-benchmarks", BenchmarksDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
