"""Regenerate ``src/distsgd/demo/text.txt.gz``, the bundled language model's text.

The text is distsgd's own guide: every Markdown page under ``docs/`` (sorted by path, joined by a
blank line), about 520 KB of English with tables and code, written for this project and under
its licence, so the demo needs no download and carries no one else's text. It is frozen when
exported (the guide goes on changing; the data set does not), gzipped with no timestamp so the
same pages give the same bytes. Run ``python tools/export_text.py``.
"""

from __future__ import annotations

import gzip
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "distsgd" / "demo" / "text.txt.gz"


def main() -> None:
    pages = sorted((ROOT / "docs").rglob("*.md"))
    text = "\n\n".join(page.read_text(encoding="utf-8") for page in pages).encode("utf-8")
    OUT.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    size = OUT.stat().st_size
    print(f"wrote {OUT} ({size} bytes; {len(text)} bytes of text from {len(pages)} pages)")


if __name__ == "__main__":
    main()
