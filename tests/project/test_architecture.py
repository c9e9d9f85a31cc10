"""The code's shape, checked on its source: layers that point down, recipes that read at once, one home for each
fact, and a GPU host that imports what it runs without what it lacks."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import bare_gpu_host_env
from phase1a.core.fingerprint import PROJECT_ROOT

LAYERS = {"phase1a": 0, "tasks": 1, "flows": 2}  # the library, the stages, the flow and its CLI
SHARED_STAGE_GLUE = "tasks.caching"  # the one tasks module other stages import: Prefect glue, no recipe
MAX_LINES, MAX_PARAMETERS = 60, 6
# Signatures another library dictates, with the reason.
_FLAT = "a torch.library op's schema is flat: tensors and numbers, no settings object"
EXEMPT = {"phase1a/model/attention.py:varlen_attention_forward": "transformers' AttentionInterface calls it with these",
          "phase1a/model/attention.py:varlen_attention": _FLAT,
          "phase1a/model/attention.py:_varlen_attention_fake": _FLAT,
          "phase1a/model/attention.py:varlen_attention_backward": _FLAT,
          "phase1a/model/attention.py:_varlen_attention_backward_fake": _FLAT}


def sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (PROJECT_ROOT / package).rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(PROJECT_ROOT).as_posix()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in the file, inside functions and TYPE_CHECKING blocks too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
    return found


def test_layers_point_down():
    """flows/ -> tasks/ -> phase1a/ -> third-party: the library never imports a stage or the flow, and a stage
    never imports another stage (what stages share lives in the library)."""
    wrong = []
    for path in sources(*LAYERS):
        own = relative(path).split("/")[0]
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top not in LAYERS:
                continue
            sideways = own == top == "tasks" and module != SHARED_STAGE_GLUE
            if LAYERS[top] > LAYERS[own] or sideways:
                wrong.append(f"{relative(path)}:{line} imports {module}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


# A test or benchmark exercises the library; from tasks/ it takes a stage's task function (`*_task`) and nothing
# more. The exceptions: tests of a task itself, each with why.
_STAGE_OUTPUT = "a staged copy is where the stage task's cache looks for it: its StageCache's output, staged_copy"
TASK_TESTS = {
    "tests/flows/test_keys_travel.py":
        "the stages' keys on two hosts: the fingerprints their StageCaches are built from",
    "tests/data/test_stage.py": _STAGE_OUTPUT,
    "tests/data/test_stage_s3.py": _STAGE_OUTPUT,
    "tests/data/test_hub_datasets.py": _STAGE_OUTPUT,
}


def task_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every name the file imports from tasks/ ('*': a whole module, `import tasks.x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tasks":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "*") for alias in node.names if alias.name.split(".")[0] == "tasks"]
    return found


def beyond_the_task(path: Path) -> list[str]:
    return [f"{relative(path)}:{line} imports {name} from {module}" for line, module, name in task_imports(path)
            if not name.endswith("_task")]


def test_tests_and_benchmarks_import_the_library_not_a_stages_recipe():
    """What a test or benchmark runs, it imports from phase1a/; a task module is the stage's recipe, imported for
    its task only (to run the stage as the flow does), save by a test of the task itself."""
    wrong = [offence for path in sources("tests", "benchmarks") if relative(path) not in TASK_TESTS
             for offence in beyond_the_task(path)]
    assert not wrong, "library code taken from tasks/ (import it from phase1a/):\n" + "\n".join(wrong)


def test_the_task_tests_are_still_needed():
    unneeded = [name for name in TASK_TESTS if not beyond_the_task(PROJECT_ROOT / name)]
    assert not unneeded, f"no longer needed: {unneeded}"


# The library's packages, lowest first: each imports only from those before it (and itself). The modules above
# them, run_report.py (report.json), plots.py and tracking/, may import any.
PACKAGES = ("core", "store", "data", "config", "model", "start", "train", "evaluate", "plan", "promote")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PROJECT_ROOT).with_suffix("").parts).removesuffix(".__init__")


def project_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports: `from package import module` names the module, not the package."""
    found = set()
    for _, module in imported_modules(path):
        found.add(module)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known} - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = sources(*LAYERS)
    known = {module_name(path) for path in paths}
    return {module_name(path): project_imports(path, known) for path in paths}


def package_level(module: str) -> int:
    parts = module.split(".")
    return PACKAGES.index(parts[1]) if len(parts) >= 2 and parts[1] in PACKAGES else len(PACKAGES)


# What a stage hands the next lives in its package's result.py; the data package's two stages hand over records
# whose module is the format itself (the staged copy's record, the tokenized dataset's files and readers).
RESULT_HOMES = {"StagedData": "phase1a.data.staging", "TokenizedData": "phase1a.data.tokenized"}


