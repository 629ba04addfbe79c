"""Every relative link in the README, CONTRIBUTING.md and docs/*.md resolves: the file (or folder)
exists, and a #anchor names a heading of the target page by GitHub's slug rules. No model is loaded."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, line


def heading_text(raw: str) -> str:
    """A heading as GitHub renders its text: code spans keep their content, links their text,
    emphasis markers and HTML tags go."""
    text = INLINE_CODE.sub(lambda m: m.group(2), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"\*{1,3}|~~", "", text)
    return re.sub(r"(?<!\w)_{1,3}(?=\S)|(?<=\S)_{1,3}(?!\w)", "", text)


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, marks, digits,
    connector punctuation, spaces and hyphens kept), each space a hyphen."""
    kept = "".join(c for c in text.lower() if c in " -" or unicodedata.category(c)[0] in "LMN" or c == "_")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(heading_text(match.group(2)))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that does not resolve, as 'line N: target (why)'."""
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if SCHEME.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                problems.append(f"line {number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"line {number}: {target} (no heading with the anchor #{anchor})")
    return problems


def test_slugs_follow_githubs_rules():
    assert slug(heading_text("Serving: `lookahead serve`")) == "serving-lookahead-serve"
    assert slug(heading_text("Choosing W, N, G: the runs")) == "choosing-w-n-g-the-runs"
    assert slug(heading_text("bf16 and fp16 near-ties")) == "bf16-and-fp16-near-ties"
    assert slug(heading_text("SmolLM2-135M on this CPU")) == "smollm2-135m-on-this-cpu"
    dated = "2026-12-04/05 (late night): **the** _cost_curve_"
    assert slug(heading_text(dated)) == "2026-12-0405-late-night-the-cost_curve"


def test_a_broken_link_and_a_wrong_anchor_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#no-section) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "line 4: missing.md (no such file)",
        "line 4: other.md#no-section (no heading with the anchor #no-section)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    assert broken_links(page) == []
