"""The pictures under docs/ and ``docs/make_pictures.py``'s list of them agree (nothing is rendered here).

- every picture the script lists is checked in, a PNG, under 300 KiB;
- every PNG under ``docs/img/`` is one the script makes (no stray or renamed picture);
- every picture that README.md or a ``docs/*.md`` page shows (``![...](path)`` or ``<img src=...>``) exists,
  and every picture the script makes is shown by at least one page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

DOCS = ROOT / "docs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_BYTES = 300 * 1024


def script_pictures() -> dict[str, str]:
    """``PICTURES`` of docs/make_pictures.py, read from its source (the script is not imported: it needs no torch
    here, and a test must not depend on the script's imports)."""
    tree = ast.parse((DOCS / "make_pictures.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "PICTURES":
            return ast.literal_eval(node.value)
    raise AssertionError("docs/make_pictures.py defines no PICTURES")


IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']")


def referenced_pictures() -> dict[Path, list[str]]:
    """Local picture path (resolved) -> the pages that show it."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    found: dict[Path, list[str]] = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in IMAGE_LINK.finditer(text):
            link = match.group(1) or match.group(2)
            if re.match(r"^[a-z]+:", link):  # http:, data: ...
                continue
            path = (page.parent / link.split("#", 1)[0]).resolve()
            found.setdefault(path, []).append(str(page.relative_to(ROOT)))
    return found


def test_the_link_pattern_reads_markdown_and_html_images():
    text = '![a](img/x.png) text ![b](<y.png> "title") <img src="z.png" width=3> ![c](https://e.org/w.png)'
    assert [m.group(1) or m.group(2) for m in IMAGE_LINK.finditer(text)] == ["img/x.png", "y.png", "z.png", "https://e.org/w.png"]


@pytest.mark.parametrize("name", sorted(script_pictures()))
def test_every_picture_of_the_script_is_checked_in_small_png(name):
    path = DOCS / name
    assert path.is_file(), f"docs/{name} is listed in docs/make_pictures.py but missing: run python docs/make_pictures.py"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), f"docs/{name} is not a PNG"
    assert len(data) <= MAX_BYTES, f"docs/{name} is {len(data) // 1024} KiB (limit {MAX_BYTES // 1024} KiB)"


def test_every_picture_under_docs_img_is_made_by_the_script():
    listed = {DOCS / name for name in script_pictures()}
    pictures = {p for p in (DOCS / "img").rglob("*") if p.is_file()} if (DOCS / "img").exists() else set()
    assert pictures, "docs/img holds no picture"
    stray = sorted(str(p.relative_to(ROOT)) for p in pictures - listed)
    assert not stray, f"pictures no script makes (add them to PICTURES in docs/make_pictures.py or delete them): {stray}"
    # the pictures at the top of docs/ too
    top = {p for p in DOCS.glob("*.png")}
    assert not sorted(top - listed), f"pictures in docs/ no script makes: {sorted(top - listed)}"


def test_every_picture_a_page_shows_exists():
    missing = {str(p): pages for p, pages in referenced_pictures().items() if not p.is_file()}
    assert not missing, f"pages show pictures that do not exist: {missing}"


def test_every_picture_of_the_script_is_shown_somewhere():
    shown = set(referenced_pictures())
    unshown = sorted(name for name in script_pictures() if (DOCS / name).resolve() not in shown)
    assert not unshown, f"pictures the script makes that no page shows: {unshown}"
