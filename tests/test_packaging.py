"""The wheel: it holds every module of the source tree and imports on its own.

A wheel is built from a copy of the checkout (so the build writes no
``build/`` or ``*.egg-info`` into it and cannot pick up a stale ``build/lib``),
installed with ``pip install --target`` into a scratch directory, and imported
in a fresh interpreter that cannot see the checkout. The built and installed
wheel is kept under a digest of everything it is made from (the files copied,
the Python, setuptools and pip versions), so the test processes of one run, and
the nox sessions that share a Python (``$QHOPTIM_WHEEL_CACHE``, set by
noxfile.py), build it once; any changed file is a new build:

* ``python -I``: no ``PYTHONPATH``, no user site-packages, no script directory
  or cwd on ``sys.path`` -- and the cwd is a scratch directory anyway;
* the environment's own site-packages stay, so the installed frameworks
  (torch, keras, optax) remain importable; an *editable* install of qhoptim
  there (``pip install -e .``, as every nox session does) is switched off by
  dropping its meta-path finder and any path entry that is the checkout;
* every imported module's ``__file__`` must lie in the scratch directory, so
  a module missing from the wheel cannot be found anywhere else unnoticed.

The core modules are checked in every environment. Each backend is checked
where its framework is installed (``test_backend_imports_from_the_wheel``,
skipped with the reason otherwise); where it is not, importing the backend
must raise an ``ImportError`` that names the framework and the extra to
install (``test_backend_without_its_framework_raises_import_error``). Every
nox session runs this file, so each backend is imported from the wheel in the
session that installs its framework, and refused in those that do not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qhoptim"

CORE_MODULES = (
    "qhoptim",
    "qhoptim.rules",
    "qhoptim.validation",
    "qhoptim.convert",
    "qhoptim.analysis",
    "qhoptim.reference",
    "qhoptim.common",
    "qhoptim.common.param_conv",
    "qhoptim.version",
)
# Each backend module -> the top-level packages it needs (its extra's).
BACKENDS: dict[str, tuple[str, ...]] = {
    "qhoptim.torch": ("torch",),
    "qhoptim.pyt": ("torch",),
    "qhoptim.keras": ("keras",),
    "qhoptim.optax": ("jax", "optax"),
    "qhoptim.mlx": ("mlx",),
}

# Runs in the isolated interpreter: argv = [site, repo, module, ...]; prints
# {module: {"file": ...} | {"error": type, "message": ..., "name": ...}}.
_PROBE = r"""
import importlib, importlib.metadata, json, os, sys

site, repo, modules = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3:]


def _module_of(obj):
    return getattr(obj if isinstance(obj, type) else type(obj), "__module__", "") or ""


# An editable install of qhoptim (a meta-path finder, or a path entry that is
# the checkout) must not stand in for a module the wheel lacks.
sys.meta_path[:] = [f for f in sys.meta_path if not _module_of(f).startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _module_of(h).startswith("__editable__")]
sys.path[:] = [site] + [
    p for p in sys.path if p and "__editable__" not in p and os.path.realpath(p) != repo
]
sys.path_importer_cache.clear()

try:
    version = importlib.metadata.version("qhoptim")
except importlib.metadata.PackageNotFoundError:
    version = None
out = {"version": version, "modules": {}}
for name in modules:
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        out["modules"][name] = {"error": type(e).__name__, "message": str(e), "name": e.name}
    else:
        out["modules"][name] = {"file": module.__file__}
