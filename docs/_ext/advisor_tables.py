"""The hyperparameter advisor's tables, computed from qhoptim when the docs are built.

The advisor page (``docs/advisor.md``) shows, for common settings of SGD,
momentum, Nesterov, Adam, NAdam and RMSProp, the exact QH equivalent
(:mod:`qhoptim.convert`), the paper's suggested starting point, QHAdam's
per-step bound (:mod:`qhoptim.analysis`) and the line to paste for each
framework. Nothing here computes a hyperparameter: every number is returned by
a qhoptim function, so the page cannot disagree with the library (there is no
second copy of the math, in Python or in the browser).

``docs/_ext/qhdocs.py`` calls :func:`markdown` at ``builder-inited`` and writes
the result to ``docs/_generated/inc/advisor.md``, which the page includes.
``tests/docs/test_site.py`` reads the rendered tables in Chromium and checks
them against :mod:`qhoptim.convert` and :mod:`qhoptim.analysis` itself.

The suggested starting point is the paper's (Ma & Yarats, 2019):

* QHM: ``nu = 0.7, momentum = 0.999`` (Sec. 7.1) at the exact equivalent's
  learning rate -- the one that keeps the effective step size;
* QHAdam: ``nu1 = 0.7, beta1 = 0.999`` (the QH default of the parameter
  sweeps, Sec. 6.1, which fix ``nu2 = 1``), ``nu2 = 1`` and the exact
  equivalent's ``beta2``, ``lr`` and ``eps`` (Sec. 5 and 7.1: "nu2 = 1 and
  beta2 unchanged is usually reasonable").
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

from qhoptim import analysis, convert, validation

SUGGESTED_QHM = {"nu": 0.7, "momentum": 0.999}
SUGGESTED_QHADAM = {"nu1": 0.7, "beta1": 0.999, "nu2": 1.0}

Params = convert.QHMParams | convert.QHAdamParams


@dataclass(frozen=True)
class Family:
    """One source optimizer: its settings, and the conversion that applies."""

    key: str
    title: str
    function: str  # the qhoptim.convert function
    inputs: tuple[str, ...]  # the source's hyperparameters, as the table's columns
    settings: tuple[dict[str, float], ...]
    exact: bool  # False: the conversion holds modulo bias correction
    intro: str
    example: dict[str, float]  # the setting whose convert call the section quotes

    @property
    def optimizer(self) -> str:
        return (
            "qhm" if self.function in ("from_sgd", "from_momentum", "from_nesterov") else "qhadam"
        )


def _grid(**axes: tuple[float, ...]) -> tuple[dict[str, float], ...]:
    rows: list[dict[str, float]] = [{}]
    for name, values in axes.items():
        rows = [row | {name: v} for row in rows for v in values]
    return tuple(rows)


SGD_LRS = (0.001, 0.01, 0.05, 0.1)
MOMENTA = (0.9, 0.95, 0.99)
ADAM_LRS = (1e-4, 3e-4, 1e-3)
ADAM_BETAS = ((0.9, 0.999), (0.9, 0.99), (0.9, 0.98), (0.9, 0.95))

FAMILIES: tuple[Family, ...] = (
    Family(
        key="momentum",
        title="SGD with momentum",
        function="from_momentum",
        inputs=("lr", "momentum"),
        settings=_grid(lr=SGD_LRS, momentum=MOMENTA),
        exact=True,
        example={"lr": 0.1, "momentum": 0.9},
        intro="`torch.optim.SGD(params, lr, momentum)` (dampening 0), `optax.sgd(lr, momentum)`, "
        "`keras.optimizers.SGD(lr, momentum)`: QHM with ν = 1 at `lr / (1 − momentum)`, "
        "because QHM's buffer is an average.",
    ),
    Family(
        key="nesterov",
        title="Nesterov momentum (NAG)",
        function="from_nesterov",
        inputs=("lr", "momentum"),
        settings=_grid(lr=SGD_LRS, momentum=MOMENTA),
        exact=True,
        example={"lr": 0.1, "momentum": 0.9},
        intro="The same optimizers with `nesterov=True`: QHM with ν = β (Sec. 4.1).",
    ),
    Family(
        key="sgd",
        title="Plain SGD",
        function="from_sgd",
        inputs=("lr",),
        settings=_grid(lr=(0.01, 0.1, 1.0)),
        exact=True,
        example={"lr": 0.1},
        intro="No momentum: QHM with ν = 0 (its buffer is never read). The starting point "
        "adds a β = 0.999 buffer at the same learning rate.",
    ),
    Family(
        key="adam",
        title="Adam",
        function="from_adam",
        inputs=("lr", "beta1", "beta2", "eps"),
        settings=tuple(
            {"lr": lr, "beta1": b1, "beta2": b2, "eps": 1e-8}
            for (b1, b2) in ADAM_BETAS
            for lr in ADAM_LRS
        ),
        exact=True,
        example={"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        intro="`torch.optim.Adam`, `optax.adam` (ε after bias correction): QHAdam with "
        "ν₁ = ν₂ = 1. Adam's β₂ decides whether the paper's β₁ = 0.999 keeps the step "
        "bounded (it needs β₂ > 0.999²).",
    ),
    Family(
        key="nadam",
        title="NAdam",
        function="from_nadam",
        inputs=("lr", "beta1", "beta2", "eps"),
        settings=(
            {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
            {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
            {"lr": 1e-3, "beta1": 0.9, "beta2": 0.98, "eps": 1e-8},
        ),
        exact=False,
        example={"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        intro="Dozat's NAdam with a constant momentum (μₜ = β₁): QHAdam with ν₁ = β₁, "
        "**modulo bias correction** (the two correct their first moments differently). "
        "`torch.optim.NAdam` and `keras.optimizers.Nadam` schedule μₜ by default; that "
        "schedule has no QHAdam equivalent.",
    ),
    Family(
        key="rmsprop",
        title="RMSProp",
        function="from_rmsprop",
        inputs=("lr", "alpha", "eps"),
        settings=(
            {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8},
            {"lr": 1e-3, "alpha": 0.99, "eps": 1e-8},
            {"lr": 1e-3, "alpha": 0.9, "eps": 1e-8},
        ),
        exact=False,
        example={"lr": 1e-2, "alpha": 0.99, "eps": 1e-8},
        intro="`torch.optim.RMSprop(lr, alpha, eps)` (not centered, no momentum): QHAdam "
        "with ν = (0, 1) and β₂ = α, **modulo bias correction** (QHAdam divides the second "
        "moment by 1 − αᵗ). The starting point adds a first moment, as for Adam; the paper "
        "gives no RMSProp-specific advice.",
    ),
)

FRAMEWORKS = (
    ("torch", "PyTorch", "from qhoptim.torch import QHM, QHAdam"),
    ("keras", "Keras 3", "from qhoptim.keras import QHM, QHAdam"),
    ("optax", "optax", "import qhoptim.optax as qho"),
)

# Header labels of the source's hyperparameters.
INPUT_LABELS = {"lr": "lr", "momentum": "momentum", "beta1": "β₁", "beta2": "β₂", "eps": "ε"}
INPUT_LABELS["alpha"] = "alpha"


# --------------------------------------------------------------- computing
def exact_equivalent(family: Family, setting: dict[str, float]) -> Params:
    """The exact (or modulo-bias-correction) QH equivalent: a :mod:`qhoptim.convert` call."""
    fn = getattr(convert, family.function)
    s = setting
    if family.function == "from_sgd":
        return fn(s["lr"])
    if family.function in ("from_momentum", "from_nesterov"):
        return fn(s["lr"], s["momentum"])
    if family.function == "from_rmsprop":
        return fn(s["lr"], s["alpha"], s["eps"])
    return fn(s["lr"], (s["beta1"], s["beta2"]), s["eps"])


def suggested_start(p: Params) -> Params:
    """The paper's starting point from the exact equivalent ``p`` (validated)."""
    if isinstance(p, convert.QHMParams):
        q: Params = p._replace(**SUGGESTED_QHM)
        validation.check_qhm(lr=q.lr, momentum=q.momentum, nu=q.nu)
        return q
    s = SUGGESTED_QHADAM
    q = p._replace(betas=(s["beta1"], p.betas[1]), nus=(s["nu1"], s["nu2"]))
    validation.check_qhadam(
        lr=q.lr, beta1=q.betas[0], beta2=q.betas[1], nu1=q.nus[0], nu2=q.nus[1], eps=q.eps
    )
    return q


