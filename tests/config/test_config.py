import logging
from pathlib import Path

import pytest
import yaml

from phase1a.config.schema import MOVED_KEYS, ConfigError, Phase1aConfig, apply_overrides, config_from, load_config
from phase1a.core.units import Interval, parse_interval

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_load_resolves_paths_against_the_config_file(tmp_path):
    config = load_config(write(tmp_path, {"data": {"source": "data/x.jsonl"}, "work_dir": "out"}))
    assert config.data.source == str(tmp_path / "data" / "x.jsonl")
    assert config.work_dir == tmp_path / "out"
    assert config.model.name_or_path == "smollm2-135m-instruct"  # the built-in alias is not a path


def test_overrides_keep_yaml_types(tmp_path):
    config = load_config(write(tmp_path, {"data": {"source": "x.jsonl"}}),
                         ["method.epochs=2.5", "method.lora.target_modules=[q_proj, v_proj]",
                          "checkpoint.interval=500steps"])
    assert config.method.epochs == 2.5
    assert config.method.lora.target_modules == ["q_proj", "v_proj"]
    assert parse_interval(config.checkpoint.interval) == Interval(steps=500)


@pytest.mark.parametrize(
    "tree, field, words",
    [
        ({}, "data", "Field required"),
        ({"data": {"source": "x", "sorce": "y"}}, "data.sorce", "Extra inputs"),
        ({"data": {"source": "x"}, "method": {"epochs": 0}}, "method.epochs", "greater than 0"),
        ({"data": {"source": "x"}, "checkpoint": {"interval": "every hour"}}, "checkpoint.interval", "not a time unit"),
        ({"data": {"source": "x"}, "hardware": {"target": "tpu"}}, "hardware.target", "'cpu'"),
    ],
)
def test_config_errors_name_the_field(tmp_path, tree, field, words):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, tree))
    assert f"  {field}: " in str(error.value) and words in str(error.value)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["method.epochs"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_config_file_relative_to_base_and_its_paths_relative_to_the_file(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.yaml").write_text(yaml.safe_dump(
        {"data": {"source": "../data/x.jsonl"}, "work_dir": "out", "method": {"epochs": 1}}))
    config = config_from(config_file="jobs/job.yaml", overrides=["method.epochs=2", "model.name_or_path=org/name"],
                         base=tmp_path)
    assert config.data.source == str(tmp_path / "data" / "x.jsonl")
    assert config.work_dir == tmp_path / "jobs" / "out"
    assert config.model.name_or_path == "org/name"  # a Hub id stays an id
    untouched = config_from(config_file=tmp_path / "jobs" / "job.yaml")
    changed = {k for k, v in config.model_dump().items() if v != untouched.model_dump()[k]}
    assert changed == {"method", "model"} and untouched.method.model_copy(update={"epochs": 2.0}) == config.method


@pytest.mark.parametrize("as_model", [False, True])
def test_whole_config_with_overrides_resolves_against_base(tmp_path, as_model):
    tree = {"data": {"source": "d.jsonl"}, "method": {"lora": {"r": 16}}}
    given = Phase1aConfig.model_validate(tree) if as_model else tree
    config = config_from(given, overrides=["method.lora.r=8", "window.max_duration=2h"], base=tmp_path)
    assert (config.method.lora.r, config.window.max_duration) == (8, "2h")
    assert config.data.source == str(tmp_path / "d.jsonl") and config.work_dir == tmp_path / "runs"
    assert tree["method"]["lora"]["r"] == 16  # the caller's tree (a flow parameter) is not modified


@pytest.mark.parametrize(
    "override, message",
    [
        ("method.epochs=0", "  method.epochs: Input should be greater than 0"),
        ("method.epochz=2", "  method.epochz: Extra inputs are not permitted"),
        ("method.lora.r=[1]", "  method.lora.r: Input should be a valid integer"),
        ("method=2", "  method: Input should be a valid dictionary"),
        ("method.epochs", "expected key=value"),
        ("data.source.path=x", "data.source.path: source is not a section"),
    ],
)
def test_a_bad_override_names_the_field(tmp_path, override, message):
    tree = {"data": {"source": "d.jsonl"}}
    for given in ({"config_file": write(tmp_path, tree)}, {"config": tree}):
        with pytest.raises(ConfigError) as error:
            config_from(**given, overrides=["method.seed=3", override], base=tmp_path)
        assert message in str(error.value), str(error.value)


