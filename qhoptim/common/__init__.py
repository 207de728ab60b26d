"""qhoptim 1.1.0's ``qhoptim.common``: its one public member, :mod:`~qhoptim.common.param_conv`.

New code calls :mod:`qhoptim.convert`, which ``param_conv`` wraps.
"""

from __future__ import annotations

from . import param_conv

__all__ = ["param_conv"]
