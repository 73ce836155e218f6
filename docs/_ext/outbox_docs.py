"""The site's own Sphinx extension: reference pages generated from the code at build time.

At ``builder-inited`` each generator of ``refgen/`` renders its reference as Markdown into
``docs/_generated/`` (not in git, not a page of its own); the reference pages pull them in with
MyST's ``{include}``. A file is rewritten only when its text changed, so an unchanged build stays
incremental. At ``build-finished`` the OpenAPI document is written beside the HTML.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"

log = logging.getLogger(__name__)


def _write(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def generate(app: Sphinx) -> None:
    for path in (str(ROOT), str(HERE)):
        if path not in sys.path:
            sys.path.insert(0, path)
    from refgen import actions_file, cli, http_api, metrics, settings, states

    GENERATED.mkdir(exist_ok=True)
    _write(GENERATED / "cli.md", cli.render())
    _write(GENERATED / "settings.md", settings.render())
    _write(GENERATED / "states.md", states.render())
    _write(GENERATED / "metrics.md", metrics.render(ROOT))
    _write(GENERATED / "actions_file.md", actions_file.render())
    page, document = http_api.render()
    _write(GENERATED / "http_api.md", page)
    _write(GENERATED / "openapi.json", document + "\n")
    log.info("outbox_docs: reference generated from the code into %s", GENERATED.relative_to(ROOT))


def publish(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    (out / "openapi.json").write_text((GENERATED / "openapi.json").read_text())


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    app.connect("build-finished", publish)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