print("QHOPTIM-PROBE", json.dumps(out))
"""


class Wheel(NamedTuple):
    path: Path
    site: Path  # where it is installed (``pip install --target``)


def _pip(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-cache-dir"]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")


def _has_build_backend() -> bool:
    # pyproject's [build-system] requires setuptools>=77.
    version = _version_of("setuptools")
    return version is not None and int(version.split(".")[0]) >= 77


def _wheel_inputs_digest() -> str:
    """A digest of what ``build_and_install`` makes the wheel from, and with."""
    digest = hashlib.sha256()
    files = [p for p in REPO.iterdir() if p.is_file()]
    files += [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(files):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    tools = [sys.version, *(str(_version_of(d)) for d in ("setuptools", "pip"))]
    digest.update("\0".join(tools).encode())
    return digest.hexdigest()[:20]


def _version_of(distribution: str) -> str | None:
    """``distribution``'s installed version; ``None`` where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def built_and_installed(cache: Path) -> Wheel:
    """``build_and_install``'s wheel, built once per digest of its inputs under ``cache``.

    Processes that ask at once wait for the first one's build (a file lock
    where the platform has ``fcntl``; elsewhere each may build, and the first
    to finish is kept). The eight most recent builds are kept.
    """
    cache.mkdir(parents=True, exist_ok=True)
    kept = cache / f"qhoptim-wheel-{_wheel_inputs_digest()}"
    with _locked(cache / f"{kept.name}.lock"):
        if not kept.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
            build_and_install(scratch)
            shutil.rmtree(scratch / "src")
            try:
                scratch.rename(kept)
            except OSError:  # another process kept its build first
                shutil.rmtree(scratch, ignore_errors=True)
    builds = sorted(
        (p for p in cache.glob("qhoptim-wheel-*") if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    for old in builds[:-8]:
        if old != kept:
            shutil.rmtree(old, ignore_errors=True)
            Path(f"{old}.lock").unlink(missing_ok=True)
    (wheel,) = (kept / "dist").glob("qhoptim-*.whl")
    return Wheel(wheel, kept / "site")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no lock; a second build is only slower
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_and_install(tmp: Path) -> Wheel:
    """Build the wheel from a copy of the checkout and install it under ``tmp/site``."""
    src = tmp / "src"
    src.mkdir()
    for item in REPO.iterdir():  # pyproject.toml, README.md, any other top-level file
        if item.is_file():
            shutil.copy2(item, src / item.name)
    shutil.copytree(PACKAGE, src / "qhoptim", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    # With setuptools in this environment the build needs no network; otherwise
    # pip fetches the build backend into an isolated environment.
    isolation = ["--no-build-isolation"] if _has_build_backend() else []
    _pip("wheel", "--no-deps", *isolation, "-w", str(dist), str(src), cwd=tmp)
    (wheel,) = dist.glob("qhoptim-*.whl")
    site = tmp / "site"
    _pip(
        "install",
        "--no-deps",
        "--no-index",
        "--no-compile",
        "--target",
        str(site),
        str(wheel),
        cwd=tmp,
    )
    return Wheel(wheel, site)


def import_from_wheel(wheel: Wheel, modules: list[str], cwd: Path) -> dict[str, object]:
    """Import ``modules`` in an isolated interpreter that sees only the installed wheel."""
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _PROBE, str(wheel.site), str(REPO), *modules],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    # A framework may print on import; the probe's line is marked.
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("QHOPTIM-PROBE ")]
    result: dict[str, object] = json.loads(line.removeprefix("QHOPTIM-PROBE "))
    return result


def assert_imported_from_wheel(wheel: Wheel, result: dict[str, object], module: str) -> None:
    modules = result["modules"]
    assert isinstance(modules, dict)
    outcome = modules[module]
    assert "file" in outcome, f"import {module} from the wheel failed: {outcome}"
    file = Path(outcome["file"]).resolve()
    assert file.is_relative_to(wheel.site.resolve()), f"{module} came from {file}"


# The extra that installs each backend's framework, named by its ImportError.
EXTRAS = {
    "qhoptim.torch": "qhoptim[torch]",
    "qhoptim.pyt": "qhoptim[torch]",
    "qhoptim.keras": "qhoptim[tensorflow]",
    "qhoptim.optax": "qhoptim[jax]",
    "qhoptim.mlx": "qhoptim[mlx]",
}
# qhoptim.keras imports the module of the active Keras backend only.
KERAS_BACKEND_MODULES = {"tensorflow": "qhoptim.keras._tensorflow", "torch": "qhoptim.keras._torch"}


def with_backend_modules(module: str) -> list[str]:
    """``module`` and, for ``qhoptim.keras``, its module for the active Keras backend."""
    if module != "qhoptim.keras":
        return [module]
    backend = KERAS_BACKEND_MODULES.get(os.environ.get("KERAS_BACKEND", "tensorflow"))
    return [module, *([backend] if backend else [])]


def assert_import_error_names_framework(
    result: dict[str, object], module: str, frameworks: tuple[str, ...]
) -> None:
    modules = result["modules"]
    assert isinstance(modules, dict)
    outcome = modules[module]
    assert "error" in outcome, f"{module} imported without {frameworks}: {outcome}"
    # The error is about a framework, not about the backend module missing
    # from the wheel (that would be ModuleNotFoundError naming qhoptim.*).
    assert not str(outcome["name"] or "").startswith("qhoptim"), outcome
    # The framework named apart from the module's own name (qhoptim.torch holds "torch").
    message = str(outcome["message"]).replace(module, "")
    assert any(f in message or outcome["name"] == f for f in frameworks), outcome
    assert EXTRAS[module] in outcome["message"], f"{module}'s ImportError names no extra: {outcome}"


def frameworks_installed(module: str) -> bool:
    """Whether every framework the backend ``module`` needs is importable here."""
    return all(framework_installed(f) for f in BACKENDS[module])


@functools.cache
def framework_installed(framework: str) -> bool:
    """Whether ``framework`` is importable in this environment.

    Asked of an isolated interpreter: in pytest's own process ``tests/`` is on
    ``sys.path``, where ``tests/optax/`` etc. pass for namespace packages.
    """
    code = "import importlib.util, sys; print(importlib.util.find_spec(sys.argv[1]) is not None)"
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, framework],
        cwd=Path(tempfile.gettempdir()),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return proc.stdout.strip() == "True"


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Wheel:
    # Without $QHOPTIM_WHEEL_CACHE: beside this run's temporary folders, which
    # pytest-xdist's workers share (the parent of each worker's base folder).
    cache = os.environ.get("QHOPTIM_WHEEL_CACHE")
    return built_and_installed(
        Path(cache).resolve() if cache else tmp_path_factory.getbasetemp().parent / "wheels"
    )


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory outside the checkout."""
    assert not tmp_path.resolve().is_relative_to(REPO)
    return tmp_path


def test_wheel_holds_every_source_module_and_py_typed(wheel: Wheel) -> None:
    with zipfile.ZipFile(wheel.path) as zf:
        names = set(zf.namelist())
    # Python modules and the C++ sources of the fused CPU kernels (compiled on
    # first use) and the header they share.
    sources = {
        p.relative_to(REPO).as_posix()
        for pattern in ("*.py", "*.cpp", "*.h")
        for p in PACKAGE.rglob(pattern)
        if "__pycache__" not in p.parts
    }
    assert {"qhoptim/__init__.py", "qhoptim/rules.py", "qhoptim/csrc/rounding.h"} <= sources
    missing = sorted(sources - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert "qhoptim/py.typed" in names
    # The license travels in the wheel (PEP 639: dist-info/licenses/).
    assert f"qhoptim-{_version_in_source()}.dist-info/licenses/LICENSE" in names, sorted(names)
    # Nothing but the package itself: no tests/, conformance/, benchmarks/.
    strays = sorted(n for n in names if n.split("/")[0] != "qhoptim" and ".dist-info/" not in n)
    assert not strays, strays


def _version_in_source() -> str:
    from qhoptim import __version__

    return __version__


def test_sdist_holds_what_its_tests_import(tmp_path: Path) -> None:
    """The sdist is a source release: its tests and the conformance suite they import ride along."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO, src,
        ignore=shutil.ignore_patterns(".git", ".nox", "__pycache__", "_build", "artifacts",
                                      "*.egg-info", "build", "dist"),
    )  # fmt: skip
    dist = tmp_path / "dist"
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(dist)], cwd=src, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sdist = dist / proc.stdout.strip().splitlines()[-1]
    top = f"qhoptim-{_version_in_source()}"
    assert sdist.name == f"{top}.tar.gz"
    with tarfile.open(sdist) as tf:
        names = {n.removeprefix(f"{top}/") for n in tf.getnames()}
    needed = {
        p.relative_to(REPO).as_posix()
        for folder in ("qhoptim", "tests", "conformance", "benchmarks")
        for pattern in ("*.py", "*.toml", "*.cpp", "*.h")
        for p in (REPO / folder).rglob(pattern)
        if "__pycache__" not in p.parts
    }
    needed |= {"LICENSE", "README.md", "pyproject.toml", "noxfile.py", ".ci/constraints.txt"}
    missing = sorted(needed - names)
    assert not missing, f"files missing from the sdist: {missing}"