def test_what_a_stage_hands_on_lives_in_its_packages_result_module():
    wrong = []
    for path in sources("tasks"):
        tree = ast.parse(path.read_text())
        homes = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_task") and isinstance(node.returns, ast.Name):
                name, home = node.returns.id, homes.get(node.returns.id, f"{relative(path)} itself")
                expected = RESULT_HOMES.get(name)
                if (home != expected) if expected else not home.endswith(".result"):
                    wrong.append(f"{relative(path)}: {node.name} returns {name}, defined in {home}")
    assert not wrong, "\n".join(wrong)


def test_library_packages_point_down():
    """core <- store <- data <- config <- model <- start <- train <- evaluate <- plan <- promote: a newcomer finds
    where a change belongs from the tree, and a lower package never reaches up."""
    assert {p.name for p in (PROJECT_ROOT / "phase1a").iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == set(PACKAGES) | {"tracking"}
    wrong = [f"{module} imports {target}" for module, targets in import_graph().items() if module.startswith("phase1a.")
             for target in sorted(targets) if package_level(target) > package_level(module)]
    assert not wrong, "imports against the package order:\n" + "\n".join(wrong)


# Test folders beside the library's packages: what sits above them (the flow, its operation, the project itself,
# the benchmark tools).
ABOVE_THE_LIBRARY = {"flows": "the flow, its CLI and reports, runs across hosts",
                     "operations": "deployments, workers, launchers, Kubernetes, the image, the lock",
                     "project": "the architecture, the docs, deprecations", "benchmarks": "the GPU check's tools"}


def test_a_modules_tests_are_found_by_its_package():
    """tests/<package>/ holds the tests of phase1a/<package>/; only the shared helpers and conftest sit above."""
    tests = PROJECT_ROOT / "tests"
    groups = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in ("helpers", "__pycache__")}
    assert groups <= set(PACKAGES) | {"tracking"} | set(ABOVE_THE_LIBRARY), groups
    assert not sorted(tests.glob("test_*.py")), "a test file outside its package's folder"