def update_bound(p: Params) -> float | None:
    """:func:`qhoptim.analysis.qhadam_update_bound` (t → ∞), ``None`` where it does not exist."""
    if not isinstance(p, convert.QHAdamParams):
        return None
    try:
        value = analysis.qhadam_update_bound(p.nus[0], p.betas[0], p.nus[1], p.betas[1])
    except ValueError:  # outside 0 < beta1 < sqrt(beta2) < 1
        return None
    return value if math.isfinite(value) else None


def call(family: Family, setting: dict[str, float]) -> str:
    """The :mod:`qhoptim.convert` call of a row, as Python source."""
    s = {k: show(v) for k, v in setting.items()}
    if family.function == "from_sgd":
        args = f"lr={s['lr']}"
    elif family.function in ("from_momentum", "from_nesterov"):
        args = f"lr={s['lr']}, momentum={s['momentum']}"
    elif family.function == "from_rmsprop":
        args = f"lr={s['lr']}, alpha={s['alpha']}, eps={s['eps']}"
    else:
        args = f"lr={s['lr']}, betas=({s['beta1']}, {s['beta2']}), eps={s['eps']}"
    return f"convert.{family.function}({args})"


def out_of_range() -> list[tuple[str, str]]:
    """What :mod:`qhoptim.convert` says for settings it cannot convert (call, message)."""
    calls = (
        ("convert.from_momentum(lr=0.1, momentum=1.0)", lambda: convert.from_momentum(0.1, 1.0)),
        ("convert.from_nesterov(lr=-0.1, momentum=0.9)", lambda: convert.from_nesterov(-0.1, 0.9)),
        (
            "convert.from_adam(lr=1e-3, betas=(0.9, 1.0), eps=1e-8)",
            lambda: convert.from_adam(1e-3, (0.9, 1.0), 1e-8),
        ),
        (
            "convert.from_adam(lr=1e-3, betas=(0.9, 0.999), eps=-1e-8)",
            lambda: convert.from_adam(1e-3, (0.9, 0.999), -1e-8),
        ),
        (
            "convert.from_rmsprop(lr=float('nan'), alpha=0.99, eps=1e-8)",
            lambda: convert.from_rmsprop(math.nan, 0.99, 1e-8),
        ),
    )
    rows = []
    for source, fn in calls:
        try:
            fn()
        except ValueError as e:
            rows.append((source, f"ValueError: {e}"))
        else:  # pragma: no cover - would mean convert accepts a bad value
            raise AssertionError(f"{source} did not raise")
    return rows


