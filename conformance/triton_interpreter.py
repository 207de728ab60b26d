"""Triton's interpreter without its repeated set-up inside a kernel.

Under ``TRITON_INTERPRET=1`` Triton runs a kernel as Python over NumPy. Each
launch first swaps every builtin of ``triton.language`` for its interpreted form
(``triton.runtime.interpreter._patch_lang``, which walks the module with
``inspect.getmembers``) and swaps them back when the launch ends. It does the
same again for every call of a ``@triton.jit`` helper from inside the kernel,
though the launch has already swapped everything: the helper's module globals
are the kernel's, so it finds the same modules, already patched. qhoptim's
kernels call about forty helpers per program (loads, stores, the rounding rule),
and that repeated walk was half of an interpreted step.

:func:`skip_repeated_patching` makes the nested call a no-op when the helper
shares the launched kernel's globals, and leaves every other call as Triton
wrote it. What the kernels compute is unchanged: the builtins a helper sees are
the ones the launch installed. The tests and the ``torch-triton`` conformance
rows call it; qhoptim itself never patches Triton. With a Triton whose
interpreter is organised differently (no ``_patch_lang``), it does nothing.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["skip_repeated_patching"]

_MARK = "_qhoptim_skips_repeated_patching"


class _NothingToRestore:
    def restore(self) -> None:
        pass


def skip_repeated_patching() -> bool:
    """Skip the interpreter's re-patching inside a launch; True where it applies.

    Only under ``TRITON_INTERPRET=1`` with Triton installed; calling it twice
    is harmless.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return False
    if getattr(patch_lang, _MARK, False):
        return True
    # One entry per launch in progress: its kernel's globals, and whether the
    # launch's own patch is in place yet.
    launches: list[list[Any]] = []
    launch = executor.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches.append([self.fn.__globals__, False])
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def _patch_lang(fn: Any) -> Any:
        if launches and getattr(fn, "__globals__", None) is launches[-1][0]:
            if launches[-1][1]:
                return _NothingToRestore()  # a helper of the running kernel
            launches[-1][1] = True
        return patch_lang(fn)

    setattr(_patch_lang, _MARK, True)
    executor.__call__ = __call__
    interpreter._patch_lang = _patch_lang
    return True
