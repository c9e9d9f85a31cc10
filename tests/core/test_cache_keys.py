"""Cache keys that cannot go stale: each stage's key covers the code of every project module it imports, found
from the import graph (phase1a/core/fingerprint.py), so an edit anywhere in the code a stage runs re-runs it, and
rewording its prose (docstrings, comments, a setting's description) does not (tests/core/test_fingerprint.py)."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import PREPARED
from phase1a.core.fingerprint import PROJECT_ROOT, code_fingerprint, project_imports

CODE = ("phase1a", "tasks", "flows")


def copy_of_the_code(target: Path) -> Path:
    for package in CODE:
        shutil.copytree(PROJECT_ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def edit(path: Path) -> None:
    """An edit to the code that changes no behaviour (a comment would be prose: no key moves with one)."""
    path.write_text(path.read_text() + "\n\ndef _an_edit() -> int:\n    return 1\n")


def reword_the_prose(path: Path) -> int:
    """Every docstring and Field description in the file rewritten and a comment added, as a writer of the
    documentation would; the number of strings rewritten."""
    source = path.read_bytes()
    prose = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and \
                ast.get_docstring(node, clean=False) is not None:
            prose.append(node.body[0].value)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field":
            prose += [keyword.value for keyword in node.keywords if keyword.arg == "description"
                      and isinstance(keyword.value, ast.Constant)]
    starts = [0]  # where each line starts, in bytes: ast's columns are UTF-8 offsets
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    for number, string in enumerate(sorted(prose, key=lambda s: (s.lineno, s.col_offset), reverse=True)):
        begin = starts[string.lineno - 1] + string.col_offset
        end = starts[string.end_lineno - 1] + string.end_col_offset
        source = source[:begin] + repr(f"Reworded, {number}: {string.value[::-1]}").encode() + source[end:]
    path.write_bytes(b"# reworded\n" + source)
    return len(prose)


def test_the_import_graph_is_walked_from_the_source(tmp_path):
    code = copy_of_the_code(tmp_path / "code")
    plan = project_imports("tasks.plan", code)
    # tasks.plan -> phase1a.plan.planner -> phase1a.plan.calibration -> phase1a.evaluate.metrics ->
    # phase1a.evaluate.answers: four imports deep
    assert {"tasks.plan", "tasks.caching", "phase1a.plan.planner", "phase1a.plan.calibration",
            "phase1a.evaluate.metrics", "phase1a.evaluate.answers"} <= set(plan)
    assert "phase1a.model.build" in plan  # imported inside a function
    assert not {"flows.phase1a", "tasks.train", "tasks.tokenize"} & set(plan)  # the flow and other stages
    # Under TYPE_CHECKING an import never runs: phase1a.train.history names phase1a.store.base only there.
    assert "phase1a.store.base" not in project_imports("phase1a.train.history", code)
    # tokenize's key does not move with the plan's or validation's code
    tokenize = set(project_imports("tasks.tokenize", code))
    assert not {"phase1a.plan.calibration", "phase1a.evaluate.metrics", "phase1a.evaluate.answers"} & tokenize


def test_installed_as_a_wheel_third_party_packages_beside_it_are_not_the_projects(tmp_path):
    """In site-packages (the image installs the project as a wheel) torch and transformers lie beside phase1a: a
    stage's key covers the project's modules only, as in the checkout."""
    site = copy_of_the_code(tmp_path / "site-packages")
    for name in ("torch", "transformers", "prefect"):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text("import numpy\n")
    (site / "numpy.py").write_text("")
    plan = project_imports("tasks.plan", site)
    assert plan.keys() == project_imports("tasks.plan", PROJECT_ROOT).keys()
    assert {name.split(".")[0] for name in plan} <= set(CODE)


def test_an_edit_anywhere_in_a_stages_imports_changes_its_key_and_only_its(tmp_path):
    code = copy_of_the_code(tmp_path / "code")
    fingerprint = code_fingerprint.__wrapped__  # not the per-process cache: the files change under it here
    before = {stage: fingerprint(f"tasks.{stage}", code) for stage in ("stage", "tokenize", "plan", "validate")}
    edit(code / "phase1a" / "evaluate" / "answers.py")
    after = {stage: fingerprint(f"tasks.{stage}", code) for stage in before}
    assert after["plan"] != before["plan"] and after["validate"] != before["validate"]
    assert after["stage"] == before["stage"] and after["tokenize"] == before["tokenize"]


def test_prose_in_the_schema_moves_no_key_and_an_edit_to_rendering_moves_tokenizes(tmp_path):
    """Every stage imports the config schema: rewording its documentation moves none of their keys. The code that
    renders records is tokenize's (and its shards'), not the other stages'; they re-run only as its output changes
    (the tokenized data's fingerprint is in the plan's and validate's keys)."""
    code = copy_of_the_code(tmp_path / "code")
    fingerprint = code_fingerprint.__wrapped__
    modules = ("tasks.stage", "tasks.tokenize", "phase1a.data.shards", "tasks.plan", "tasks.validate")
    before = {module: fingerprint(module, code) for module in modules}
    schema = code / "phase1a" / "config" / "schema.py"
    assert all("phase1a.config.schema" in project_imports(f"tasks.{stage}", code)
               for stage in ("stage", "tokenize", "plan", "validate"))
    assert reword_the_prose(schema) > 100  # every section's and setting's
    assert {module: fingerprint(module, code) for module in modules} == before
    edit(code / "phase1a" / "data" / "render.py")
    after = {module: fingerprint(module, code) for module in modules}
    assert {module for module in modules if after[module] != before[module]} == {"tasks.tokenize",
                                                                                  "phase1a.data.shards"}


@pytest.mark.slow
@pytest.mark.prefect_server
def test_a_stage_re_runs_for_an_edit_to_its_code_never_for_prose(tmp_path, config_tree):
    """The CLI on a copy of the code: a plan; the same plan after the config schema's documentation was reworded
    (every stage imports the schema): all of it from the cache; then after an edit to the code that renders records,
    below tokenize (phase1a/data/render.py): tokenize re-runs, and so does the plan, whose data it changed.
    validate's code key is test_prose_in_the_schema_moves_no_key_and_an_edit_to_rendering_moves_tokenizes's: a run
    that validates would add a training to this test."""
    code = copy_of_the_code(tmp_path / "code")
    # Its own plan: the suite's flows share one Prefect home, and a plan (it names no paths) is keyed on the
    # settings, model and data, which other tests' jobs share.
    config_tree["method"]["seed"] = 11
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    runs = Path(config_tree["work_dir"]) / config_tree["name"]
    env = {**os.environ, "PYTHONPATH": str(code)}  # the copy shadows the installed project

    def plan() -> dict[str, str]:
        done = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "--config", str(config_path)], cwd=code,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        report = json.loads(max(runs.glob("*/report.json"), key=lambda p: p.stat().st_mtime).read_text())
        assert Path(report["run_dir"]).is_relative_to(runs)
        return {name: section["state"] for name, section in report["stages"].items()}

    assert plan() == {**PREPARED, "stage": "Completed", "tokenize": "Completed", "plan": "Completed"}
    reword_the_prose(code / "phase1a" / "config" / "schema.py")
    assert plan() == {**PREPARED, "stage": "Cached", "tokenize": "Cached", "plan": "Cached"}
    edit(code / "phase1a" / "data" / "render.py")
    assert plan() == {**PREPARED, "stage": "Cached", "tokenize": "Completed", "plan": "Completed"}


def test_the_training_key_changes_with_the_starting_adapter():
    """A warm start from another promoted version is another run (never resumed from this one's checkpoints); the
    same adapter named two ways (`promoted`, its path) is the same run, and so is a first night that found nothing
    promoted and started from the base."""
    from phase1a.config.schema import MethodConfig
    from phase1a.train.settings import training_key

    def key(init_from: str = "base", start: str | None = None) -> str:
        return training_key("data-fp", "model-fp", MethodConfig(init_from=init_from), 256, start)

    assert key("promoted", "v1-sha") != key("promoted", "v2-sha") != key()
    assert key("promoted", "v1-sha") == key("/promoted/versions/v1/adapter", "v1-sha")
    assert key("promoted", None) == key()
