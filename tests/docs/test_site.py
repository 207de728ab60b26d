"""The built documentation site in a real browser (headless Debian Chromium).

Serves ``docs/_build/html`` (or ``$QHOPTIM_DOCS_HTML``) on 127.0.0.1 and opens
it with Selenium and Debian's chromium-driver. Checks that the landing page and
the hyperparameter advisor render without console errors, and that the
advisor's answers equal :func:`advisor_cases.advise` -- ``qhoptim.convert`` and
``qhoptim.analysis`` -- for every generated case, typed into the real form.
Writes ``artifacts/docs-landing.png`` and ``artifacts/docs-advisor.png``.

Run by ``nox -s docs`` after the build (with QHOPTIM_DOCS_REQUIRE=1, so a
missing browser or site fails instead of skipping). Elsewhere the module skips
when selenium, Chromium or the built site is missing.
"""

from __future__ import annotations

import functools
import http.server
import json
import math
import os
import shutil
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
import advisor_cases  # noqa: E402


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


def _set_text(driver: Any, element_id: str, value: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(value)


def _fill(driver: Any, case: dict[str, Any]) -> None:
    driver.find_element(By.ID, f"qh-opt-{case['optimizer']}").click()
    if case["optimizer"] == "sgd":
        _set_text(driver, "qh-sgd-lr", case["lr"])
        _set_text(driver, "qh-sgd-momentum", case["momentum"])
        box = driver.find_element(By.ID, "qh-sgd-nesterov")
        if box.is_selected() != case["nesterov"]:
            box.click()
    else:
        for key in ("lr", "beta1", "beta2", "eps"):
            _set_text(driver, f"qh-adam-{key}", case[key])


def _read(driver: Any) -> dict[str, Any]:
    """The advisor's answer as the page shows it (values from data-value attributes)."""
    root = driver.find_element(By.ID, "qh-advisor")
    if root.get_attribute("data-state") == "error":
        error = driver.find_element(By.ID, "qh-error")
        message = error.text.removeprefix("ValueError: ")
        return {"error": {"name": error.get_attribute("data-argument"), "message": message}}
    answer: dict[str, Any] = {}
    for part in ("equivalent", "suggested"):
        cells = driver.find_elements(By.CSS_SELECTOR, f"#qh-{part} td[data-key]")
        values: dict[str, Any] = {}
        for cell in cells:
            raw = cell.get_attribute("data-value")
            values[cell.get_attribute("data-key")] = None if raw == "null" else float(raw)
        answer[part] = values
    answer["call"] = driver.find_element(By.ID, "qh-function").text
    return answer


def _check(case: dict[str, Any], expected: dict[str, Any], shown: dict[str, Any]) -> None:
    if "error" in expected:
        assert shown.get("error") == expected["error"], (case, shown)
        return
    assert "error" not in shown, (case, shown)
    assert shown["call"].startswith(f"qhoptim.convert.{expected['function']}("), (case, shown)
    for part in ("equivalent", "suggested"):
        want = {k: v for k, v in expected[part].items() if k != "optimizer"}
        got = shown[part]
        assert set(got) == set(want), (case, part, got)
        for key, value in want.items():
            if key == "bound":  # sqrt of a sum: allow the last bits to differ
                assert (value is None) == (got[key] is None), (case, part, key, got[key])
                if value is not None:
                    assert math.isclose(got[key], value, rel_tol=1e-12), (case, key)
            else:  # the same IEEE operations in the same order: equal
                assert got[key] == value, (case, part, key, got[key], value)


def test_advisor_matches_qhoptim_convert(driver: Any, base_url: str) -> None:
    # The table the build wrote is what qhoptim computes now (no stale site) ...
    table = json.loads((SITE / "_static" / "advisor_cases.json").read_text())["cases"]
    assert [row["input"] for row in table] == advisor_cases.CASES
    for row in table:
        assert row["expected"] == json.loads(json.dumps(advisor_cases.advise(row["input"])))

    _open(driver, f"{base_url}/advisor.html")
    WebDriverWait(driver, 20).until(
        lambda d: d.find_element(By.ID, "qh-advisor").get_attribute("data-ready") == "true"
    )
    assert _console_errors(driver) == []
    # ... and the page, driven through its form, answers every case the same.
    for row in table:
        _fill(driver, row["input"])
        _check(row["input"], row["expected"], _read(driver))
    # The JavaScript function agrees too (same cases, no form in between).
    for row in table:
        js = driver.execute_script("return window.qhAdvisor.advise(arguments[0])", row["input"])
        js.pop("function", None)
        js.pop("exactness", None)
        want = {k: v for k, v in row["expected"].items() if k not in ("function", "exactness")}
        assert json.loads(json.dumps(js)) == want, row["input"]

    # The screenshot: the first case (SGD, lr 0.1, momentum 0.9, Nesterov).
    driver.find_element(By.CSS_SELECTOR, "input[name=qh-framework][value=torch]").click()
    _fill(driver, advisor_cases.CASES[0])
    assert _read(driver)["equivalent"]["nu"] == 0.9
    driver.execute_script(
        "document.getElementById('qh-advisor').scrollIntoView({block: 'start'});"
        "window.scrollBy(0, -70);"
    )
    errors = _console_errors(driver)
    _screenshot(driver, "docs-advisor.png")
    assert errors == [], errors


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
