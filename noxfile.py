"""The test matrix. ``nox`` runs every session; ``nox -s NAME`` one of them.

Sessions (``nox -l`` lists them; ``nox`` runs all but ``demo``):
  tests        core unit, property and analysis tests (numpy only), on
               Python 3.11 and 3.13
  conformance  the conformance table (reference + numpy adapter) and the
               recovery table (QHM/QHAdam vs the algorithms they recover)
  lint         ruff (lint + format check) and mypy --strict on the core
               (each backend's session type-checks its module)
  torch        qhoptim.torch: its tests and its conformance rows
  triton       qhoptim.torch's fused CUDA (Triton) kernels on CPU, through
               Triton's interpreter (TRITON_INTERPRET=1): the fused tests and
               the torch-triton conformance rows
  optax        qhoptim.optax: its tests, doctests, example and conformance rows,
               on Python 3.11 and 3.13
  keras        qhoptim.keras, once per Keras backend (tensorflow, jax, torch),
               each venv holding only that backend's framework
  mlx          qhoptim.mlx (MLX's CPU build on Linux): its tests, doctests,
               example and conformance rows
  distributed  each backend under its framework's distributed engine: torch DDP,
               ZeRO, FSDP2 and DCP on 2 gloo ranks; optax under NamedSharding on
               8 host devices; Keras under MirroredStrategy and keras.distribution
  lowest       Python 3.10 with the lowest versions pyproject declares
               (.ci/lowest-constraints.txt): core tests, the conformance rows
               of optax, MLX and Keras on TensorFlow and on JAX
  sweep        the paper's parameter sweep and its AggMo comparison, --quick smoke
               runs (full: see docs/sweep.md and docs/aggmo.md)
  docs         the site, built with warnings as errors, then tested in Chromium
  demo         the same problems through every installed backend, agreement printed

Every install uses ``.ci/constraints.txt`` (pins torch to the offline CPU wheel).
The tests of a session run on every core (pytest-xdist, up to four workers;
``nox -s NAME -- -n 0`` for one process), and each backend's conformance rows
run once: its conformance test writes the table under artifacts/conformance/.
Set QHOPTIM_NOX_ENVDIR to keep the virtualenvs outside the checkout (CI does);
they are then reused between runs, but every install step still runs.

Each session's wall time is printed when it ends, and the whole table when
nox exits (also written to artifacts/session-times.txt).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).resolve().parent  # absolute: some sessions change directory
CONSTRAINTS = ("-c", str(ROOT / ".ci" / "constraints.txt"))
LOWEST = ("-c", str(ROOT / ".ci" / "lowest-constraints.txt"))
ARTIFACTS = ROOT / "artifacts"
BACKEND_TESTS = (
    "tests/torch", "tests/optax", "tests/keras", "tests/mlx", "tests/docs", "tests/distributed",
    "tests/integrations",
)  # fmt: skip
KERAS_BACKENDS = ("tensorflow", "jax", "torch")
# pytest-timeout (the test extra): far above any test's own time (the slowest,
# packaging's wheel builds, take a few minutes), so a test that waits forever
# fails with its stack instead of stalling the run.
TEST_TIMEOUT = ("--timeout=1200",)
# Every run lists its ten slowest tests: where a session's time goes.
DURATIONS = ("--durations=10",)
# pytest-xdist (the test extra): a session's tests spread over worker processes,
# one per core up to four (each worker imports the session's framework, and
# TensorFlow's or JAX's import costs memory); the conformance runner spreads its
# rows likewise. ``nox -s torch -- -n 0`` runs the tests in one process (the
# last ``-n`` given wins).
CORES = min(os.cpu_count() or 1, 4)
WORKERS = ("-n", str(CORES), "--dist", "worksteal")

nox.options.sessions = [
    "lint", "tests", "conformance", "torch", "triton", "optax", "keras", "mlx", "distributed",
    "integrations", "lowest", "sweep", "docs",
]  # fmt: skip
# Each session's venv is made and filled by uv where nox finds it (`pip install
# "nox[uv]"`): uv links packages from one cache into every venv instead of
# copying them, so the frameworks that several sessions install (torch,
# TensorFlow, JAX) take their disk once, and an install takes seconds. Without
# uv, virtualenv and pip, as before.
nox.options.default_venv_backend = "uv|virtualenv"
# nox's own default: a missing interpreter fails the run under CI (CI is set)
# and skips its sessions, reported as skipped, elsewhere.
# Bytecode is written: the sessions' venvs are nox's own and outlive a run, and
# where PYTHONDONTWRITEBYTECODE is set (some images set it) every process would
# compile every framework module it imports again -- importing torch so took
# about 5 s of a 2-core machine's time, in each test worker, conformance job
# and example script -- where a process that finds the bytecode of an earlier
# run takes under 2 s.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
if envdir := os.environ.get("QHOPTIM_NOX_ENVDIR"):
    nox.options.envdir = envdir
    nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"  # every session's, but for the ones below
PYTHONS_CORE = ["3.11", "3.13"]  # the core and the optax backend: newest Python too
PYTHON_LOWEST = "3.10"  # requires-python's floor


def _runs(command: str) -> bool:
    try:
        return subprocess.run([command, "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


def _find_pyenv_interpreters() -> None:
    # pyenv installs other Pythons without putting them on PATH (its shims
    # answer only for the selected version); nox looks for ``python3.X`` on
    # PATH, so put pyenv's install of each version used here there.
    versions = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in (PYTHON_LOWEST, *PYTHONS_CORE):
        found = sorted(versions.glob(f"{version}.*/bin/python{version}"))
        if found and not _runs(f"python{version}"):
            os.environ["PATH"] = f"{found[-1].parent}{os.pathsep}{os.environ.get('PATH', '')}"


_find_pyenv_interpreters()


# pip's settings that say where packages come from, and uv's names for them.
_PIP_TO_UV = {
    "find-links": "UV_FIND_LINKS",
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
}


def _carry_pip_sources_to_uv() -> None:
    """Give uv the package sources pip is configured with.

    uv reads neither pip's configuration files nor its ``PIP_*`` variables. On
    machines where pip finds packages through them -- a local folder of wheels
    holding torch's CPU build, which .ci/constraints.txt pins, and local
    indexes -- uv would otherwise fetch torch from the package index, where
    that version is a multi-GB CUDA build. What the user set for uv wins.
    """
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return
    found: dict[str, str] = {}
    for line in listed.splitlines():  # global.find-links='/opt/wheels', :env:.find-links=...
        name, _, value = line.partition("=")
        key = name.rsplit(".", 1)[-1]
        if key in _PIP_TO_UV:
            found[_PIP_TO_UV[key]] = value.strip("'\"")
    for variable, value in found.items():
        os.environ.setdefault(variable, value)
    if found:
        # Every source's versions considered, as pip does (uv's default takes a
        # package from the first index that has it, a local one here).
        os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")


_carry_pip_sources_to_uv()


def _cpu_signature() -> str:
    """A short name for this machine's CPU model and instruction sets.

    XLA's CPU compiler targets the host's instruction sets, and JAX's cache key
    does not say which: a program compiled on a machine with AVX-512 must not be
    loaded on one without. One cache folder per signature keeps them apart.
    """
    described = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            described += "".join(
                line for line in info if line.startswith(("flags", "model name", "Features"))
            )
    except OSError:
        pass
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def _keep_compiled_programs() -> None:
    """Keep the XLA programs JAX and TensorFlow compile in one folder on disk.

    Much of a JAX or Keras-on-TensorFlow session's test time is XLA compiling
    small programs, the same ones in every run and several times within one
    (each pytest worker, each session with the same framework). Both frameworks
    can keep what they compile on disk, keyed by the program, the compile
    options and the framework's version, so compiling it again is a file read:
    JAX's persistent compilation cache (whose default keeps only programs that
    took a second or more; the tests' take less, so every one is kept) and
    TensorFlow's XLA cache (``--tf_xla_persistent_cache_directory``). The
    folder lives beside the session venvs (``rm -rf .nox`` removes it); what the
    user set wins.
    """
    folder = Path(nox.options.envdir or ROOT / ".nox") / "_compiled" / _cpu_signature()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(folder / "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    tf_flags = os.environ.get("TF_XLA_FLAGS", "")
    if "tf_xla_persistent_cache_directory" not in tf_flags:
        cache = f"--tf_xla_persistent_cache_directory={folder / 'tensorflow'}"
        os.environ["TF_XLA_FLAGS"] = f"{tf_flags} {cache}".strip()


_keep_compiled_programs()

# tests/test_packaging.py builds and installs the wheel once per digest of what
# it is made from (the sources, the Python, setuptools and pip), here for every
# session that runs it, instead of once per test process.
os.environ.setdefault(
    "QHOPTIM_WHEEL_CACHE", str(Path(nox.options.envdir or ROOT / ".nox") / "_wheels")
)

_SESSION_TIMES: dict[str, tuple[float, str]] = {}


def timed(func: Callable[..., None]) -> Callable[..., None]:
    """Record and print the session's wall time (installs included), pass or fail."""

    @functools.wraps(func)
    def wrapper(session: nox.Session, *args: Any, **kwargs: Any) -> None:
        start, outcome = time.perf_counter(), "failed"
        try:
            func(session, *args, **kwargs)
            outcome = "passed"
        finally:
            seconds = time.perf_counter() - start
            _SESSION_TIMES[session.name] = (seconds, outcome)
            session.log(f"{session.name}: {outcome} after {seconds:.0f} s wall time")

    return wrapper