def test_exactly_one_of_config_and_config_file(tmp_path):
    tree = {"data": {"source": "d.jsonl"}}
    with pytest.raises(ConfigError, match="exactly one of config .* and config_file .*, got both"):
        config_from(tree, write(tmp_path, tree))
    with pytest.raises(ConfigError, match="got neither"):
        config_from(overrides=["method.epochs=2"])
    with pytest.raises(ConfigError, match="config file not found: .*/configs/nope.yaml"):
        config_from(config_file="configs/nope.yaml", base=tmp_path)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_config_validates(path, caplog):
    with caplog.at_level(logging.WARNING, logger="phase1a"):
        config = load_config(path)
    assert config.work_dir == CONFIGS.parent / "runs"
    assert not moved_key_lines(caplog)  # written with the current keys


def test_shipped_example_jobs():
    lora = load_config(CONFIGS / "llama3-8b-lora-h100.yaml")
    assert (lora.model.name_or_path, lora.data.source, lora.data.validation_source) == (
        "meta-llama/Llama-3.1-8B-Instruct", "HuggingFaceH4/ultrachat_200k", "HuggingFaceH4/ultrachat_200k")
    assert (lora.data.split, lora.data.validation_split, lora.hardware.target) == ("train_sft", "test_sft", "h100")
    assert len(lora.method.lora.target_modules) == 7 and lora.method.base_precision == "16bit"
    qlora = load_config(CONFIGS / "llama3-8b-qlora-h100.yaml")
    assert qlora.method.base_precision == "4bit"
    assert qlora.method.model_copy(update={"base_precision": "16bit"}) == lora.method  # only the base differs
    nodes = load_config(CONFIGS / "llama3-8b-full-2x8-h100.yaml")
    assert (nodes.hardware.num_nodes, nodes.hardware.num_gpus, nodes.hardware.strategy) == (2, 8, "hsdp")
    assert nodes.method.kind == "full" and nodes.cache_dir == CONFIGS.parent / "cache"
    parquet = load_config(CONFIGS / "parquet-s3.yaml")
    assert parquet.data.source.startswith("s3://") and parquet.data.source.endswith("/")
    for name in ("h100", "h200"):
        deployed = load_config(CONFIGS / f"{name}.yaml")
        assert deployed.hardware.target == name and deployed.cache_dir == Path("/var/tmp/phase1a/cache")


def test_schema_is_shared_and_serialisable():
    config = Phase1aConfig.model_validate({"data": {"source": "/d.jsonl"}})
    assert Phase1aConfig.model_validate(config.model_dump(mode="json")) == config


# ---- keys that moved to their stage's section (MOVED_KEYS) -----------------------------------------------------

OLD_KEYS = {"validation": {"max_examples": 8, "promote_to": "promoted", "export": ["gguf", "merged"],
                           "early_stopping": 2, "early_stopping_min_delta": 0.01,
                           "during_training": "5steps", "during_training_examples": 4},
            "hardware": {"target": "cpu", "memory_headroom": 0.2, "calibration_steps": 2},
            "data": {"replay_fraction": 0.25}, "model": {"max_seq_length": 512},
            "method": {"init_from": "adapter"}}
NEW_KEYS = {"validation": {"max_examples": 8}, "promotion": {"to": "promoted", "export": ["merged", "gguf"]},
            "method": {"early_stopping_patience": 2, "early_stopping_threshold": 0.01, "eval_interval": "5steps",
                       "eval_examples": 4, "init_from": "adapter", "replay_fraction": 0.25},
            "hardware": {"target": "cpu"}, "plan": {"memory_headroom": 0.2, "calibration_steps": 2},
            "data": {"max_seq_length": 512}}
