"""Sphinx configuration of the qhoptim documentation site.

Build (warnings are errors; the generated tables, figures and example outputs
are produced by running the code during the build):

    sphinx-build -W --keep-going -b html docs docs/_build/html

or ``nox -s docs``, which also runs the browser test of the built site.
Everything that is computed at build time is made by ``docs/_ext/qhdocs.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

# Keras 3 runs on JAX here (installed for the optax backend), so the Keras
# guide and API need no TensorFlow. Set before anything imports keras.
os.environ.setdefault("KERAS_BACKEND", "jax")

import qhoptim  # noqa: E402

project = "qhoptim"
author = "qhoptim developers"
copyright = "2019-present, the qhoptim developers"
release = qhoptim.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx-mathjax-offline",  # MathJax 3 served from the site itself: no CDN
    "qhdocs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/inc", "**/.ipynb_checkpoints"]
templates_path: list[str] = []

# -- MyST ---------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# -- autodoc ------------------------------------------------------------------
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# No intersphinx: torch, optax and Keras ship no objects.inv in their wheels
# and the build must not touch the network. Names of their APIs render as code.

# -- HTML ---------------------------------------------------------------------
html_theme = "furo"
html_title = "qhoptim"
html_short_title = "qhoptim"
html_static_path = ["_static"]
html_css_files = ["qhdocs.css"]
html_favicon = "_static/favicon.svg"
html_logo = "_static/favicon.svg"
html_theme_options = {
    "source_repository": "",
    "light_css_variables": {
        "color-brand-primary": "#5b3cc4",
        "color-brand-content": "#5b3cc4",
        "font-stack": (
            "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, "
            "'Noto Sans', 'Liberation Sans', sans-serif"
        ),
    },
    "dark_css_variables": {
        "color-brand-primary": "#a993ff",
        "color-brand-content": "#a993ff",
    },
    "navigation_with_keys": True,
}
html_show_sourcelink = False
html_copy_source = False
pygments_style = "friendly"
pygments_dark_style = "monokai"

copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

# -- qhdocs (docs/_ext/qhdocs.py) ---------------------------------------------
# QHOPTIM_DOCS_STRICT=1 (the nox session sets it): an example or API page whose
# backend module exists in the checkout but cannot run is an error instead of
# a note on the page.
qhdocs_strict = os.environ.get("QHOPTIM_DOCS_STRICT", "") not in ("", "0")