@atexit.register
def _print_session_times() -> None:
    if not _SESSION_TIMES:
        return
    total = sum(t for t, _ in _SESSION_TIMES.values())
    width = max(len(n) for n in _SESSION_TIMES)
    lines = [f"{n:<{width}}  {t:7.0f} s  {o}" for n, (t, o) in _SESSION_TIMES.items()]
    lines.append(f"{'total':<{width}}  {total:7.0f} s")
    table = "\n".join(["wall time per session:", *lines])
    print(table, flush=True)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "session-times.txt").write_text(table + "\n")


@atexit.register
def _share_bytecode() -> None:
    """One file on disk for the bytecode of one installed module, whichever venvs import it.

    uv links a package's files from its cache into every venv that installs
    it, but each venv writes its own bytecode beside them: torch's, JAX's and
    TensorFlow's, some 60-120 MB a venv, over 0.8 GB in all. A ``.pyc`` is
    valid for every hard link of its source: its header holds the source's
    modification time and size, which the links share, and Python replaces
    the file name compiled into it with the path it imports from. So where
    two venvs' ``.pyc`` of one linked source (same inode, same Python) have
    the same header, the second becomes a hard link of the first. Python
    never writes into a ``.pyc`` in place (it writes a new file and renames
    it over the old one), so a venv that compiles again replaces its link and
    leaves the others' alone. Sources that are copies (pip, or a uv cache on
    another file system) are left as they are.
    """
    if not _SESSION_TIMES:
        return
    first: dict[tuple[int, int, str], tuple[Path, bytes]] = {}
    shared = saved = 0
    for folder, dirs, files in os.walk(Path(nox.options.envdir or ROOT / ".nox")):
        if not folder.endswith("__pycache__"):
            continue
        dirs.clear()
        for name in files:
            if not name.endswith(".pyc"):
                continue
            pyc = Path(folder, name)
            try:
                source = os.stat(Path(folder).parent / (name.split(".", 1)[0] + ".py"))
                stat = pyc.stat()
                if source.st_nlink < 2:
                    continue
                with pyc.open("rb") as f:
                    header = f.read(16)
                key = (source.st_dev, source.st_ino, name)
                if key not in first:
                    first[key] = (pyc, header)
                    continue
                original, original_header = first[key]
                if header != original_header or os.path.samefile(original, pyc):
                    continue
                link = pyc.with_name(pyc.name + ".link")
                os.link(original, link)
                try:
                    os.replace(link, pyc)
                except OSError:
                    link.unlink()
                    raise
            except OSError:
                continue
            shared += 1
            saved += stat.st_size
    if shared:
        print(f"bytecode: {shared} files are now links of another venv's ({saved / 1e6:.0f} MB)")


