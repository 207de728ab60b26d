"""The fused CPU step's C++ extension (``csrc/fused_cpu.cpp``): an MLX primitive,
built on first use against the installed MLX and cached on disk.

The bottom layer of ``qhoptim.mlx``: it imports only MLX and the core's
:mod:`qhoptim._build` (the build, with the shared C++ headers), and, to build,
nanobind, the binding library MLX's own Python module is built with. The
optimizers (``__init__.py``) ask :func:`fused_extension` for it under
``fused=True``, and :func:`fused_extension_available` whether a bfloat16
state may step in it under ``fused=None``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sysconfig
from pathlib import Path
from typing import Any

import mlx.core as mx

from qhoptim import _build

_CSRC = Path(__file__).with_name("csrc") / "fused_cpu.cpp"


def _fail(reason: str) -> RuntimeError:
    return RuntimeError(
        f"fused=True compiles qhoptim.mlx's C++ step on first use; {reason}. "
        "Install what is missing, or use fused=False (MLX's own operations)."
    )


def fused_extension() -> Any:
    """The compiled step (built on first use, then loaded from the disk cache).

    Raises ``RuntimeError`` saying what is missing where it cannot be built,
    or where the build does not take MLX's arrays (a nanobind whose ABI is not
    the one MLX was built with).
    """
    module, reason = _built()
    if module is None:
        raise _fail(reason)
    return module


def fused_extension_available() -> bool:
    """Whether :func:`fused_extension` gives the step (it is tried once per process)."""
    return _built()[0] is not None


@functools.cache
def _built() -> tuple[Any, str]:
    """The module, or None and why not. Tried once per process; a failed
    compilation is recorded beside where the library would be and not tried
    again for the same source, MLX, nanobind, Python and CPU (delete the
    ``.failed`` file to try again). Under ``fused=None`` any failure only
    means MLX's operations step the state, so every error is caught here."""
    try:
        return _build_or_load()
    except Exception as error:  # a read-only cache, a broken install: not built
        return None, f"{type(error).__name__}: {error}"


def _build_or_load() -> tuple[Any, str]:
    compiler = _build.compiler()
    if compiler is None:
        return None, _build.NO_COMPILER
    try:
        import nanobind  # type: ignore[import-untyped]
    except ImportError:
        return None, "it needs nanobind (`pip install nanobind`)"
    name = _build.library_name(
        "qhoptim_mlx_fused_cpu",
        (_CSRC, *_build.shared_headers()),
        (_mlx_version(), nanobind.__version__),
    )
    library = _build.cache_directory("mlx") / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    reason = _build.built(library, lambda: _build_library(compiler, nanobind, name, library))
    if reason:
        return None, reason
    try:
        module = _load(name, library)
        _smoke_test(module)
    except (ImportError, TypeError, ValueError) as error:  # another nanobind ABI, a broken file
        return None, (
            f"the build in {library} does not take MLX's arrays ({error}); nanobind "
            f"{nanobind.__version__} may not be the version MLX {_mlx_version()} was built with"
        )
    return module, ""


def _mlx_version() -> str:
    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:  # MLX built from source, not installed
        return str(Path(mx.__file__).resolve().parent)


def _build_library(compiler: str, nanobind: Any, name: str, library: Path) -> str:
    """Compile the step and nanobind's own sources into ``library``
    (:func:`qhoptim._build.compile_library`): "" where built, else why not."""
    mlx_root = Path(mx.__file__).resolve().parent
    source_dir = Path(nanobind.source_dir())
    return _build.compile_library(
        compiler,
        library,
        [_CSRC, source_dir / "nb_combined.cpp"],
        include=[
            nanobind.include_dir(),
            str(source_dir.parent / "ext" / "robin_map" / "include"),
            sysconfig.get_paths()["include"],
            str(mlx_root / "include"),
        ],
        # MLX binds its arrays in nanobind's "mlx" domain; the step's module
        # joins it to take them.
        defines=["NB_DOMAIN=mlx", f"QHOPTIM_MODULE_NAME={name}"],
        link=[f"-L{mlx_root / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_root / 'lib'}"],
    )


def _load(name: str, library: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:  # pragma: no cover - a file we just built
        raise ImportError(f"{library} is not a Python extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke_test(module: Any) -> None:
    """One QHM step of one value: the module takes MLX's arrays and gives them back."""
    coefficients = mx.array([0.5, 0.5, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=mx.float32)
    one = mx.ones((1,), dtype=mx.float32)
    buffer, param = module.fused_step(
        one, one, [mx.zeros((1,), dtype=mx.float32)], coefficients, mx.zeros((0,), dtype=mx.uint32),
        False, 0, False, False, False, 0, 0,
    )  # fmt: skip
    mx.eval(buffer, param)
    if buffer.item() != 0.5 or param.item() != 0.5:
        raise ValueError(f"one step of 1.0 gave buffer {buffer.item()}, parameter {param.item()}")