def test_core_modules_import_from_the_wheel(wheel: Wheel, outside: Path) -> None:
    result = import_from_wheel(wheel, list(CORE_MODULES), outside)
    for module in CORE_MODULES:
        assert_imported_from_wheel(wheel, result, module)
    from qhoptim import __version__

    assert result["version"] == __version__


@pytest.mark.parametrize("module", list(BACKENDS))
def test_backend_imports_from_the_wheel(wheel: Wheel, outside: Path, module: str) -> None:
    if not frameworks_installed(module):
        missing = ", ".join(f for f in BACKENDS[module] if not framework_installed(f))
        pytest.skip(f"{missing} not installed here; {module} is checked where it is")
    modules = with_backend_modules(module)
    result = import_from_wheel(wheel, modules, outside)  # KERAS_BACKEND is inherited
    for name in modules:
        assert_imported_from_wheel(wheel, result, name)


@pytest.mark.parametrize("module", list(BACKENDS))
def test_backend_without_its_framework_raises_import_error(
    wheel: Wheel, outside: Path, module: str
) -> None:
    if frameworks_installed(module):
        needs = " and ".join(BACKENDS[module])
        pytest.skip(f"{needs} installed here: test_backend_imports_from_the_wheel checks {module}")
    result = import_from_wheel(wheel, [module], outside)
    missing = tuple(f for f in BACKENDS[module] if not framework_installed(f))
    assert_import_error_names_framework(result, module, missing)


def test_isolated_interpreter_sees_neither_checkout_nor_editable_install(outside: Path) -> None:
    # With an empty "site", qhoptim must be unimportable: neither the checkout
    # (conformance/ lives only there) nor an editable install of qhoptim leaks in.
    empty = outside / "empty-site"
    empty.mkdir()
    result = import_from_wheel(
        Wheel(outside / "none.whl", empty), ["qhoptim", "conformance"], outside
    )
    modules = result["modules"]
    assert isinstance(modules, dict)
    assert modules["qhoptim"].get("name") == "qhoptim", modules
    assert modules["conformance"].get("name") == "conformance", modules