def _install(
    session: nox.Session, extras: str, *more: str, constraints: tuple[str, ...] = CONSTRAINTS
) -> None:
    """This checkout, editable with ``extras``, into the session's venv (and ``more``).

    pip too: a uv venv has none, and tests/test_packaging.py builds and installs
    the wheel with it, as a user's pip does. The editable requirement is read
    from a file, not the command line: uv rebuilds a project named on the
    command line on every install (setuptools' editable build, 2-3 s a
    session), and one in a requirements file only when ``[tool.uv]
    cache-keys`` (pyproject.toml) say its metadata changed.
    """
    # In the venv's folder, not session.create_tmp(): that would also point
    # TMPDIR at the venv, inside the checkout when the venvs are (.nox), where
    # the packaging tests must not put their scratch folders.
    venv = session.virtualenv.location
    requirements = Path(venv or tempfile.mkdtemp()) / "qhoptim-editable.txt"
    requirements.write_text(f"-e {ROOT}[{extras}]\n")
    session.install("-r", str(requirements), "pip", *more, *constraints)


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    # pytest exits 5 when it collects nothing; nox treats any non-zero exit
    # as a failure, so an empty run can never pass silently. Nor does a skip
    # but the platform's (a GPU, another Keras backend: tests/conftest.py),
    # unless the session asks for more (QHOPTIM_REQUIRE_ALL=1: no skip at all).
    session.run(
        "python", "-m", "pytest", *TEST_TIMEOUT, *DURATIONS, *WORKERS, *args, *session.posargs,
        env={"QHOPTIM_REQUIRE_ALL": os.environ.get("QHOPTIM_REQUIRE_ALL") or "platform"}
        | (env or {}),
    )  # fmt: skip


