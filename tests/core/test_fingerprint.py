"""The code a cache key covers (phase1a/core/fingerprint.py): a module's code without its prose, parsed from two
versions of a source. The keys these make, stage by stage, are tests/core/test_cache_keys.py's."""
from __future__ import annotations

import textwrap

from phase1a.core.fingerprint import (
    FORMAT_VERSIONS,
    PROJECT_ROOT,
    code_fingerprint,
    project_imports,
    source_fingerprint,
)

SETTINGS = '''
"""Settings."""
from pydantic import BaseModel, Field


class DataConfig(BaseModel):
    """Where the data is."""

    source: str = Field(description="A file, a directory or a Hub id.")
    split: str = Field("train", title="Split", description="The split to train on.", examples=["train"])
    overlong: str = Field("truncate", pattern="^(truncate|drop)$")  # what a long example becomes

    def check(self) -> None:
        """Says what is wrong."""
        if not self.source:
            raise ValueError(f"data.source: empty, in {self.split!r}")
        return {"source": self.source}[  "source"]
'''


def fingerprint(source: str) -> str:
    return source_fingerprint(textwrap.dedent(source))


def changed(old: str, new: str) -> str:
    assert old in SETTINGS
    return SETTINGS.replace(old, new)


def test_prose_leaves_the_code_fingerprint_as_it_was():
    """Docstrings, comments, layout and a Field's description, title and examples are not code."""
    reworded = SETTINGS
    for old, new in [('"""Settings."""', '"""Settings, reworded."""'),
                     ('"""Where the data is."""', '"""Where the data is.\n\n    A second paragraph."""'),
                     ('"""Says what is wrong."""', '"""Names the field."""'),
                     ("A file, a directory or a Hub id.", "A local file or a Hub dataset id."),
                     ('title="Split", ', 'title="The split", '), ('examples=["train"]', 'examples=["test"]'),
                     ("# what a long example becomes", "# reworded"), ('[  "source"]', '["source"]')]:
        reworded = reworded.replace(old, new)
    assert reworded != SETTINGS
    assert fingerprint(reworded) == fingerprint(SETTINGS)
    # a description first given, or taken away; a bare string below a field (an attribute's docstring)
    assert fingerprint(changed('Field("train", title="Split", description="The split to train on.", '
                               'examples=["train"])', 'Field("train")')) == fingerprint(SETTINGS)
    attribute_docstring = '    """The split\'s name."""\n\n    def check'
    assert fingerprint(changed("    def check", attribute_docstring)) == fingerprint(SETTINGS)


def test_every_string_that_is_code_is_in_the_fingerprint():
    """Error messages are behaviour (a user reads them; tokenize's output counts skipped records by their
    reason), as are dict keys, format strings, defaults and constraints; only a Field's prose is left out."""
    base = fingerprint(SETTINGS)
    for old, new in [("data.source: empty", "data.source: blank"),  # an error message
                     ("{self.split!r}", "{self.split}"),  # a format
                     ('{"source": self.source}', '{"path": self.source}'),  # a dict key
                     ('Field("train"', 'Field("validation"'),  # a default
                     ('pattern="^(truncate|drop)$"', 'pattern="^(truncate|drop|fail)$"'),  # a constraint
                     ("    def check", "    def checked")]:
        assert fingerprint(changed(old, new)) != base, new
    # `description` is prose only in a Field: a Prefect artifact's description is what the UI shows
    artifact = 'create_markdown_artifact(key="lengths", description="{}", markdown=text)\n'
    assert fingerprint(artifact.format("Token lengths")) != fingerprint(artifact.format("Lengths"))


def test_one_fingerprint_on_every_supported_python():
    """Fields a newer grammar adds (3.12's type_params) are left out when empty: every project file hashed alike
    on 3.11, 3.12 and 3.13 (227 files, checked by hand 2026-11-27). This pins the hash, so that a change to how
    code is hashed, which re-runs every stage once, is a decision and not an accident."""
    assert fingerprint("class A:\n    def f(self, x: int = 1) -> int:\n        return x\n") == \
        "4f8a251c7266b6ac7df79f81eefdcd39eacd3afcd9950967d7f0234a10a04edf"


def test_each_format_version_names_a_module_of_its_stage():
    """FORMAT_VERSIONS is keyed by a module the stage's output is keyed on: each is in its stage's import graph,
    and tokenize's in the graph of the module that names the tokenized directory (a module moved or renamed
    would leave its version versioning nothing)."""
    stages = {"tasks.stage": "tasks.stage", "phase1a.data.shards": "tasks.tokenize", "tasks.plan": "tasks.plan",
              "tasks.validate": "tasks.validate"}
    assert FORMAT_VERSIONS.keys() == stages.keys()
    for module, stage in stages.items():
        assert module in project_imports(stage, PROJECT_ROOT), (module, stage)
    assert "phase1a.data.shards" in project_imports(defining("tokenize_fingerprint", "tasks.tokenize"), PROJECT_ROOT)


def defining(function: str, stage: str) -> str:
    """The module of the stage's import graph that defines `function`, from the source (importing the stage would
    take seconds)."""
    found = [name for name, path in project_imports(stage, PROJECT_ROOT).items()
             if f"def {function}(" in path.read_text()]
    assert len(found) == 1, found
    return found[0]


def test_a_format_version_bump_re_runs_its_stage_and_those_that_read_it(monkeypatch):
    fingerprints = code_fingerprint.__wrapped__  # not the per-process cache: the table changes under it here
    directory = defining("tokenize_fingerprint", "tasks.tokenize")  # whose code names the tokenized directory
    modules = {"tasks.stage", "tasks.tokenize", "tasks.plan", "tasks.validate", "phase1a.data.shards", directory}
    before = {module: fingerprints(module) for module in modules}
    monkeypatch.setitem(FORMAT_VERSIONS, "phase1a.data.shards", FORMAT_VERSIONS["phase1a.data.shards"] + 1)
    after = {module: fingerprints(module) for module in modules}
    assert {module for module in modules if after[module] != before[module]} == {
        "tasks.tokenize", "phase1a.data.shards", directory}
    # The table is not code: the bump in the file moves no other module's key (every one imports fingerprint.py).
    source = (PROJECT_ROOT / "phase1a" / "core" / "fingerprint.py").read_text()
    assert source_fingerprint(source) == source_fingerprint(source.replace('"tasks.plan": 1', '"tasks.plan": 2'))
