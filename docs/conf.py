"""Sphinx configuration of the agent-outbox site (`make docs`). Sources are MyST Markdown; the
reference pages are generated from the code at build time by _ext/outbox_docs.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "agent-outbox"
author = "agent-outbox contributors"
copyright = "agent-outbox contributors"  # noqa: A001 - Sphinx's own name for it

extensions = ["myst_parser", "outbox_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "_ext", "Thumbs.db", ".DS_Store"]

# Headings get anchors a link can name (`page.md#a-heading`), checked with the other links (-n -W).
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]
# A link to a file outside the site (examples/, bench/) is not a page: the build leaves it as it is.
suppress_warnings: list[str] = []

html_theme = "furo"
html_title = "agent-outbox"
html_static_path: list[str] = []
