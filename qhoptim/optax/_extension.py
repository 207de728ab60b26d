"""The narrow state's C++ step (``csrc/state_cpu.cpp``): XLA custom calls for
the CPU that store a bfloat16 or an 8-bit state, built on first use against
jaxlib's XLA FFI headers and cached on disk.

The bottom layer of ``qhoptim.optax``: it imports only JAX and the core's
:mod:`qhoptim._build` and :mod:`qhoptim.rounding` (the 8-bit levels its smoke
test passes). The transformations (``__init__.py``) ask
:func:`state_extension` for the custom calls under ``fused=True``
(:data:`TARGET` stores a bfloat16 state, :data:`EIGHT_BIT_TARGET` an 8-bit
one), and :func:`state_extension_available` whether a narrow state may step
in them under ``fused=None``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qhoptim import _build, rounding

_CSRC = Path(__file__).with_name("csrc") / "state_cpu.cpp"
#: The custom calls' names, as XLA knows them, and the handlers the library exports.
TARGET = "qhoptim_store_bfloat16_state"
EIGHT_BIT_TARGET = "qhoptim_store_eight_bit_state"
_SYMBOLS = {TARGET: "QHoptimStoreBFloat16State", EIGHT_BIT_TARGET: "QHoptimStoreEightBitState"}


def _fail(reason: str) -> RuntimeError:
    return RuntimeError(
        f"fused=True compiles qhoptim.optax's C++ state step on first use; {reason}. "
        "Install what is missing, or use fused=False (XLA's own operations)."
    )


def state_extension() -> str:
    """:data:`TARGET`, once both custom calls are registered for the CPU (built
    on first use, then loaded from the disk cache).

    Raises ``RuntimeError`` saying what is missing where it cannot be built.
    """
    target, reason = _built()
    if target is None:
        raise _fail(reason)
    return target


def state_extension_available() -> bool:
    """Whether :func:`state_extension` gives the target (it is tried once per process)."""
    return _built()[0] is not None


@functools.cache
def _built() -> tuple[str | None, str]:
    """The target, or None and why not. Tried once per process; a failed
    compilation is recorded and not tried again (:func:`qhoptim._build.built`).
    Under ``fused=None`` any failure only means XLA's operations store the
    state, so every error is caught here."""
    try:
        return _build_or_load()
    except Exception as error:  # a read-only cache, a broken install: not built
        return None, f"{type(error).__name__}: {error}"


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:  # jaxlib built from source
        return str(Path(jax.ffi.include_dir()).resolve())


def _build_or_load() -> tuple[str | None, str]:
    compiler = _build.compiler()
    if compiler is None:
        return None, _build.NO_COMPILER
    name = _build.library_name(
        "qhoptim_optax_state_cpu", (_CSRC, *_build.shared_headers()), (_jaxlib_version(),)
    )
    library = _build.cache_directory("optax") / f"{name}.so"
    reason = _build.built(library, lambda: _build_library(compiler, library))
    if reason:
        return None, reason
    try:
        loaded = ctypes.CDLL(str(library))
        handlers = {target: getattr(loaded, symbol) for target, symbol in _SYMBOLS.items()}
    except (OSError, AttributeError) as error:  # a broken file
        return None, f"the build in {library} does not load ({error})"
    for target, handler in handlers.items():
        capsule = jax.ffi.pycapsule(handler)  # type: ignore[no-untyped-call]
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    _smoke_test()
    return TARGET, ""


def _build_library(compiler: str, library: Path) -> str:
    """Compile the step into ``library`` (:func:`qhoptim._build.compile_library`)."""
    return _build.compile_library(compiler, library, [_CSRC], include=[jax.ffi.include_dir()])


def _smoke_test() -> None:
    """One QHM buffer step of one value on the CPU in each call: 0.5 * 0 + 0.5 * 1
    is 0.5 in bfloat16 whatever the rounding's noise, and in 8 bits its block's
    scale with the top level's code."""
    # Evaluated now even where the first use is inside a traced function
    # (jit), which would otherwise stage these operations into its trace.
    # Under a transfer guard set for the caller's arrays, these few values move all the same.
    with (
        jax.ensure_compile_time_eval(),
        jax.transfer_guard("allow"),
        jax.default_device(jax.devices("cpu")[0]),
    ):
        weights = jnp.asarray([0.5, 0.5, 0.0, 0.0], jnp.float32)
        seeds, grad = jnp.zeros((1,), jnp.uint32), jnp.ones((1,), jnp.float32)
        shape = jax.ShapeDtypeStruct((1,), jnp.bfloat16)  # type: ignore[no-untyped-call]
        (stepped,) = jax.ffi.ffi_call(TARGET, (shape,))(
            weights, seeds, grad, jnp.zeros((1,), jnp.bfloat16), states=np.int64(1)
        )
        if float(stepped[0]) != 0.5:
            raise ValueError(f"one step of 1.0 gave the buffer {float(stepped[0])}")
        levels = [jnp.asarray(rounding.eight_bit_levels(s), jnp.float32) for s in (True, False)]
        shapes = (
            jax.ShapeDtypeStruct((1,), jnp.uint8),  # type: ignore[no-untyped-call]
            jax.ShapeDtypeStruct((1,), jnp.float32),  # type: ignore[no-untyped-call]
        )
        codes, scales = jax.ffi.ffi_call(EIGHT_BIT_TARGET, shapes)(
            weights,
            seeds,
            *levels,
            grad,
            jnp.zeros((1,), jnp.uint8),
            jnp.zeros((1,), jnp.float32),
            states=np.int64(1),
            per_octave=np.int64(rounding.EIGHT_BIT_PER_OCTAVE),
            stochastic=np.int64(1),
        )
        top = len(levels[0]) - 1
        if (int(codes[0]), float(scales[0])) != (top, 0.5):
            got = f"code {int(codes[0])}, scale {float(scales[0])}"
            raise ValueError(f"one step of 1.0 gave the 8-bit buffer {got}")
