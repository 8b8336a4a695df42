"""The README's links: the docs site checks its own (`make docs` builds it strictly), but
README.md is not one of its pages, so a moved or renamed page would break the front door
unseen."""

import re
from pathlib import Path

REPO = Path(__file__).parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(markdown: Path) -> set[str]:
    """The ids MkDocs gives a page's headings: lower case, punctuation dropped, spaces → '-'."""
    ids = set()
    in_code = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return ids


def test_every_relative_link_in_the_readme_names_a_file_and_heading_that_exist():
    links = [link for link in LINK.findall((REPO / "README.md").read_text(encoding="utf-8"))
             if "://" not in link]
    assert links, "the README links to its docs pages"
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {link}: no such heading"