# --------------------------------------------------------------- rendering
def show(x: float) -> str:
    """A number as the page prints it: 12 significant digits, written as Python would."""
    return repr(float(f"{x:.12g}"))


def _pair(a: float, b: float) -> str:
    return f"({show(a)}, {show(b)})"


def code(framework: str, p: Params) -> str:
    """The line to paste: the QH optimizer with ``p``'s values, in ``framework``'s spelling."""
    if isinstance(p, convert.QHMParams):
        qhm = f"momentum={show(p.momentum)}, nu={show(p.nu)}"
        if framework == "torch":
            return f"QHM(model.parameters(), lr={show(p.lr)}, {qhm})"
        if framework == "keras":
            return f"QHM(learning_rate={show(p.lr)}, {qhm})"
        return f"qho.qhm(learning_rate={show(p.lr)}, {qhm})"
    (b1, b2), (n1, n2) = p.betas, p.nus
    if framework == "torch":
        return (
            f"QHAdam(model.parameters(), lr={show(p.lr)}, betas={_pair(b1, b2)}, "
            f"nus={_pair(n1, n2)}, eps={show(p.eps)})"
        )
    if framework == "keras":
        return (
            f"QHAdam(learning_rate={show(p.lr)}, beta_1={show(b1)}, beta_2={show(b2)}, "
            f"nu_1={show(n1)}, nu_2={show(n2)}, epsilon={show(p.eps)})"
        )
    return (
        f"qho.qhadam(learning_rate={show(p.lr)}, b1={show(b1)}, b2={show(b2)}, "
        f"nu1={show(n1)}, nu2={show(n2)}, eps={show(p.eps)})"
    )