def _doctests(session: nox.Session, *modules: str) -> None:
    # A handful of examples: one process, and none of the arguments after
    # ``--`` (a -k chosen for the tests would leave nothing here, a failure).
    session.run(
        "python", "-m", "pytest", *TEST_TIMEOUT, "--doctest-modules", "-q",
        "-p", "no:cacheprovider", *modules,
    )  # fmt: skip


def _mypy(session: nox.Session, *args: str) -> None:
    # mypy's cache kept in the session's venv, which outlives the checkout
    # (CI's clone is new every run): checking the torch backend takes 20 s
    # from nothing and half a second from the cache. mypy checks each cached
    # module's source hash, so a changed file is checked again.
    cache = Path(session.virtualenv.location or session.create_tmp()) / "mypy-cache"
    session.run("mypy", "--cache-dir", str(cache), *args)


def _typecheck(session: nox.Session, module: str) -> None:
    # A backend module is type-checked where its framework is installed
    # (the lint session checks the framework-free core).
    session.install("mypy>=1.10", *CONSTRAINTS)
    _mypy(session, module)


def _tables(session: nox.Session) -> Path:
    """This session's conformance tables' folder, artifacts/conformance/SESSION."""
    return ARTIFACTS / "conformance" / re.sub(r"[^\w.-]+", "-", session.name).strip("-")


def _conformance(
    session: nox.Session, *backends: str, table: str, env: dict[str, str] | None = None
) -> None:
    # Runs the rows (over CORES processes), prints the table and keeps it
    # (Markdown and JSON).
    out = _tables(session) / table
    session.run(
        "python", "-m", "conformance", "--backends", *backends, "--jobs", str(CORES),
        "--markdown", f"{out}.md", "--json", f"{out}.json", env=env,
    )  # fmt: skip


#: The conformance tables this nox run's sessions kept, by session name and
#: table (their JSON files): the docs session's build reads the rows of its own
#: environment's backends from them instead of running them again.
_TABLES_KEPT: dict[str, dict[str, Path]] = {}


def _pytest_with_conformance(
    session: nox.Session, *args: str, tables: tuple[str, ...], env: dict[str, str] | None = None
) -> None:
    """The session's tests, whose conformance tests keep their rows' tables.

    The backend's conformance test runs every row and fails on any that fails;
    it also writes the table (``conformance.runner.record``), so the rows run
    once. Each table's verdict is printed; one missing fails the session, unless
    arguments after ``--`` chose the tests.
    """
    out = _tables(session)
    for table in tables:  # a table left by an earlier run must not stand in for this one
        for suffix in (".md", ".json"):
            (out / f"{table}{suffix}").unlink(missing_ok=True)
    _pytest(session, *args, env={**(env or {}), "QHOPTIM_CONFORMANCE_OUT": str(out)})
    for table in tables:
        path = out / f"{table}.md"
        if path.exists():
            session.log(f"conformance {table}: {path.read_text().splitlines()[-1]} ({path})")
            if not session.posargs:  # every row, as the docs build runs them
                _TABLES_KEPT.setdefault(session.name, {})[table] = out / f"{table}.json"
        elif not session.posargs:
            session.error(f"the conformance test of {table} kept no table ({path})")


