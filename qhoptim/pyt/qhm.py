"""qhoptim 1.1.0's module of ``QHM``: ``from qhoptim.pyt.qhm import QHM`` (and
1.1.0's pickles, which name the class here) finds :class:`qhoptim.pyt.QHM`."""

from qhoptim.pyt import QHM

__all__ = ["QHM"]
