"""What the hyperparameter advisor (docs/_static/advisor.js) must answer, from qhoptim itself.

:func:`advise` is the advisor's logic written with :mod:`qhoptim.convert` and
:mod:`qhoptim.analysis`; :data:`CASES` are the inputs the browser test types
into the advisor page. The docs build writes ``advisor_cases.json`` (inputs and
these answers) into the site, and ``tests/docs/test_site.py`` checks that the
page's answers equal :func:`advise`'s for every case.

The suggested starting point is the paper's (Ma & Yarats, 2019):

* QHM: ``nu = 0.7, beta = 0.999`` (Sec. 7.1) with the learning rate converted
  to QHM's normalized buffer, ``alpha = lr / (1 - momentum)`` -- the
  conversion of the exact equivalent, so the effective step size is kept.
* QHAdam: ``nu1 = 0.7, beta1 = 0.999`` (the QH default of the parameter
  sweeps, Sec. 6.1, which fix ``nu2 = 1``), ``nu2 = 1`` and ``beta2``, ``lr``
  and ``eps`` unchanged (Sec. 5 and 7.1: "nu2 = 1 and beta2 unchanged is usually
  reasonable"; Adam's buffers are already normalized).
"""

from __future__ import annotations

import math
from typing import Any

from qhoptim import analysis, convert

SUGGESTED_QHM = {"nu": 0.7, "momentum": 0.999}
SUGGESTED_QHADAM = {"nu1": 0.7, "beta1": 0.999, "nu2": 1.0}

# Inputs exactly as typed into the form (strings; "nesterov" is a checkbox).
CASES: list[dict[str, Any]] = [
    {"optimizer": "sgd", "lr": "0.1", "momentum": "0.9", "nesterov": True},
    {"optimizer": "sgd", "lr": "0.1", "momentum": "0.9", "nesterov": False},
    {"optimizer": "sgd", "lr": "0.01", "momentum": "0.99", "nesterov": True},
    {"optimizer": "sgd", "lr": "0.05", "momentum": "0.95", "nesterov": False},
    {"optimizer": "sgd", "lr": "0.003", "momentum": "0.999", "nesterov": True},
    {"optimizer": "sgd", "lr": "1.5", "momentum": "0.5", "nesterov": False},
    {"optimizer": "sgd", "lr": "0.1", "momentum": "0", "nesterov": False},
    {"optimizer": "sgd", "lr": "0.2", "momentum": "0", "nesterov": True},
    {"optimizer": "sgd", "lr": "0", "momentum": "0.9", "nesterov": False},
    {"optimizer": "sgd", "lr": "1e-3", "momentum": "0.875", "nesterov": True},
    {"optimizer": "sgd", "lr": "0.1", "momentum": "1", "nesterov": False},
    {"optimizer": "sgd", "lr": "0.1", "momentum": "1.2", "nesterov": True},
    {"optimizer": "sgd", "lr": "0.1", "momentum": "-0.1", "nesterov": False},
    {"optimizer": "sgd", "lr": "-0.1", "momentum": "0.9", "nesterov": False},
    {"optimizer": "sgd", "lr": "inf", "momentum": "0.9", "nesterov": False},
    {"optimizer": "sgd", "lr": "nan", "momentum": "0.9", "nesterov": True},
    {"optimizer": "adam", "lr": "1e-3", "beta1": "0.9", "beta2": "0.999", "eps": "1e-8"},
    {"optimizer": "adam", "lr": "3e-4", "beta1": "0.9", "beta2": "0.98", "eps": "1e-9"},
    {"optimizer": "adam", "lr": "5e-4", "beta1": "0.95", "beta2": "0.98", "eps": "1e-8"},
    {"optimizer": "adam", "lr": "0.001", "beta1": "0.9", "beta2": "0.99", "eps": "1e-7"},
    {"optimizer": "adam", "lr": "2e-3", "beta1": "0.5", "beta2": "0.999", "eps": "0"},
    {"optimizer": "adam", "lr": "1e-3", "beta1": "0", "beta2": "0.999", "eps": "1e-8"},
    {"optimizer": "adam", "lr": "1e-3", "beta1": "0.9", "beta2": "0.9999", "eps": "1e-6"},
    {"optimizer": "adam", "lr": "1e-3", "beta1": "1", "beta2": "0.999", "eps": "1e-8"},
    {"optimizer": "adam", "lr": "1e-3", "beta1": "0.9", "beta2": "1.5", "eps": "1e-8"},
    {"optimizer": "adam", "lr": "1e-3", "beta1": "0.9", "beta2": "0.999", "eps": "-1e-8"},
    {"optimizer": "adam", "lr": "-1", "beta1": "0.9", "beta2": "0.999", "eps": "1e-8"},
]

FIELDS = {"sgd": ("lr", "momentum"), "adam": ("lr", "beta1", "beta2", "eps")}


def _bound(nu1: float, beta1: float, nu2: float, beta2: float) -> float | None:
    """The limit per-step bound, or ``None`` where it is undefined (or infinite)."""
    try:
        value = analysis.qhadam_update_bound(nu1, beta1, nu2, beta2)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def advise(case: dict[str, Any]) -> dict[str, Any]:
    """The advisor's answer for one input: ``{"error": ...}`` or the two settings.

    ``error`` is ``{"name": ..., "message": ...}`` with the message of the
    ``ValueError`` that :mod:`qhoptim.convert` raises.
    """
    values = {k: float(case[k]) for k in FIELDS[case["optimizer"]]}
    try:
        if case["optimizer"] == "sgd":
            lr, momentum = values["lr"], values["momentum"]
            if case["nesterov"]:
                fn, p = "from_nesterov", convert.from_nesterov(lr, momentum)
            elif momentum == 0.0:
                fn, p = "from_sgd", convert.from_sgd(lr)
            else:
                fn, p = "from_momentum", convert.from_momentum(lr, momentum)
            return {
                "function": fn,
                "exactness": "exact",
                "equivalent": {"optimizer": "qhm", "lr": p.lr, "momentum": p.momentum, "nu": p.nu},
                "suggested": {"optimizer": "qhm", "lr": p.lr, **SUGGESTED_QHM},
            }
        q = convert.from_adam(values["lr"], (values["beta1"], values["beta2"]), values["eps"])
    except ValueError as e:
        message = str(e)
        return {"error": {"name": message.split(" must ")[0], "message": message}}
    (b1, b2), (n1, n2) = q.betas, q.nus
    s = SUGGESTED_QHADAM
    return {
        "function": "from_adam",
        "exactness": "exact",
        "equivalent": {
            "optimizer": "qhadam",
            "lr": q.lr,
            "beta1": b1,
            "beta2": b2,
            "nu1": n1,
            "nu2": n2,
            "eps": q.eps,
            "bound": _bound(n1, b1, n2, b2),
        },
        "suggested": {
            "optimizer": "qhadam",
            "lr": q.lr,
            "beta1": s["beta1"],
            "beta2": b2,
            "nu1": s["nu1"],
            "nu2": s["nu2"],
            "eps": q.eps,
            "bound": _bound(s["nu1"], s["beta1"], s["nu2"], b2),
        },
    }


def table() -> list[dict[str, Any]]:
    """Every case with its expected answer (what the build writes as JSON)."""
    return [{"input": case, "expected": advise(case)} for case in CASES]
