"""Every relative link in README.md and docs/*.md points to a file that exists, and every `#anchor` in one to a
heading that exists.

Links are markdown links and images, `[text](target)` and `![alt](target)`, plus reference definitions
(`[name]: target`). Web and mail links (any `scheme:` target) are not checked. The path part is resolved relative
to the file holding the link; an `#anchor` on a markdown file (or a bare `#anchor`, meaning the same file) must be
one of that file's heading anchors as GitHub makes them: the heading text lower-cased, inline code's backticks and
every character other than letters, digits, `_`, `-` and spaces dropped, spaces turned into `-`, and `-1`, `-2` ...
added to repeats; an explicit `<a id="...">` / `<a name="...">` counts too. Fenced code blocks and inline code are
skipped, since text there is neither a link nor a heading.
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


def prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            yield n, line


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    found = []
    for n, line in prose_lines(text):
        line = _INLINE_CODE.sub("", line)
        for pattern in (_INLINE_LINK, _REFERENCE_DEF):
            found += [(n, t.group(1).strip("<>")) for t in pattern.finditer(line)]
    return found


def local_target(target: str) -> str | None:
    """The path part of a relative link ("" for a bare `#anchor`), or None for web / mail links."""
    if _SCHEME.match(target):
        return None
    return unquote(target.split("#", 1)[0].split("?", 1)[0])


_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=[\"']([^\"']+)[\"']")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a markdown file defines: its headings' slugs (repeats numbered) and explicit HTML anchors."""
    found, seen = set(), {}
    for _, line in prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        h = _HEADING.match(line)
        if h:
            base = slug(h.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """`file:line: (target) ...` for every relative link of `doc` whose file or anchor does not exist."""
    out = []
    for n, target in links(doc.read_text(encoding="utf-8")):
        path = local_target(target)
        if path is None:
            continue
        resolved = doc if path == "" else root / path.lstrip("/") if path.startswith("/") else doc.parent / path
        if not resolved.exists():
            out.append(f"{doc.relative_to(root)}:{n}: ({target}) does not exist")
            continue
        anchor = unquote(target.split("#", 1)[1]) if "#" in target else ""
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            out.append(f"{doc.relative_to(root)}:{n}: ({target}) has no heading #{anchor}")
    return out


def test_the_docs_are_found():
    assert (ROOT / "README.md").is_file()
    assert len(DOC_FILES) > 1


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = broken_links(doc)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_sees_a_broken_link(tmp_path: Path):
    (tmp_path / "there.md").write_text("# Part\n")
    (tmp_path / "img.png").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [ok](there.md#part) ![ok](img.png) [web](https://example.com/a) [top](#anchor) <a id=\"anchor\"></a>\n"
                   "[mail](mailto:a@b.c) `[code](nowhere.md)` [missing](gone.md) [![badge](img.png)](gone.png)\n"
                   "```\n[in a fence](fenced.md)\n```\n[ref]: also_gone.md\n")
    assert broken_links(doc, root=tmp_path) == ["doc.md:2: (gone.md) does not exist", "doc.md:2: (gone.png) does not exist",
                                                "doc.md:6: (also_gone.md) does not exist"]


def test_the_checker_sees_a_missing_anchor(tmp_path: Path):
    (tmp_path / "there.md").write_text("# Memory and throughput\n## Packed GEMMs (`rollout.prepack`)\n## Runs, 3 seeds (CPU)\n"
                                       "## Runs, 3 seeds (CPU)\n<a id=\"kept\"></a>\n```\n# not a heading\n```\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n[ok](there.md#memory-and-throughput) [ok](there.md#packed-gemms-rolloutprepack)\n"
                   "[ok](there.md#runs-3-seeds-cpu-1) [ok](there.md#kept) [ok](#top)\n"
                   "[bad](there.md#memory) [bad](there.md#not-a-heading) [bad](#nowhere) [bad](there.md#runs-3-seeds-cpu-2)\n")
    assert broken_links(doc, root=tmp_path) == ["doc.md:4: (there.md#memory) has no heading #memory",
                                                "doc.md:4: (there.md#not-a-heading) has no heading #not-a-heading",
                                                "doc.md:4: (#nowhere) has no heading #nowhere",
                                                "doc.md:4: (there.md#runs-3-seeds-cpu-2) has no heading #runs-3-seeds-cpu-2"]
