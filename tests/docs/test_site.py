"""The built documentation site in a real browser (headless Debian Chromium).

Serves ``docs/_build/html`` (or ``$QHOPTIM_DOCS_HTML``) on 127.0.0.1 and opens
it with Selenium and Debian's chromium-driver. Checks that the landing page and
the hyperparameter advisor render without console errors, and that every value
in the advisor's generated tables -- the data attributes (exact floats), the
printed code lines and the update bounds -- equals what ``qhoptim.convert`` and
``qhoptim.analysis`` compute in this test; that the advisor lists the settings
``docs/_ext/advisor_tables.py`` lists (no stale site); and that every code line
constructs its optimizer. Writes ``artifacts/docs-landing.png`` and
``artifacts/docs-advisor.png``.

Run by ``nox -s docs`` after the build (with QHOPTIM_DOCS_REQUIRE=1, so a
missing browser or site fails instead of skipping). Elsewhere the module skips
when selenium, Chromium or the built site is missing.
"""

from __future__ import annotations

import ast
import functools
import http.server
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("QHOPTIM_DOCS_HTML", ROOT / "docs" / "_build" / "html"))
ARTIFACTS = ROOT / "artifacts"
REQUIRE = os.environ.get("QHOPTIM_DOCS_REQUIRE", "") not in ("", "0")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
)


def _missing(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason)
    pytest.skip(reason, allow_module_level=True)


try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    _missing("selenium is not installed (nox -s docs installs it)")

if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    _missing("Debian's chromium and chromium-driver are not installed")
if not (SITE / "index.html").exists():
    _missing(f"the site is not built at {SITE} (run nox -s docs)")

sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import advisor_tables as advisor_tables_module  # noqa: E402

from qhoptim import analysis, convert  # noqa: E402


# ------------------------------------------------------------------ fixtures
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager (which would download) never runs.
    service = Service(executable_path=CHROMEDRIVER)
    browser = webdriver.Chrome(service=service, options=options)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()


def _open(driver: Any, url: str) -> None:
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(url)
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )
    # MathJax typesets asynchronously; wait until it is done where it is loaded.
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script(
            "return !window.MathJax || !MathJax.startup || !MathJax.startup.promise"
            " ? true : (window.__qhMath = window.__qhMath || MathJax.startup.promise"
            ".then(() => { window.__qhMathDone = true; }), window.__qhMathDone === true)"
        )
    )


def _console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), f"could not write {path}"
    assert path.stat().st_size > 10_000, f"{path} is suspiciously small"
    return path


# ---------------------------------------------------------------------- tests
def test_landing_page_renders_without_console_errors(driver: Any, base_url: str) -> None:
    _open(driver, f"{base_url}/index.html")
    assert "qhoptim" in driver.title
    heading = driver.find_element(By.CSS_SELECTOR, "article h1")
    assert heading.text.strip().startswith("qhoptim")
    # The quickstart tabs and their executed outputs are there.
    tabs = driver.find_elements(By.CSS_SELECTOR, ".sd-tab-set > label")
    assert [t.text for t in tabs] == ["PyTorch", "Keras 3", "optax"]
    # Display math was typeset by the bundled MathJax (no CDN).
    assert driver.find_elements(By.CSS_SELECTOR, "mjx-container"), "MathJax did not typeset"
    errors = _console_errors(driver)
    _screenshot(driver, "docs-landing.png")
    assert errors == [], errors


# ----------------------------------------------------------------- advisor
# What the advisor must show, stated here and computed with qhoptim itself:
# the conversion of each section, and the paper's starting point (Sec. 7.1).
CONVERSIONS = {
    "sgd": lambda s: convert.from_sgd(s["lr"]),
    "momentum": lambda s: convert.from_momentum(s["lr"], s["momentum"]),
    "nesterov": lambda s: convert.from_nesterov(s["lr"], s["momentum"]),
    "adam": lambda s: convert.from_adam(s["lr"], (s["beta1"], s["beta2"]), s["eps"]),
    "nadam": lambda s: convert.from_nadam(s["lr"], (s["beta1"], s["beta2"]), s["eps"]),
    "rmsprop": lambda s: convert.from_rmsprop(s["lr"], s["alpha"], s["eps"]),
}
FRAMEWORKS = ("torch", "keras", "optax")
# Each framework's argument names -> (field of the convert result, index in a pair).
CODE_NAMES = {
    "torch": {
        "lr": ("lr", None), "momentum": ("momentum", None), "nu": ("nu", None),
        "betas": ("betas", None), "nus": ("nus", None), "eps": ("eps", None),
    },
    "keras": {
        "learning_rate": ("lr", None), "momentum": ("momentum", None), "nu": ("nu", None),
        "beta_1": ("betas", 0), "beta_2": ("betas", 1), "nu_1": ("nus", 0), "nu_2": ("nus", 1),
        "epsilon": ("eps", None),
    },
    "optax": {
        "learning_rate": ("lr", None), "momentum": ("momentum", None), "nu": ("nu", None),
        "b1": ("betas", 0), "b2": ("betas", 1), "nu1": ("nus", 0), "nu2": ("nus", 1),
        "eps": ("eps", None),
    },
}  # fmt: skip
CALLEES = {
    "torch": {"qhm": "QHM", "qhadam": "QHAdam"},
    "keras": {"qhm": "QHM", "qhadam": "QHAdam"},
    "optax": {"qhm": "qho.qhm", "qhadam": "qho.qhadam"},
}