def _core_tests(session: nox.Session) -> None:
    ignores = [f"--ignore={p}" for p in BACKEND_TESTS]
    _pytest(session, "tests", *ignores)
    _doctests(
        session, "qhoptim/rules.py", "qhoptim/reference.py", "qhoptim/convert.py",
        "qhoptim/analysis.py",
    )  # fmt: skip


@nox.session(python=PYTHONS_CORE)
@timed
def tests(session: nox.Session) -> None:
    _install(session, "test")
    _core_tests(session)


@nox.session(python=PYTHON)
@timed
def conformance(session: nox.Session) -> None:
    _install(session, "test")
    _conformance(session, "numpy", table="numpy")
    session.run("python", "-m", "conformance.recovery")


@nox.session(python=PYTHON)
@timed
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6", "mypy>=1.10", "numpy", "check-jsonschema>=0.29", *CONSTRAINTS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    _mypy(session)
    # The GitHub Actions workflow, against the schema check-jsonschema ships
    # (no network needed).
    session.run(
        "check-jsonschema", "--builtin-schema", "vendor.github-workflows",
        str(ROOT / ".github" / "workflows" / "ci.yml"),
    )  # fmt: skip


@nox.session(python=PYTHON)
@timed
def torch(session: nox.Session) -> None:
    _install(session, "test,torch")
    _typecheck(session, "qhoptim/torch")
    _pytest_with_conformance(
        session, "tests/torch", "tests/test_packaging.py",
        tables=("torch", "torch-foreach", "torch-fused"),
    )  # fmt: skip


@nox.session(python=PYTHON)
@timed
def triton(session: nox.Session) -> None:
    # fused=True's CUDA (Triton) kernels on CPU tensors, through Triton's
    # interpreter: the fused tests (those that need a GPU deselected by name)
    # and the torch-triton conformance rows. A skip fails here.
    _install(session, "test,torch")
    session.install("triton", *CONSTRAINTS)
    env = {"TRITON_INTERPRET": "1", "QHOPTIM_REQUIRE_ALL": "1"}
    _pytest(
        session,
        "tests/torch/test_torch_fused.py",
        "tests/torch/test_torch_triton.py",
        "tests/torch/test_torch_hardening.py",
        "tests/torch/test_torch_parity.py",
        "-k",
        "not cuda",
        env=env,
    )
    _conformance(session, "torch-triton", table="torch-triton", env=env)


@nox.session(python=PYTHONS_CORE)
@timed
def optax(session: nox.Session) -> None:
    _install(session, "test,jax")
    session.install("flax", *CONSTRAINTS)  # the Flax example and checkpoint tests
    # Type-checked once: mypy checks as Python 3.10 (pyproject) whichever Python
    # runs it, and on 3.13 it is another 50 MB build of mypy and its own cache.
    if session.python == PYTHON:
        _typecheck(session, "qhoptim/optax")
    # The C++ state step must build here: its tests fail rather than skip.
    _pytest_with_conformance(
        session,
        "tests/optax",
        "tests/test_packaging.py",
        tables=("optax",),
        env={"QHOPTIM_REQUIRE_FUSED": "1"},
    )
    _doctests(session, *(str(path) for path in sorted(Path("qhoptim/optax").glob("*.py"))))


# Each Keras session installs Keras and its backend's framework, nothing else
# (tests/keras runs each backend's own checks on that backend). TensorFlow is
# tensorflow-cpu, TensorFlow without the GPU libraries, installed by name: the
# ``tensorflow`` extra would pull the full ``tensorflow`` distribution.
TENSORFLOW = ("tensorflow-cpu>=2.16.1", "keras>=3.10")
KERAS_EXTRAS = {"tensorflow": "test", "jax": "test,jax", "torch": "test,torch"}


