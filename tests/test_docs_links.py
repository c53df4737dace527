"""Every relative link of README.md and docs/*.md points to a file or folder that exists (anchors are not
checked); links inside code are not links."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)
# [text](target) and ![alt](target), the target up to a space (a title may follow) or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text())
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_to_existing_files(page):
    missing = [target for target in relative_links(page)
               if not (page.parent / unquote(target.split("#", 1)[0])).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_links_are_found():
    """The pattern sees the README's links and pictures, and not the ones in code."""
    links = relative_links(ROOT / "README.md")
    assert "docs/usage.md" in links and "benchmarks/results/figures/speed_vs_context.png" in links
    text = CODE.sub("", "[a](x.md) `[b](y.md)` ![c](z.png \"title\") [d](https://example.com) [e](#anchor) [f](g.md#h)")
    assert [m.group(1) for m in LINK.finditer(text)] == ["x.md", "z.png", "https://example.com", "#anchor", "g.md#h"]
