"""The site's own Sphinx extension: reference pages generated from the code at build time.

At ``builder-inited`` each generator of ``refgen/`` renders its reference as Markdown into
``docs/_generated/`` (not in git, not a page of its own); the reference pages pull them in with
MyST's ``{include}``. A file is rewritten only when its text changed, so an unchanged build stays
incremental.

At ``build-finished`` the site also gets what coding agents read: every page as Markdown beside its
HTML (``tutorial.md`` beside ``tutorial.html``, the generated tables included), ``llms.txt`` at the
root listing every page with one line each (llmstxt.org), and the OpenAPI document. The
repository's own ``llms.txt`` (its links into ``docs/``) is written by the same code; a build that
finds it stale rewrites it and warns, so ``make docs`` (-W) fails until the new one is committed.
"""

from __future__ import annotations

import re
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


INCLUDE = re.compile(r"```\{include\}\s+(\S+)\s*\n```")
SHELVES = (
    ("", "Start here"),
    ("tutorial", "Tutorial"),
    ("how-to/", "How-to guides"),
    ("reference/", "Reference"),
    ("explanation/", "Explanation"),
    ("glossary", "Glossary"),
)


def raw_markdown(docname: str) -> str:
    """The page's Markdown source with the generated parts it includes written in."""
    source = DOCS / f"{docname}.md"
    return INCLUDE.sub(lambda m: (source.parent / m.group(1)).resolve().read_text(), source.read_text())


def summary(docname: str) -> str:
    """The page's first paragraph of prose, its first sentences up to a line's worth."""
    text = re.sub(r"```.*?```", "", (DOCS / f"{docname}.md").read_text(), flags=re.S)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(block.split())
        if block and not block.startswith(("#", "<!--", "|", "-", "(", ":")):
            block = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", block).replace("**", "")
            out = ""
            for sentence in re.split(r"(?<=[.:])\s", block):
                out = f"{out} {sentence}".strip()
                if len(out) >= 60:
                    break
            return out.rstrip(":") + ("" if out.endswith(".") else ".")
    return ""


def llms_txt(app: Sphinx, prefix: str) -> str:
    env = app.env
    lines = [
        "# agent-outbox",
        "",
        "> Exactly-once-or-honest execution of AI agents' side effects: agents write intents into a "
        "transactional outbox with a business idempotency key; fenced workers call the provider with "
        "the key; an answer that was lost is parked in outcome_unknown and settled by asking the "
        "provider, or handed to a person. Every page below is Markdown.",
        "",
    ]
    for start, shelf in SHELVES:
        if start.endswith("/"):
            pages = sorted(d for d in env.found_docs if d.startswith(start) and d != f"{start}index")
        else:
            pages = [d for d in env.found_docs if d == (start or "index")]
        lines += [f"## {shelf}", ""]
        lines += [f"- [{env.titles[d].astext()}]({prefix}{d}.md): {summary(d)}" for d in pages]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def publish(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    (out / "openapi.json").write_text((GENERATED / "openapi.json").read_text())
    for docname in app.env.found_docs:
        target = out / f"{docname}.md"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(raw_markdown(docname))
    (out / "llms.txt").write_text(llms_txt(app, ""))
    repo_copy, text = ROOT / "llms.txt", llms_txt(app, "docs/")
    if not repo_copy.exists() or repo_copy.read_text() != text:
        repo_copy.write_text(text)
        log.warning("llms.txt was stale and has been rewritten from the site's pages: commit it")


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    app.connect("build-finished", publish)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