# Every table of the page with its rows' data attributes, in one round trip.
_COLLECT_TABLES = """
return Array.from(document.querySelectorAll('table.qh-advisor-table')).map(t => ({
  family: t.dataset.family,
  framework: t.dataset.framework,
  rows: Array.from(t.querySelectorAll('tbody tr')).map(r => {
    const attrs = {};
    for (const a of r.attributes) if (a.name.startsWith('data-')) attrs[a.name.slice(5)] = a.value;
    const code = r.querySelector('code');
    const bound = r.querySelector('td[data-key=bound]');
    return {
      attrs: attrs,
      code: code ? code.textContent : null,
      bound: bound ? [bound.textContent, bound.dataset.value] : null,
    };
  }),
}));
"""


def _starting_point(p: Any) -> Any:
    """The paper's starting point from the exact equivalent (Ma & Yarats, 2019, Sec. 7.1)."""
    if isinstance(p, convert.QHMParams):
        return p._replace(nu=0.7, momentum=0.999)
    return p._replace(betas=(0.999, p.betas[1]), nus=(0.7, 1.0))


def _fields(p: Any) -> dict[str, float]:
    if isinstance(p, convert.QHMParams):
        return {"lr": p.lr, "momentum": p.momentum, "nu": p.nu}
    (b1, b2), (n1, n2) = p.betas, p.nus
    return {"lr": p.lr, "beta1": b1, "beta2": b2, "nu1": n1, "nu2": n2, "eps": p.eps}


def _bound(p: Any) -> float | None:
    try:
        value = analysis.qhadam_update_bound(p.nus[0], p.betas[0], p.nus[1], p.betas[1])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _inputs(attrs: dict[str, str]) -> dict[str, float]:
    """A row's source setting, from its ``data-in-*`` attributes."""
    return {k.removeprefix("in-"): float(v) for k, v in attrs.items() if k.startswith("in-")}


def _printed(x: float) -> float:
    """What a number is on the page: 12 significant digits."""
    return float(f"{x:.12g}")


def _check_code(framework: str, code: str, p: Any, where: Any) -> None:
    """The pasted line builds the right optimizer with ``p``'s values, as printed."""
    node = ast.parse(code, mode="eval").body
    assert isinstance(node, ast.Call), where
    kind = "qhm" if isinstance(p, convert.QHMParams) else "qhadam"
    assert ast.unparse(node.func) == CALLEES[framework][kind], (where, code)
    if framework == "torch":
        assert [ast.unparse(a) for a in node.args] == ["model.parameters()"], (where, code)
    else:
        assert node.args == [], (where, code)
    got = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    want: dict[str, Any] = {}
    for name, (field, index) in CODE_NAMES[framework].items():
        if not hasattr(p, field):
            continue
        value = getattr(p, field)
        value = value if index is None else value[index]
        want[name] = tuple(map(_printed, value)) if isinstance(value, tuple) else _printed(value)
    assert got == want, (where, code)


@pytest.fixture(scope="module")
def advisor_tables(driver: Any, base_url: str) -> list[dict[str, Any]]:
    """The advisor page's tables as the browser shows them (checked: no console errors)."""
    _open(driver, f"{base_url}/advisor.html")
    tables = driver.execute_script(_COLLECT_TABLES)
    errors = _console_errors(driver)
    assert errors == [], errors
    assert tables, "the advisor page has no tables"
    return tables


def test_advisor_tables_match_qhoptim_convert(advisor_tables: list[dict[str, Any]]) -> None:
    tables = advisor_tables
    # Every section has a table per framework ...
    layout = {(t["family"], t["framework"]) for t in tables}
    assert layout == {(f, fw) for f in CONVERSIONS for fw in FRAMEWORKS}, layout
    assert len(tables) == len(layout), "a section has two tables for one framework"
    # ... every table lists the settings the generator lists (no stale site) ...
    listed = [dict(r) for r in advisor_tables_module.rows()]
    for t in tables:
        shown = [
            {"family": t["family"], **_inputs(r["attrs"])}
            for r in t["rows"]
            if r["attrs"]["part"] == "equivalent"
        ]
        assert shown == [r for r in listed if r["family"] == t["family"]], t["family"]
        assert len(t["rows"]) == 2 * len(shown), t["family"]

    # ... and every value is what qhoptim.convert and qhoptim.analysis compute now.
    checked = 0
    for t in tables:
        family, framework = t["family"], t["framework"]
        for row in t["rows"]:
            attrs = row["attrs"]
            setting = _inputs(attrs)
            assert attrs["part"] in ("equivalent", "suggested"), attrs
            exact = CONVERSIONS[family](setting)
            p = exact if attrs["part"] == "equivalent" else _starting_point(exact)
            where = (family, framework, attrs["part"], setting)
            shown = {
                k: float(v) for k, v in attrs.items() if k != "part" and not k.startswith("in-")
            }
            assert shown == _fields(p), where  # data attributes: the exact floats
            _check_code(framework, row["code"], p, where)  # the line: as printed
            if isinstance(p, convert.QHAdamParams):
                text, value = row["bound"]
                bound = _bound(p)
                if bound is None:
                    assert (text, value) == ("none", "none"), where
                else:
                    assert float(value) == bound, where
                    assert text == f"{bound:.4f}", where
            else:
                assert row["bound"] is None, where
            checked += 1
    assert checked == 2 * 3 * len(advisor_tables_module.rows())