def test_no_import_cycles():
    """No module reaches itself through the modules it imports (inside functions and TYPE_CHECKING too)."""
    graph, cycles = import_graph(), []

    def reaches(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    return path + [start]
                if target not in seen:
                    seen.add(target)
                    stack.append((target, path + [target]))
        return None

    for module in sorted(graph):
        cycle = reaches(module)
        if cycle and not any(set(cycle) == set(found) for found in cycles):
            cycles.append(cycle)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


# One name for one thing: no two classes, and no two public top-level functions, of phase1a/, tasks/ and flows/
# share a name, so an import, a search or a traceback names one thing. A private function (_name) is its module's
# own and may repeat. The names used twice on purpose, with why:
SHARED_NAMES = {"main": "each command-line module's entry point (`python -m phase1a.config.reference`, flows/cli.py)"}


def defined_names(path: Path) -> list[tuple[str, int]]:
    """(name, line) of the module's top-level classes and public functions."""
    return [(node.name, node.lineno) for node in ast.parse(path.read_text(), filename=str(path)).body
            if isinstance(node, ast.ClassDef) or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not node.name.startswith("_")]


def name_homes() -> dict[str, list[str]]:
    homes: dict[str, list[str]] = {}
    for path in sources(*LAYERS):
        for name, line in defined_names(path):
            homes.setdefault(name, []).append(f"{relative(path)}:{line}")
    return homes


def test_one_name_for_one_thing():
    shared = [f"{name}: {', '.join(where)}" for name, where in sorted(name_homes().items())
              if len(where) > 1 and name not in SHARED_NAMES]
    assert not shared, "defined more than once (rename one, for what it is):\n" + "\n".join(shared)


def test_the_shared_names_are_still_shared():
    homes = name_homes()
    assert not [name for name in SHARED_NAMES if len(homes.get(name, [])) < 2]


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            yield node.name, node.end_lineno - node.lineno + 1, len(names), node.lineno


def test_functions_read_at_once():
    """None over ~60 lines; more than 6 parameters become a settings object."""
    too_long, too_many = [], []
    for path in sources(*LAYERS):
        for name, lines, parameters, line in functions(path):
            if f"{relative(path)}:{name}" in EXEMPT:
                continue
            if lines > MAX_LINES:
                too_long.append(f"{relative(path)}:{line} {name}: {lines} lines")
            if parameters > MAX_PARAMETERS:
                too_many.append(f"{relative(path)}:{line} {name}: {parameters} parameters")
    assert not too_long + too_many, "\n".join(too_long + too_many)


def test_the_exemptions_are_still_needed():
    present = {f"{relative(path)}:{name}" for path in sources(*LAYERS) for name, *_ in functions(path)}
    assert set(EXEMPT) <= present


def _offences(path: Path) -> list[str]:
    """Facts restated outside their home: the -100 label, powers of 1024, a rename that is not atomic."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)
                and node.operand.value == 100):
            found.append(f"{node.lineno}: -100 (phase1a/core/labels.py: IGNORE_INDEX)")
        power = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
        if power and isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant) \
                and (node.left.value, node.right.value) in ((1024, 2), (1024, 3), (2, 20), (2, 30)):
            found.append(f"{node.lineno}: a byte unit (phase1a/core/units.py: KIB, MIB, GIB)")
        if isinstance(node, ast.Attribute) and node.attr in ("replace", "rename") and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            found.append(f"{node.lineno}: os.{node.attr} (phase1a/core/atomic.py: atomic_path, write_atomically)")
    return found


@pytest.mark.parametrize("home", ["phase1a/core/labels.py", "phase1a/core/units.py", "phase1a/core/atomic.py"])
def test_each_fact_is_stated_in_its_home(home):
    assert _offences(PROJECT_ROOT / home), f"{home} no longer states its fact: update this test"


def test_facts_are_not_restated_elsewhere():
    homes = {"phase1a/core/labels.py", "phase1a/core/units.py", "phase1a/core/atomic.py"}
    offences = [f"{relative(path)}:{offence}" for path in sources(*LAYERS, "benchmarks")
                if relative(path) not in homes for offence in _offences(path)]
    assert not offences, "\n".join(offences)


def test_the_config_choices_are_read_from_their_registries():
    from phase1a.config.schema import DataConfig, HardwareConfig
    from phase1a.core.hardware import HARDWARE_KINDS
    from phase1a.data.records import RECORD_FORMATS

    assert tuple(HardwareConfig.model_json_schema()["properties"]["target"]["enum"]) == HARDWARE_KINDS
    for name in RECORD_FORMATS:
        assert DataConfig(source="d.jsonl", format=name).format == name
    with pytest.raises(ValueError, match=f"one of: auto, {', '.join(RECORD_FORMATS)}"):
        DataConfig(source="d.jsonl", format="yaml-ish")


# What runs on a bare GPU host (benchmarks/gpu_check.py's parts): the train loop, tokenizing, the plan, the benchmarks.
GPU_HOST_MODULES = ("phase1a.train.loop", "phase1a.train.rank", "phase1a.data.tokenizing", "phase1a.plan.planner",
                    "phase1a.plan.present", "phase1a.train.steps", "phase1a.plan.calibration",
                    "benchmarks.train_throughput", "benchmarks.plan_accuracy", "benchmarks.tokenize_throughput",
                    "benchmarks.packed_rows", "benchmarks.gpu_check", "benchmarks.attention_op",
                    "benchmarks.step_meter")


def test_a_bare_gpu_host_imports_what_it_runs(tmp_path, tiny_model_dir):
    """No boto3, Prefect or `datasets` there: what the GPU check runs imports without them, and a model in a
    local directory is prepared without staging (the dry run in test_gpu_check.py runs every part that way;
    this is the quick check)."""
    code = ("import importlib, sys\nfor name in sys.argv[2:]:\n    importlib.import_module(name)\n"
            "from phase1a.config.schema import Phase1aConfig\nfrom phase1a.model.loading import prepare_model\n"
            "tree = {'data': {'source': 'unused'}, 'model': {'name_or_path': sys.argv[1]}}\n"
            "config = Phase1aConfig.model_validate(tree)\n"
            "print('prepared', prepare_model(config).path)")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir), *GPU_HOST_MODULES], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, env=bare_gpu_host_env(tmp_path / "bare-host"), timeout=300)
    assert done.returncode == 0 and f"prepared {tiny_model_dir}" in done.stdout, done.stderr[-3000:]


# What imports without torch, transformers or peft: the flow (`prefect deploy` and a worker's flow run import it
# before any stage runs), the CLI, the report and the runs list. A stage that loads a model imports that work inside
# its task (tasks/caching.py).
WITHOUT_TORCH = ("flows.phase1a", "flows.cli", "flows.report", "flows.runs", "flows.tracking")


def test_the_flow_and_the_cli_import_without_torch():
    code = ("import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
            "print(sorted({'torch', 'transformers', 'peft', 'safetensors', 'datasets'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code, *WITHOUT_TORCH], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", "imported with the flow: " + done.stdout
