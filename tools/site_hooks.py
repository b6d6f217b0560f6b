"""MkDocs hooks of the documentation site (``mkdocs.yml``): the README is the site's home page.

The README lives at the root of the repository, where GitHub shows it, and links to the pages
as ``docs/X.md``. :func:`on_files` adds it to the site as ``index.md``, a page of ``docs/``, so
those links are rewritten to ``X.md``; a link out of ``docs/`` stays as it is and the strict
build reports it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[1] / "README.md"
_INTO_DOCS = re.compile(r"\]\(docs/")


def home_page(readme: str) -> str:
    """The README as a page of ``docs/``: its links into ``docs/`` made relative to it."""
    return _INTO_DOCS.sub("](", readme)


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    """Add ``index.md``, made from the README (``docs/`` has no index page of its own)."""
    files.append(
        File.generated(config, "index.md", content=home_page(README.read_text(encoding="utf-8")))
    )
    return files