@nox.session(python=PYTHON)
@nox.parametrize("backend", KERAS_BACKENDS, ids=list(KERAS_BACKENDS))
@timed
def keras(session: nox.Session, backend: str) -> None:
    _install(session, KERAS_EXTRAS[backend])
    session.install(*(TENSORFLOW if backend == "tensorflow" else ("keras>=3.10",)), *CONSTRAINTS)
    env = {"KERAS_BACKEND": backend}
    _pytest_with_conformance(
        session, "tests/keras", "tests/test_packaging.py", tables=("keras",), env=env
    )


@nox.session(python=PYTHON)
@timed
def distributed(session: nox.Session) -> None:
    # Every framework is installed here, so every test must run:
    # QHOPTIM_REQUIRE_ALL turns a skip into a failure (tests/distributed/conftest.py).
    _install(session, "test,torch,jax")
    session.install(*TENSORFLOW, *CONSTRAINTS)
    # qhoptim.keras is type-checked here, where every backend's framework is
    # installed (its backend modules import torch, JAX and TensorFlow).
    _typecheck(session, "qhoptim/keras")
    # A file's tests share its ranks (started once per file, a module fixture):
    # a file per worker.
    _pytest(session, "tests/distributed", "--dist", "loadfile", env={"QHOPTIM_REQUIRE_ALL": "1"})


# Where users pick an optimizer by name or hand a class to a trainer: timm's
# factory, Hugging Face's Trainer, Lightning (docs/integrations.md).
INTEGRATIONS = ("torchvision", "timm>=1.0.12", "transformers", "accelerate", "lightning")


@nox.session(python=PYTHON)
@timed
def integrations(session: nox.Session) -> None:
    constraints = ("-c", str(ROOT / ".ci" / "integrations-constraints.txt"))
    _install(session, "test,torch", *INTEGRATIONS, constraints=constraints)
    # Every package is installed here, so every test must run.
    _pytest(session, "tests/integrations", env={"QHOPTIM_REQUIRE_ALL": "1"})


@nox.session(python=PYTHON)
@timed
def mlx(session: nox.Session) -> None:
    _install(session, "test,mlx")
    session.install("scikit-learn", *CONSTRAINTS)  # the digits example's data
    _typecheck(session, "qhoptim/mlx")
    _pytest_with_conformance(
        session, "tests/mlx", "tests/test_packaging.py", tables=("mlx", "mlx-fused")
    )
    _doctests(session, "qhoptim/mlx/__init__.py")


@nox.session(python=PYTHON_LOWEST)
@timed
def lowest(session: nox.Session) -> None:
    """The lowest declared versions, tested from the unpacked sdist.

    .ci/lowest-constraints.txt pins numpy, JAX, optax, MLX, Keras and TensorFlow to
    pyproject's floors. torch is not here: every torch release on the package
    index but the CPU wheel CI pins is a multi-GB CUDA build, so torch's floor
    is the version the torch session tests (docs/torch.md says so).
    """
    tmp = Path(session.create_tmp())
    for old in tmp.iterdir():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    session.install("build>=1", *CONSTRAINTS)
    session.run("python", "-m", "build", "--sdist", "--outdir", str(tmp), str(ROOT))
    (sdist,) = tmp.glob("qhoptim-*.tar.gz")
    session.run("tar", "-xzf", str(sdist), "-C", str(tmp), external=True)
    src = tmp / sdist.name.removesuffix(".tar.gz")
    # Editable, from the unpacked sdist: tests/test_packaging.py builds its own
    # wheel and sdist from this tree and needs qhoptim out of site-packages.
    session.install("-e", f"{src}[test,jax,mlx]", "tensorflow-cpu", "keras", "pip", *LOWEST)
    session.chdir(src)
    _core_tests(session)
    _conformance(session, "numpy", "optax", "mlx", table="numpy-optax-mlx")
    for backend in ("tensorflow", "jax"):
        _conformance(session, "keras", table=f"keras-{backend}", env={"KERAS_BACKEND": backend})


@nox.session(python=PYTHON)
@timed
def sweep(session: nox.Session) -> None:
    _install(session, "jax")
    session.install("scikit-learn", "matplotlib", *CONSTRAINTS)
    # The paper's two small studies reproduced here, the parameter sweep
    # (docs/sweep.md) and QHM against AggMo (docs/aggmo.md), and QHMuon against
    # Muon (docs/muon.md); quick smoke runs unless ``nox -s sweep -- --full``.
    full = "--full" in session.posargs
    quick = [] if full else ["--quick"]
    for study in ("sweep", "aggmo", "muon"):
        out = ARTIFACTS / (study if full else f"{study}-quick")
        session.run("python", f"benchmarks/{study}.py", *quick, "--out", str(out))


