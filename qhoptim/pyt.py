"""qhoptim 1.1.0's import path: ``from qhoptim.pyt import QHM, QHAdam, QHAdamW``.

The classes are those of :mod:`qhoptim.torch`, drop-in supersets of 1.1.0's
(``QHAdamW`` is now a class; see ``docs/torch.md``, "Migrating from qhoptim 1.1.0").
"""

from __future__ import annotations

from qhoptim.torch import QHM, QHAdam, QHAdamW

__all__ = ["QHM", "QHAdam", "QHAdamW"]
