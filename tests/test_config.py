from pathlib import Path

import pytest
import yaml

from phase1a.config import ConfigError, Phase1aConfig, apply_overrides, load_config
from phase1a.units import Interval, parse_duration_seconds, parse_interval


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
                         ["method.epochs=2.5", "method.lora.target_modules=[q_proj, v_proj]", "checkpoint.interval=500steps"])
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


def test_schema_is_shared_and_serialisable():
    config = Phase1aConfig.model_validate({"data": {"source": "/d.jsonl"}})
    assert Phase1aConfig.model_validate(config.model_dump(mode="json")) == config


def test_time_units():
    assert parse_interval("30m") == Interval(seconds=1800)
    assert parse_interval("2h,100steps") == Interval(seconds=7200, steps=100)
    assert parse_interval("30m").due(seconds_since=1800, steps_since=0)
    assert not parse_interval("500steps").due(seconds_since=1e9, steps_since=499)
    assert parse_duration_seconds("12h") == 43200
    with pytest.raises(ValueError):
        parse_duration_seconds("500steps")
    with pytest.raises(ValueError):
        parse_interval("1.5steps")
