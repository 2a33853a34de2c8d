"""The README, the pages of docs/, BENCHMARKS.md and scripts/README.md: every relative link resolves (its file, and its #anchor to a
heading of that file), and the README stays a ten-minute read."""

import glob
import os
import re

from tests.loopback import ROOT

README_MAX_LINES = 420
PAGES = [
    os.path.join(ROOT, name) for name in ("README.md", "BENCHMARKS.md", os.path.join("scripts", "README.md"))
]
PAGES += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(path: str) -> str:
    """The file without its code blocks and code spans, where a `](x)` is no link."""
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def anchors(path: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation but hyphens
    dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), name)) if name else page
            where = f"{os.path.relpath(page, ROOT)}: ({target})"
            if not os.path.exists(path):
                broken.append(f"{where}: no {os.path.relpath(path, ROOT)}")
            elif anchor and path.endswith(".md") and anchor not in anchors(path):
                broken.append(f"{where}: no heading #{anchor} in {os.path.relpath(path, ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_ten_minute_read():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    assert any(line.startswith("## Contents") for line in lines)
