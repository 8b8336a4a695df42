"""What the docs say that no build checks. The README's links: the docs site checks its own
(`make docs` builds it strictly), but README.md is not one of its pages, so a moved or renamed
page would break the front door unseen. The models page's table of settings, against the name
mapping import and export use."""

import dataclasses
import itertools
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


def _table(markdown: Path, header_start: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first Markdown table whose header starts with
    `header_start`."""
    lines = markdown.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header, *rows = (
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    return header, rows[1:]  # past the |---| line


def test_the_models_page_tables_every_model_setting_as_each_family_names_it():
    """docs/models.md's table of model settings names every ModelConfig field, and for each
    family every config.json field that import and export map to one (`HF_NAMES`)."""
    from flaxlm.config import ModelConfig
    from flaxlm.models import hf

    header, rows = _table(REPO / "docs" / "models.md", "| setting |")
    cells = {name: row for row in rows for name in re.findall(r"`(\w+)`", row[0])}
    own = {"name", "family", "init_from", "extend_context", "remat", "attention",
           "context_attention", "scan_layers"}  # no HF name
    assert set(cells) | own == {field.name for field in dataclasses.fields(ModelConfig)}
    for names in hf.FAMILY_NAMES.values():
        # A column may hold several families' names (the MoE families share one).
        column = next(i for i, title in enumerate(header) if names.config_class_name in title)
        for theirs, ours in {**names.shape_fields, **names.dropout_fields}.items():
            assert f"`{theirs}`" in cells[ours][column], (names.model_type, ours, theirs)
