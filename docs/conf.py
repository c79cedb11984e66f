"""Sphinx configuration: Markdown pages (MyST), API pages from the Google-style docstrings."""

import importlib.metadata

project = "jaxmp"
author = "the jaxmp authors"
copyright = "the jaxmp authors"
release = importlib.metadata.version("jaxmp")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]

# `name` in a docstring links to that object where Sphinx knows it.
default_role = "py:obj"
autodoc_member_order = "bysource"
# The docstrings' Args sections say what each argument takes.
autodoc_typehints = "none"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as a field list: properties documented as members are not described twice.
napoleon_use_ivar = True

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"jaxmp {release}"