def test_advisor_tabs_and_screenshot(
    driver: Any, base_url: str, advisor_tables: list[dict[str, Any]]
) -> None:
    """The framework tabs switch every section at once (sphinx-design's sync); no errors."""

    def shown_frameworks() -> set[str]:
        return {
            t.get_attribute("data-framework")
            for t in driver.find_elements(By.CSS_SELECTOR, "table.qh-advisor-table")
            if t.is_displayed()
        }

    def click(label: str) -> None:
        # The first section's tab; sphinx-design's script selects it in every section.
        tab = driver.find_element(
            By.XPATH,
            f"(//div[contains(@class, 'sd-tab-set')]/label[normalize-space()='{label}'])[1]",
        )
        driver.execute_script("arguments[0].click()", tab)

    # The screenshot: the first section's table, PyTorch tab (the default).
    assert shown_frameworks() == {"torch"}
    driver.execute_script(
        "document.querySelector('article section section').scrollIntoView({block: 'start'});"
    )
    WebDriverWait(driver, 10).until(lambda d: d.execute_script("return window.scrollY > 0"))
    _screenshot(driver, "docs-advisor.png")

    click("optax")
    WebDriverWait(driver, 10).until(lambda d: shown_frameworks() == {"optax"})
    click("PyTorch")
    WebDriverWait(driver, 10).until(lambda d: shown_frameworks() == {"torch"})
    errors = _console_errors(driver)
    assert errors == [], errors


# Builds every pasted line with its framework, in a fresh process (Keras on JAX).
_BUILD_LINES = """
import json, sys
lines, out = json.load(sys.stdin), {"missing": {}, "failures": []}
for framework, codes in lines.items():
    try:
        if framework == "torch":
            import torch
            from qhoptim.torch import QHM, QHAdam
            env = {"QHM": QHM, "QHAdam": QHAdam, "model": torch.nn.Linear(2, 1)}
        elif framework == "keras":
            from qhoptim.keras import QHM, QHAdam
            env = {"QHM": QHM, "QHAdam": QHAdam}
        else:
            import qhoptim.optax as qho
            env = {"qho": qho}
    except ImportError as e:
        out["missing"][framework] = repr(e)
        continue
    for code in codes:
        try:
            eval(code, dict(env))
        except Exception as e:
            out["failures"].append([framework, code, repr(e)])
print(json.dumps(out))
"""


def test_advisor_code_lines_build_optimizers(advisor_tables: list[dict[str, Any]]) -> None:
    """Each pasted line constructs the optimizer in its framework (the names are right)."""
    lines: dict[str, list[str]] = {fw: [] for fw in FRAMEWORKS}
    for t in advisor_tables:
        for row in t["rows"]:
            if row["code"] not in lines[t["framework"]]:
                lines[t["framework"]].append(row["code"])
    env = dict(os.environ, KERAS_BACKEND="jax", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_LINES],
        input=json.dumps(lines),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["failures"] == [], result["failures"][:5]
    if result["missing"]:
        if REQUIRE:
            pytest.fail(f"frameworks missing in the docs environment: {result['missing']}")
        pytest.skip(f"not installed here: {sorted(result['missing'])}")


def test_pages_with_generated_content_render(driver: Any, base_url: str) -> None:
    """The conformance and analysis pages show their build-time figures and tables."""
    for page, needle in (
        ("conformance.html", "passed, 0 failed"),
        ("analysis.html", "qhadam_bound_optimal_nu2"),
        ("conversions.html", "recovery cases within"),
    ):
        _open(driver, f"{base_url}/{page}")
        body = driver.find_element(By.TAG_NAME, "article").text
        assert needle in body, (page, needle)
        for img in driver.find_elements(By.CSS_SELECTOR, "article img"):
            loaded = driver.execute_script(
                "return arguments[0].complete && arguments[0].naturalWidth > 0", img
            )
            assert loaded, (page, img.get_attribute("src"))
        assert _console_errors(driver) == [], page
