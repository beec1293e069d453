"""Every relative link in README.md and docs/*.md points to a file that exists.

Links are markdown links and images, `[text](target)` and `![alt](target)`, plus reference definitions
(`[name]: target`). Web and mail links (any `scheme:` target) and pure `#anchor` links are not checked; a
`#anchor` suffix is dropped and the rest is resolved relative to the file holding the link. Fenced code
blocks and inline code are skipped, since text there is not a link.
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+).+?\1")
# [text](target) or ![alt](target); the text may hold one level of brackets (an image inside a link).
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    found, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is not None:
            continue
        line = _INLINE_CODE.sub("", line)
        for pattern in (_INLINE_LINK, _REFERENCE_DEF):
            found += [(n, t.group(1).strip("<>")) for t in pattern.finditer(line)]
    return found


def local_target(target: str) -> str | None:
    """The path part of a relative link, or None for web / mail links and pure anchors."""
    if _SCHEME.match(target) or target.startswith("#"):
        return None
    return unquote(target.split("#", 1)[0].split("?", 1)[0])


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """`file:line: (target)` for every relative link of `doc` whose file does not exist."""
    out = []
    for n, target in links(doc.read_text(encoding="utf-8")):
        path = local_target(target)
        if path is None:
            continue
        resolved = root / path.lstrip("/") if path.startswith("/") else doc.parent / path
        if not resolved.exists():
            out.append(f"{doc.relative_to(root)}:{n}: ({target}) does not exist")
    return out


def test_the_docs_are_found():
    assert (ROOT / "README.md").is_file()
    assert len(DOC_FILES) > 1


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = broken_links(doc)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path: Path):
    (tmp_path / "there.md").write_text("x")
    (tmp_path / "img.png").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [ok](there.md#part) ![ok](img.png) [web](https://example.com/a) [top](#anchor)\n"
                   "[mail](mailto:a@b.c) `[code](nowhere.md)` [missing](gone.md) [![badge](img.png)](gone.png)\n"
                   "```\n[in a fence](fenced.md)\n```\n[ref]: also_gone.md\n")
    assert broken_links(doc, root=tmp_path) == ["doc.md:2: (gone.md) does not exist", "doc.md:2: (gone.png) does not exist",
                                                "doc.md:6: (also_gone.md) does not exist"]
