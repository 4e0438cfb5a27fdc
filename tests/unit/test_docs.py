"""The documentation holds together: README stays a front page (at most 300 lines) that links every page of ``docs/``,
every relative link of README.md and ``docs/*.md`` resolves (the file, and a ``#anchor`` to a heading of it, by
GitHub's slug rules), every ``python`` code block compiles, and no issue number shows in what users read (README,
``docs/``, and the string literals and comments of the library's ``.py`` files).

A ``python`` block that is deliberately a fragment (it would not compile on its own) is marked by an HTML comment on
the line right before its fence, ``<!-- fragment -->`` (invisible on GitHub); it is then left out of the compile
check. Blocks of other languages (``bash``, ``yaml``, plain text) are not compiled."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 300
FRAGMENT_MARK = "<!-- fragment -->"
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?[0-9]|\bissue\s*#[0-9]", re.IGNORECASE)
LIBRARY = ("neighbor_ckpt", "megatron_patches")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _split(text: str) -> tuple[list[str], list[tuple[int, str, str, bool]]]:
    """The lines outside fenced code blocks (the inside replaced by blanks, so line numbers hold), and the blocks:
    (line of the opening fence, language, code dedented by the fence's indent, marked as a fragment)."""
    prose: list[str] = []
    blocks: list[tuple[int, str, str, bool]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        fragment = i > 0 and lines[i - 1].strip() == FRAGMENT_MARK
        start = i
        body = []
        prose.append("")
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            prose.append("")
            i += 1
        prose.append("")
        i += 1
        blocks.append((start + 1, lang, "\n".join(body) + "\n", fragment))
    return prose, blocks


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)        # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    prose, _ = _split(path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose:
        m = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    prose, _ = _split(path.read_text())
    found = []
    for lineno, line in enumerate(prose, 1):
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            found.append((lineno, m.group(1)))
    return found


def _relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def test_readme_is_a_front_page_of_at_most_300_lines() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines, more than {MAX_README_LINES}: move details to docs/"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.split("#", 1)[0]).resolve() for _, t in _links(README) if _relative(t)}
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "docs/ has no page"
    missing = [p.relative_to(REPO).as_posix() for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for lineno, target in _links(page):
        if not _relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(REPO).as_posix()}:{lineno}: {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{where}: no heading with that anchor in {dest.name}")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_python_blocks_compile(page: Path) -> None:
    _, blocks = _split(page.read_text())
    failed = []
    for line, lang, code, fragment in blocks:
        if lang not in ("python", "py") or fragment:
            continue
        name = f"{page.relative_to(REPO).as_posix()}:{line}"
        try:
            compile(code, name, "exec")
        except SyntaxError as e:
            failed.append(f"{name}: {e.msg} (line {e.lineno} of the block); mark a deliberate fragment with "
                          f"{FRAGMENT_MARK} on the line before its fence")
    assert not failed, "\n".join(failed)


def test_the_fence_parser_sees_the_blocks() -> None:
    """The checks above are only as good as the parser: it finds README's code blocks and its fragment mark."""
    _, blocks = _split("text\n<!-- fragment -->\n```python\nx = (\n```\n  ```python\n  y = 1\n  ```\n")
    assert [(lang, code, frag) for _, lang, code, frag in blocks] == [("python", "x = (\n", True),
                                                                      ("python", "y = 1\n", False)]
    assert any(lang == "python" for _, lang, _, _ in _split(README.read_text())[1])
    assert _slug("Continuing on fewer ranks (elastic)") == "continuing-on-fewer-ranks-elastic"
    assert _slug("Job files, `plan`, `launch`") == "job-files-plan-launch"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_issue_numbers_in_the_documentation(page: Path) -> None:
    hits = [f"{page.relative_to(REPO).as_posix()}:{n}: {line.strip()}"
            for n, line in enumerate(page.read_text().splitlines(), 1) if ISSUE_NUMBER.search(line)]
    assert not hits, "user-facing text names an issue number:\n" + "\n".join(hits)


def _strings_and_comments(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens
            if t.type in (tokenize.STRING, tokenize.COMMENT) or t.type == getattr(tokenize, "FSTRING_MIDDLE", -1)]


def test_no_issue_numbers_in_the_library_messages_and_comments() -> None:
    hits = []
    for package in LIBRARY:
        for path in sorted((REPO / package).rglob("*.py")):
            for line, text in _strings_and_comments(path):
                for m in ISSUE_NUMBER.finditer(text):
                    at = line + text.count("\n", 0, m.start())
                    hits.append(f"{path.relative_to(REPO).as_posix()}:{at}: {text.splitlines()[at - line].strip()}")
    assert not hits, "the library names an issue number in a message or comment:\n" + "\n".join(hits)