# A value for each key, old or new, where one is given alone.
MOVED_VALUES = {"promote_to": "p", "export": ["gguf"], "early_stopping": 2, "early_stopping_min_delta": 0.1,
                "during_training": "5steps", "during_training_examples": 4, "memory_headroom": 0.2,
                "calibration_steps": 2, "replay_fraction": 0.25, "max_seq_length": 512}


def job_file(tmp_path: Path, name: str, tree: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**tree, "data": {"source": "d.jsonl", **tree.get("data", {})}}))
    return path


def moved_key_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "phase1a" and " is now " in r.getMessage()]


def test_old_keys_load_as_the_new_ones_each_said_in_one_line(tmp_path, caplog):
    new = load_config(job_file(tmp_path, "new", NEW_KEYS))
    with caplog.at_level(logging.WARNING, logger="phase1a"):
        old = load_config(job_file(tmp_path, "old", OLD_KEYS))
    assert old == new and old.promotion.to == str(tmp_path / "promoted")  # relative to the file, as before
    assert moved_key_lines(caplog) == [f"{old_key} is now {new_key}; it still loads, for one release"
                                       for old_key, new_key in MOVED_KEYS.items()]


@pytest.mark.parametrize("old_key, new_key", MOVED_KEYS.items())
def test_an_old_key_beside_its_new_key_is_an_error_naming_both(tmp_path, old_key, new_key):
    (old_section, old_leaf), (new_section, new_leaf) = old_key.split("."), new_key.split(".")
    value = MOVED_VALUES[old_leaf]
    tree = {old_section: {old_leaf: value}, new_section: {new_leaf: value}}
    with pytest.raises(ConfigError) as error:
        load_config(job_file(tmp_path, "both", tree))
    assert f"{old_key} and {new_key} are both given: {new_key} replaces {old_key}" in str(error.value)
    assert str(tmp_path / "both.yaml") in str(error.value)


def test_a_set_of_an_old_key_works_on_a_file_with_either_key(tmp_path, caplog):
    """`--set validation.promote_to=...` (the CLI's and a deployment's overrides) on a job written before the
    move or after it: the override wins, moved to its new key; a new key's override replaces an old key too."""
    for name, tree in (("old", OLD_KEYS), ("new", NEW_KEYS)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="phase1a"):
            config = config_from(config_file=job_file(tmp_path, name, tree), base=tmp_path,
                                 overrides=["validation.promote_to=s3://models/p/", "validation.early_stopping=5",
                                            "hardware.calibration_steps=7", "validation.during_training=20steps",
                                            "model.max_seq_length=256"])
        assert (config.promotion.to, config.method.early_stopping_patience) == ("s3://models/p/", 5)
        assert (config.plan.calibration_steps, config.method.eval_interval, config.data.max_seq_length) == (
            7, "20steps", 256)
        assert config.promotion.export == ["merged", "gguf"] and config.method.early_stopping_threshold == 0.01
        assert (config.plan.memory_headroom, config.method.eval_examples, config.method.replay_fraction) == (
            0.2, 4, 0.25)
        assert "validation.promote_to is now promotion.to; it still loads, for one release" in moved_key_lines(caplog)
    old_file = job_file(tmp_path, "old", OLD_KEYS)
    assert config_from(config_file=old_file, overrides=["promotion.to=s3://models/q/"]).promotion.to == "s3://models/q/"
    assert config_from(config_file=old_file, overrides=["validation.promote_to=null"]).promotion.to is None


def test_promote_merged_from_before_exports_still_adds_merged(tmp_path):
    for tree in ({"validation": {"promote_merged": True}}, {"validation": {"promote_merged": True, "export": ["gguf"]}},
                 {"validation": {"promote_merged": True}, "promotion": {"export": ["gguf"]}}):
        exports = ["merged", "gguf"] if "gguf" in str(tree) else ["merged"]
        assert load_config(job_file(tmp_path, "merged", tree)).promotion.export == exports, tree
    assert load_config(job_file(tmp_path, "off", {"validation": {"promote_merged": False}})).promotion.export == []