def _values(p: Params) -> dict[str, float]:
    if isinstance(p, convert.QHMParams):
        return {"lr": p.lr, "momentum": p.momentum, "nu": p.nu}
    return {
        "lr": p.lr,
        "beta1": p.betas[0],
        "beta2": p.betas[1],
        "nu1": p.nus[0],
        "nu2": p.nus[1],
        "eps": p.eps,
    }


def _attrs(prefix: str, values: dict[str, float]) -> str:
    # repr: the exact float, so the test can compare without tolerance.
    return "".join(f' data-{prefix}{k}="{v!r}"' for k, v in values.items())


def _bound_cell(bound: float | None) -> str:
    if bound is None:
        return '<td class="qh-num" data-key="bound" data-value="none">none</td>'
    return f'<td class="qh-num" data-key="bound" data-value="{bound!r}">{bound:.4f}</td>'


def table_html(family: Family, framework: str) -> str:
    """One family's table for one framework (two rows per setting: exact, start)."""
    qhadam = family.optimizer == "qhadam"
    exact = "exact" if family.exact else "modulo bias correction"
    head = "".join(f"<th>{INPUT_LABELS[k]}</th>" for k in family.inputs)
    head += '<th></th><th class="qh-code-col">paste this</th>'
    if qhadam:
        head += '<th title="qhoptim.analysis.qhadam_update_bound, t → ∞">bound</th>'
    lines = [
        f'<div class="table-wrapper"><table class="docutils align-default qh-advisor-table" '
        f'data-family="{family.key}" data-framework="{framework}">',
        f"<thead><tr>{head}</tr></thead>",
        "<tbody>",
    ]
    for setting in family.settings:
        p = exact_equivalent(family, setting)
        parts = (
            ("equivalent", exact, p),
            ("suggested", "paper's start", suggested_start(p)),
        )
        for i, (part, label, params) in enumerate(parts):
            cells = ""
            if i == 0:
                cells = "".join(
                    f'<td class="qh-num" rowspan="2">{show(setting[k])}</td>' for k in family.inputs
                )
            cells += f'<td class="qh-part">{label}</td>'
            cells += f"<td><code>{html.escape(code(framework, params))}</code></td>"
            if qhadam:
                cells += _bound_cell(update_bound(params))
            lines.append(
                f'<tr class="qh-{part}" data-part="{part}"'
                f"{_attrs('in-', setting)}{_attrs('', _values(params))}>{cells}</tr>"
            )
    lines += ["</tbody></table></div>"]
    return "\n".join(lines)


def _raw(text: str) -> list[str]:
    return ["```{raw} html", text, "```"]


def markdown() -> str:
    """The generated part of the advisor page: one section per family, a tab per framework."""
    out = [
        "<!-- Generated by docs/_ext/advisor_tables.py from qhoptim.convert, qhoptim.analysis",
        "     and qhoptim.validation while the site was built. Do not edit. -->",
        "",
    ]
    for family in FAMILIES:
        assert family.example in family.settings, family.key
        first = exact_equivalent(family, family.example)
        out += [
            f"## {family.title}",
            "",
            family.intro,
            f"`qhoptim.{call(family, family.example)}` returns `{first!r}`; the tables",
            "print 12 significant digits.",
            "",
            "::::{tab-set}",
            ":sync-group: framework",
            "",
        ]
        for key, label, imports in FRAMEWORKS:
            out += [
                f":::{{tab-item}} {label}",
                f":sync: {key}",
                "",
                f"`{imports}`",
                "",
                *_raw(table_html(family, key)),
                ":::",
                "",
            ]
        out += ["::::", ""]
    out += [
        "## Settings that do not convert",
        "",
        "`qhoptim.convert` checks its arguments with `qhoptim.validation`, as every backend "
        "does; what it says, computed while the site was built:",
        "",
        "| call | raises |",
        "|---|---|",
    ]
    out += [f"| `{c}` | `{m}` |" for c, m in out_of_range()]
    out.append("")
    return "\n".join(out)


def rows() -> list[dict[str, Any]]:
    """Every (family, setting) the page shows, for the browser test's coverage check."""
    return [{"family": f.key, **s} for f in FAMILIES for s in f.settings]
