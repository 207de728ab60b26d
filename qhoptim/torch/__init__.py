r"""QHM, QHAdam, QHAdamW and QHMuon for PyTorch (``torch.optim.Optimizer`` subclasses).

The layout follows ``torch/optim``: one module per optimizer (``_qhm.py``,
``_qhadam.py``, ``_qhmuon.py``) holding the class and its functional entry point (:func:`qhm`,
:func:`qhadam`), which dispatches to a per-tensor (``_single_tensor_*``), a
multi-tensor (``_multi_tensor_*``) or a fused implementation; the base class
the two share is in ``_optimizer.py``. Below them, each importing only the
layers beneath it: ``_state_dict.py`` (state-dict checks) and ``_fused.py``
(``fused=True``: ``csrc/`` on CPU, ``_triton.py`` on CUDA); ``_kernels.py``
(every piece of tensor arithmetic, its coefficients from
:mod:`qhoptim.rules`) and ``_state_dtype.py`` (narrow state); at the bottom
``_tensors.py`` (tensor lists, flags) and ``_extension.py`` (the C++ build).
``docs/design.md`` draws the layers; ``tests/test_layers.py`` holds the code to
them.

This package imports only torch and the qhoptim core.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised where torch is absent
    raise ImportError(
        "qhoptim.torch needs PyTorch, which is not installed. "
        'Install it with `pip install "qhoptim[torch]"`.'
    ) from error

from qhoptim.torch._qhadam import QHAdam, QHAdamW, qhadam
from qhoptim.torch._qhm import QHM, qhm
from qhoptim.torch._qhmuon import QHMuon, qhmuon
from qhoptim.torch._timm import register_with_timm

__all__ = ["QHM", "QHAdam", "QHAdamW", "QHMuon", "qhadam", "qhm", "qhmuon", "register_with_timm"]
