"""The documentation stays true to the code: the configuration reference is the schema's, every config field
says what it does, every link lands, and the README stays a short entry point."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from phase1a.config.reference import PAGE, _section_model, render
from phase1a.config.schema import Phase1aConfig
from phase1a.data.records import RECORD_FORMATS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a link is a link."""
    return _CODE.sub("", _FENCE.sub("", text))


def _links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text()))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to hyphens, and a
    repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for title in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _section_models(model: type[BaseModel] = Phase1aConfig, prefix: str = ""):
    yield prefix.rstrip(".") or model.__name__, model
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)  # a section, or an optional one (`Section | None`)
        if section is not None:
            yield from _section_models(section, f"{prefix}{name}.")


def test_configuration_reference_is_generated_from_the_schema():
    assert PAGE.is_file(), "docs/configuration.md is missing: run `python -m phase1a.config.reference --write`"
    assert PAGE.read_text() == render(), (
        "docs/configuration.md differs from the schema in phase1a/config/schema.py: run "
        "`python -m phase1a.config.reference --write` (or `make docs`) and commit the result")


@pytest.mark.parametrize("where, model", list(_section_models()), ids=[where for where, _ in _section_models()])
def test_every_config_field_has_a_description(where, model):
    missing = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{where}: fields without a description in phase1a/config/schema.py: {', '.join(missing)}"


def test_readme_links_every_docs_page_and_each_exists():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in _links(README)
              if target.split("#")[0].startswith("docs/")}
    missing = sorted(str(path.relative_to(ROOT)) for path in linked if not path.is_file())
    assert not missing, f"README.md links to docs pages that do not exist: {missing}"
    unlisted = sorted(str(page.relative_to(ROOT)) for page in DOCS if page.resolve() not in linked)
    assert not unlisted, f"docs pages README.md does not link (its Documentation list): {unlisted}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target} (no such heading in {destination.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_each_docs_page_opens_with_a_title_and_what_it_covers(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2].strip() and not lines[2].startswith("#"), (
        f"{page.name}: start with '# Title', a blank line, then one line saying what the page covers")
    assert lines[3] == "", f"{page.name}: the statement of what the page covers is one line"


def test_record_formats_table_is_the_registry():
    table = render().split("## Record formats", 1)[1]
    assert re.findall(r"^\| `(\w+)` \|", table, flags=re.M) == list(RECORD_FORMATS)


def test_readme_is_a_short_entry_point():
    lines = len(README.read_text().splitlines())
    assert lines < 200, f"README.md has {lines} lines: move detail into docs/ and link it"
