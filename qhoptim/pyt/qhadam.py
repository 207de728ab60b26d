"""qhoptim 1.1.0's module of ``QHAdam`` and ``QHAdamW``: ``from
qhoptim.pyt.qhadam import QHAdam`` (and 1.1.0's pickles, which name the classes
here) finds :class:`qhoptim.pyt.QHAdam` and :class:`qhoptim.pyt.QHAdamW`."""

from qhoptim.pyt import QHAdam, QHAdamW

__all__ = ["QHAdam", "QHAdamW"]
