"""The test matrix. ``nox`` runs every session; ``nox -s NAME`` one of them.

Sessions:
  tests        core unit, property and analysis tests (numpy only)
  conformance  the conformance table (reference + numpy adapter) and the
               recovery table (QHM/QHAdam vs the algorithms they recover)
  lint         ruff (lint + format check) and mypy --strict on the core
               (each backend's session type-checks its module)
  torch        qhoptim.torch: its tests and its conformance rows
  optax        qhoptim.optax: its tests, doctests, example and conformance rows
  keras        qhoptim.keras, once per Keras backend (tensorflow, jax, torch)
  distributed  each backend under its framework's distributed engine: torch DDP,
               ZeRO, FSDP2 and DCP on 2 gloo ranks; optax under NamedSharding on
               8 host devices; Keras under MirroredStrategy and keras.distribution
  sweep        the paper's parameter sweep, --quick smoke run (full: see docs/sweep.md)
  demo         one problem through every installed backend, agreement printed

Every install uses ``.ci/constraints.txt`` (pins torch to the offline CPU wheel).
Set QHOPTIM_NOX_ENVDIR to keep the virtualenvs outside the checkout (CI does);
they are then reused between runs, but every install step still runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / ".ci" / "constraints.txt"))
ARTIFACTS = ROOT / "artifacts"
BACKEND_TESTS = ("tests/torch", "tests/optax", "tests/keras", "tests/docs", "tests/distributed")
KERAS_BACKENDS = ("tensorflow", "jax", "torch")

nox.options.sessions = [
    "lint", "tests", "conformance", "torch", "optax", "keras", "distributed", "sweep", "docs",
]  # fmt: skip
nox.options.error_on_missing_interpreters = True
if envdir := os.environ.get("QHOPTIM_NOX_ENVDIR"):
    nox.options.envdir = envdir
    nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"


def _install(session: nox.Session, extras: str) -> None:
    session.install("-e", f".[{extras}]", *CONSTRAINTS)


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    # pytest exits 5 when it collects nothing; nox treats any non-zero exit
    # as a failure, so an empty run can never pass silently.
    session.run("python", "-m", "pytest", *args, *session.posargs, env=env)


def _typecheck(session: nox.Session, module: str) -> None:
    # A backend module is type-checked where its framework is installed
    # (the lint session checks the framework-free core).
    session.install("mypy>=1.10", *CONSTRAINTS)
    session.run("mypy", module)


def _conformance(
    session: nox.Session, *backends: str, table: str, env: dict[str, str] | None = None
) -> None:
    # Prints the table and keeps it (Markdown and JSON) under artifacts/.
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / f"conformance-{table}"
    session.run(
        "python", "-m", "conformance", "--backends", *backends,
        "--markdown", f"{out}.md", "--json", f"{out}.json", env=env,
    )  # fmt: skip


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    _install(session, "test")
    ignores = [f"--ignore={p}" for p in BACKEND_TESTS]
    _pytest(session, "tests", *ignores)
    session.run(
        "python",
        "-m",
        "pytest",
        "--doctest-modules",
        "-q",
        "-p",
        "no:cacheprovider",
        "qhoptim/rules.py",
        "qhoptim/reference.py",
        "qhoptim/convert.py",
        "qhoptim/analysis.py",
    )


@nox.session(python=PYTHON)
def conformance(session: nox.Session) -> None:
    _install(session, "test")
    _conformance(session, "numpy", table="numpy")
    session.run("python", "-m", "conformance.recovery")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6", "mypy>=1.10", "numpy", *CONSTRAINTS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(python=PYTHON)
def torch(session: nox.Session) -> None:
    _install(session, "test,torch")
    _typecheck(session, "qhoptim/torch")
    _pytest(session, "tests/torch", "tests/test_packaging.py")
    _conformance(session, "torch", "torch-foreach", "torch-fused", table="torch")


@nox.session(python=PYTHON)
def optax(session: nox.Session) -> None:
    _install(session, "test,jax")
    session.install("flax", *CONSTRAINTS)  # the Flax example and checkpoint tests
    _typecheck(session, "qhoptim/optax.py")
    _pytest(session, "tests/optax", "tests/test_packaging.py")
    _pytest(session, "--doctest-modules", "-p", "no:cacheprovider", "qhoptim/optax.py")
    _conformance(session, "optax", table="optax")


@nox.session(python=PYTHON)
@nox.parametrize("backend", KERAS_BACKENDS, ids=list(KERAS_BACKENDS))
def keras(session: nox.Session, backend: str) -> None:
    # One update_step, three Keras backends: the same tests run on each. The
    # venv holds all three frameworks (tests/keras compares across them);
    # tensorflow-cpu is TensorFlow without the GPU libraries.
    _install(session, "test,torch")
    session.install("tensorflow-cpu>=2.16", "keras>=3", "jax", *CONSTRAINTS)
    env = {"KERAS_BACKEND": backend}
    if backend == KERAS_BACKENDS[0]:  # the types do not depend on the backend
        _typecheck(session, "qhoptim/keras")
    _pytest(session, "tests/keras", "tests/test_packaging.py", env=env)
    _conformance(session, "keras", table=f"keras-{backend}", env=env)


@nox.session(python=PYTHON)
def distributed(session: nox.Session) -> None:
    # Every framework is installed here, so every test must run:
    # QHOPTIM_REQUIRE_ALL turns a skip into a failure (tests/distributed/conftest.py).
    _install(session, "test,torch,jax")
    session.install("tensorflow-cpu>=2.16", "keras>=3", *CONSTRAINTS)
    _pytest(session, "tests/distributed", env={"QHOPTIM_REQUIRE_ALL": "1"})


@nox.session(python=PYTHON)
def sweep(session: nox.Session) -> None:
    _install(session, "jax")
    session.install("scikit-learn", "matplotlib", *CONSTRAINTS)
    out = ARTIFACTS / ("sweep" if "--full" in session.posargs else "sweep-quick")
    quick = [] if "--full" in session.posargs else ["--quick"]
    session.run("python", "benchmarks/sweep.py", *quick, "--out", str(out))


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    extras = session.posargs[0] if session.posargs else "torch,jax"
    _install(session, f"test,{extras}")
    session.install("keras>=3", *CONSTRAINTS)  # Keras 3 runs on the JAX installed above
    session.run("python", "-m", "conformance.demo", env={"KERAS_BACKEND": "jax"})


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site: build (warnings are errors), then test it in Chromium.

    The build runs the example scripts, the conformance suite and the recovery
    suite and draws the figures (docs/_ext/qhdocs.py). Keras runs on JAX here,
    so no TensorFlow. The browser test needs Debian's chromium and
    chromium-driver (.ci/run installs them) and writes artifacts/docs-*.png.
    """
    _install(session, "docs,jax,torch,test")
    env = {"QHOPTIM_DOCS_STRICT": "1", "KERAS_BACKEND": "jax"}
    html = ROOT / "docs" / "_build" / "html"
    session.run(
        "sphinx-build", "-W", "--keep-going", "-E", "-b", "html", "docs", str(html), env=env
    )
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/docs",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={"QHOPTIM_DOCS_REQUIRE": "1", "QHOPTIM_DOCS_HTML": str(html)},
    )
