"""The documents stay true to the tree: every relative link in README.md and docs/
resolves to a file or folder of this repository (and, for a `page.md#anchor` link, to a
heading of that page), no link or path leaves the repository, and no document carries
an internal milestone tag."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK_TEXT = r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text] or ![alt], one level of brackets inside
INLINE_LINK = re.compile(LINK_TEXT + r"\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HTML_LINK = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...
MILESTONE = re.compile(r"\bE[0-9]{1,2}\b")


def _prose(text: str) -> str:
    """The text with fenced code blocks and code spans blanked (a link there is code)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub("", text)


def _links(doc: Path) -> list[str]:
    prose = _prose(doc.read_text(encoding="utf-8"))
    found = [m.group(1) for m in INLINE_LINK.finditer(prose)]
    found += REFERENCE_LINK.findall(prose) + HTML_LINK.findall(prose)
    return [link for link in found if link and not EXTERNAL.match(link)]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # link text only
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _escapes(doc: Path, path: str) -> bool:
    """The path climbs above the repository root at some step (even if it comes back:
    `../../main/x` only works in a checkout named `main`)."""
    depth = len(doc.parent.relative_to(REPO).parts)
    for part in Path(path).parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        if depth < 0:
            return True
    return False


def _doc_id(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def test_there_are_documents_to_check():
    assert (REPO / "README.md") in DOCS and len(DOCS) > 5
    assert _links(REPO / "README.md"), "the README links to nothing"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_relative_link_resolves_inside_the_repository(doc: Path):
    broken = []
    for link in _links(doc):
        path, _, anchor = link.partition("#")
        path = path.split("?", 1)[0]
        if path.startswith("/"):
            broken.append(f"{link}: an absolute path (no clone has it)")
            continue
        target = (doc.parent / path).resolve() if path else doc.resolve()
        if _escapes(doc, path) or not target.is_relative_to(REPO):
            broken.append(f"{link}: outside the repository")
        elif not target.exists():
            broken.append(f"{link}: no such file or folder")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: {target.name} has no heading #{anchor}")
    assert not broken, f"{_doc_id(doc)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_no_document_points_outside_the_repository(doc: Path):
    """Not even as plain text: `../shared` (the authors' workspace) is in no clone."""
    text = doc.read_text(encoding="utf-8")
    assert "../shared" not in text and "/work/shared" not in text, _doc_id(doc)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_no_milestone_tags(doc: Path):
    """Features are named for what they do, not by the internal issue that built them."""
    tags = sorted(set(MILESTONE.findall(doc.read_text(encoding="utf-8"))))
    assert not tags, f"{_doc_id(doc)} mentions {tags}"


def test_the_anchor_rule_matches_github():
    page = REPO / "docs" / "robustness.md"
    assert "bounding-one-clients-work" in _anchors(page)