@nox.session(python=PYTHON)
@timed
def demo(session: nox.Session) -> None:
    # Every backend, Keras on each of its three backends (one process each).
    # ``nox -s demo -- torch`` limits it to the extras named.
    extras = (session.posargs[0] if session.posargs else "torch,jax,tensorflow").split(",")
    _install(session, ",".join(["test", *(e for e in extras if e != "tensorflow")]))
    session.install(*(TENSORFLOW if "tensorflow" in extras else ("keras>=3.10",)), *CONSTRAINTS)
    session.run("python", "-m", "conformance.demo")


CHROMIUM = ("chromium", "chromedriver")


def _ensure_chromium(session: nox.Session) -> None:
    """Debian's Chromium and its driver for the browser test: installed here when we can.

    As root on a Debian-like system the session installs them with apt-get (as
    a fresh CI machine needs); anywhere else it stops with what to install.
    """
    if all(shutil.which(c) for c in CHROMIUM):
        return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        session.log("installing Debian's chromium and chromium-driver for the browser test")
        session.run("apt-get", "update", "-qq", external=True)
        session.run(
            "apt-get", "install", "-y", "-qq", "chromium", "chromium-driver",
            external=True, env={"DEBIAN_FRONTEND": "noninteractive"},
        )  # fmt: skip
        if all(shutil.which(c) for c in CHROMIUM):
            return
    session.error(
        "the docs session's browser test needs Chromium and its WebDriver on PATH "
        "(`chromium` and `chromedriver`): on Debian or Ubuntu, as root, "
        "`apt-get install chromium chromium-driver`; elsewhere install Chromium and the "
        "matching ChromeDriver. To build the site without the browser test, run "
        "`sphinx-build -W -b html docs docs/_build/html` in a venv with "
        '`pip install -e ".[docs,jax,torch,test]"`.'
    )


@nox.session(python=PYTHON)
@timed
def docs(session: nox.Session) -> None:
    """The documentation site: build (warnings are errors), then test it in Chromium.

    The build runs the example scripts, the conformance suite and the recovery
    suite and draws the figures (docs/_ext/qhdocs.py). Keras runs on JAX here,
    so no TensorFlow. The browser test needs Chromium and chromedriver
    (installed by the session as root on Debian, see ``_ensure_chromium``) and
    writes artifacts/docs-*.png.
    """
    _ensure_chromium(session)
    _install(session, "docs,jax,torch,mlx,test")
    session.install("scikit-learn", *CONSTRAINTS)  # the MLX digits example's data
    env = {"QHOPTIM_DOCS_STRICT": "1", "KERAS_BACKEND": "jax"}
    # The rows that sessions of this run ran in the environments the build's
    # own would be (this Python, Keras on JAX), read instead of run again; a
    # docs session run alone runs them all.
    kept = {
        backend: _TABLES_KEPT.get(name, {}).get(backend)
        for backend, name in (
            ("torch", "torch"),
            ("torch-foreach", "torch"),
            ("torch-fused", "torch"),
            ("optax", f"optax-{PYTHON}"),
            ("keras", "keras(jax)"),
            ("mlx", "mlx"),
            ("mlx-fused", "mlx"),
        )
    }
    env["QHOPTIM_DOCS_CONFORMANCE_ROWS"] = os.pathsep.join(
        f"{backend}={path}" for backend, path in kept.items() if path and path.exists()
    )
    html = ROOT / "docs" / "_build" / "html"
    session.run(
        "sphinx-build", "-W", "--keep-going", "-E", "-b", "html", "docs", str(html), env=env
    )
    session.run(
        "python", "-m", "pytest", *TEST_TIMEOUT, "tests/docs", "-p", "no:cacheprovider",
        *session.posargs,
        env={"QHOPTIM_DOCS_REQUIRE": "1", "QHOPTIM_DOCS_HTML": str(html)},
    )  # fmt: skip
