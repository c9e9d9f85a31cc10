"""Warm starts (`method.init_from`): a night continues the promoted adapter, or a given one, instead of fresh
adapters on the base weights; the training key, the gate's baseline, the report and the promoted chain follow."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import date_records, resolved, write_jsonl
from phase1a.config.schema import ConfigError, MethodConfig, Phase1aConfig, config_from, load_config
from phase1a.model.adapters import ADAPTER_WEIGHTS, AdapterError, adapter_fingerprint
from phase1a.model.build import build_model
from phase1a.promote.promotion import Promotion, promote
from phase1a.start.warmstart import resolve_start
from phase1a.store.promoted import PromotionRecord, version_chain

METHOD = MethodConfig(lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})


def make_adapter(model_dir: Path, target: Path, r: int = 4, seed: int = 1) -> Path:
    """A real peft adapter of the tiny model, randomly initialised (lora_B too): its weights are not peft's
    fresh ones, so loading them shows."""
    from peft import LoraConfig, get_peft_model

    from phase1a.model.loading import load_for_eval

    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_for_eval(model_dir, None, torch.device("cpu")), lora).save_pretrained(target)
    return target


def config_for(tiny_model_dir: Path, tmp_path: Path, **method) -> Phase1aConfig:
    return Phase1aConfig.model_validate({
        "data": {"source": "unused", "staging_dir": str(tmp_path / "staging")},
        "model": {"name_or_path": str(tiny_model_dir)},
        "method": {**METHOD.model_dump(), **method},
        "promotion": {"to": str(tmp_path / "promoted")}})


def promote_as(version: str, adapter: Path, destination: str, base_fingerprint: str, parent: str | None = None,
               endpoint: str | None = None):
    record = PromotionRecord(run=version, adapter_sha256=adapter_fingerprint(adapter),
                             base_model_fingerprint=base_fingerprint, sample_fingerprint="sample",
                             metric_settings="settings", metrics={}, parent=parent)
    return promote(Promotion({"adapter": adapter}, version, record), destination, endpoint_url=endpoint)


# ---- the config ----------------------------------------------------------------------------------------------

def test_a_warm_start_is_gated_against_the_promoted_model_unless_a_baseline_was_chosen(tmp_path):
    tree = {"data": {"source": "d.jsonl"}, "method": {"init_from": "promoted"},
            "promotion": {"to": str(tmp_path / "promoted")}}
    assert config_from(tree, base=tmp_path).validation.baseline == "promoted"
    chosen = {**tree, "validation": {"baseline": "base"}}
    assert config_from(chosen, base=tmp_path).validation.baseline == "base"
    # A derived default stays a default: a whole config given back with another init_from derives it anew.
    warm = config_from(tree, base=tmp_path)
    assert config_from(warm, overrides=["method.init_from=base"], base=tmp_path).validation.baseline == "base"
    assert config_from({**tree, "method": {}}, base=tmp_path).validation.baseline == "base"

    with pytest.raises(ConfigError, match="method.init_from promoted needs promotion.to"):
        config_from({"data": {"source": "d.jsonl"}, "method": {"init_from": "promoted"}}, base=tmp_path)
    with pytest.raises(ConfigError, match="method: .*init_from 'promoted' continues a LoRA adapter; kind full "
                                          "starts from model.name_or_path"):
        config_from({**tree, "method": {"init_from": "promoted", "kind": "full"}}, base=tmp_path)


def test_init_from_a_local_adapter_directory(tiny_model_dir, tmp_path):
    """A path relative to the job file, like every path in it; no promotion.to: the baseline stays the base."""
    adapter = make_adapter(tiny_model_dir, tmp_path / "jobs" / "adapters" / "last-week")
    job = tmp_path / "jobs" / "job.yaml"
    job.write_text(yaml.safe_dump({"data": {"source": "d.jsonl"}, "model": {"name_or_path": str(tiny_model_dir)},
                                   "method": {**METHOD.model_dump(), "init_from": "adapters/last-week"}}))
    config = load_config(job)
    assert config.method.init_from == str(adapter) and config.validation.baseline == "base"
    start = resolve_start(config, resolved(config))
    assert (start.kind, start.adapter_dir, start.version) == ("adapter", str(adapter), None)
    assert start.fingerprint == adapter_fingerprint(adapter) and start.describe().startswith(f"adapter at {adapter}")

    as_url = config.model_copy(update={"method": config.method.model_copy(update={"init_from": f"file://{adapter}"})})
    assert resolve_start(as_url, resolved(config)).fingerprint == start.fingerprint


def test_the_trainable_adapter_starts_from_the_adapters_weights(tiny_model_dir, tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    saved = load_file(adapter / ADAPTER_WEIGHTS)
    model = build_model(tiny_model_dir, METHOD, gradient_checkpointing=False, init_adapter=adapter)
    trainable = {name.replace(".default", ""): p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable.keys() == saved.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(trainable[name].detach(), tensor, rtol=0, atol=0)
    fresh = build_model(tiny_model_dir, METHOD, gradient_checkpointing=False)
    assert all(not p.any() for name, p in fresh.named_parameters() if "lora_B" in name)  # what a cold start has


def test_a_mismatched_or_unsafe_adapter_fails_naming_the_path_and_the_field(tiny_model_dir, tmp_path):
    wider = make_adapter(tiny_model_dir, tmp_path / "r8", r=8)
    config = config_for(tiny_model_dir, tmp_path, init_from=str(wider))
    with pytest.raises(AdapterError, match=f"method.init_from: {wider}: .*: r is 8 in adapter_config.json, "
                                           "method.lora.r is 4"):
        resolve_start(config, resolved(config))
    with pytest.raises(AdapterError, match="r is 8"):  # the train stage checks again, on whatever host it runs
        build_model(tiny_model_dir, METHOD, gradient_checkpointing=False, init_adapter=wider)
    other_targets = METHOD.model_copy(update={"init_from": str(wider), "lora": METHOD.lora.model_copy(
        update={"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj"]})})
    with pytest.raises(AdapterError, match=r"target_modules is \['q_proj', 'v_proj'\] in adapter_config.json, "
                                           r"method.lora.target_modules is \['k_proj', 'q_proj', 'v_proj'\]"):
        resolve_start(config.model_copy(update={"method": other_targets}), resolved(config))

    pickled = make_adapter(tiny_model_dir, tmp_path / "pickled")
    (pickled / ADAPTER_WEIGHTS).rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match=f"{pickled}: no adapter_model.safetensors; adapters are read from "
                                           "safetensors only"):
        resolve_start(config_for(tiny_model_dir, tmp_path, init_from=str(pickled)), resolved(config))
    with pytest.raises(AdapterError, match=f"method.init_from: {tmp_path / 'nowhere'} is not a directory"):
        resolve_start(config_for(tiny_model_dir, tmp_path, init_from=str(tmp_path / "nowhere")), resolved(config))


def test_init_from_promoted_takes_the_promoted_version_or_the_base_on_a_first_night(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, tmp_path, init_from="promoted")
    model = resolved(config)
    first = resolve_start(config, model)
    assert (first.kind, first.adapter_dir, first.fingerprint) == ("base", None, None)
    assert first.note == f"nothing promoted yet at {tmp_path / 'promoted'}: started from the base model"

    v1 = make_adapter(tiny_model_dir, tmp_path / "v1")
    promote_as("v1", v1, config.promotion.to, model.fingerprint)
    start = resolve_start(config, model)
    stored = tmp_path / "promoted" / "versions" / "v1" / "adapter"
    assert (start.kind, start.version, start.path, start.adapter_dir) == ("promoted", "v1", str(stored), str(stored))
    assert start.fingerprint == adapter_fingerprint(v1)

    promote_as("v2", make_adapter(tiny_model_dir, tmp_path / "v2", seed=2), config.promotion.to,
               "another base model")
    with pytest.raises(AdapterError, match="version v2 at .* was trained on another base model"):
        resolve_start(config, model)


@pytest.mark.usefixtures("aws_env")
def test_warm_starts_from_s3(tiny_model_dir, tmp_path, endpoint, bucket):
    """The promoted version on S3, and an s3:// adapter prefix: staged to local disk, the same fingerprint."""
    destination = f"s3://{bucket}/models/"
    config = config_for(tiny_model_dir, tmp_path, init_from="promoted")
    config = config.model_copy(update={
        "data": config.data.model_copy(update={"s3_endpoint_url": endpoint}),
        "promotion": config.promotion.model_copy(update={"to": destination})})
    v1 = make_adapter(tiny_model_dir, tmp_path / "v1")
    promote_as("v1", v1, destination, resolved(config).fingerprint, endpoint=endpoint)
    start = resolve_start(config, resolved(config))
    assert start.version == "v1" and start.path == f"{destination}versions/v1/adapter/"
    assert Path(start.adapter_dir).is_relative_to(tmp_path / "staging")
    assert start.fingerprint == adapter_fingerprint(v1)

    by_url = config.model_copy(update={"method": config.method.model_copy(update={"init_from": start.path})})
    assert resolve_start(by_url, resolved(config)).fingerprint == adapter_fingerprint(v1)


# ---- the whole flow, two nights ------------------------------------------------------------------------------

def run_flow(tree: dict) -> dict:
    from flows.phase1a import phase1a

    config = Phase1aConfig.model_validate(tree)
    state = phase1a(config, return_state=True)
    report = json.loads(max((config.work_dir / config.name).glob("*/report.json"),
                            key=lambda p: p.stat().st_mtime).read_text())
    assert state.is_completed(), (state.message, report["stages"])
    return report


def first_step(report: dict, tree: dict, weights: Path | None) -> tuple[float, float]:
    """(the loss training logged at its first step, that of `weights` on the first step's examples): the first
    step's loss is the starting weights' before any update."""
    from phase1a.model.loading import load_for_eval
    from phase1a.train.packing import TokenRows, example_stream, teacher_forced

    metrics = Path(report["stages"]["train"]["result"]["output_dir"]) / "metrics.jsonl"
    logged = json.loads(metrics.read_text().splitlines()[0])["loss"]
    rows = TokenRows.load(report["stages"]["tokenize"]["result"]["train_path"])
    order, _ = example_stream(len(rows), report["stages"]["plan"]["result"]["epochs"], tree["method"].get("seed", 0))
    model = load_for_eval(Path(tree["model"]["name_or_path"]), weights, torch.device("cpu"))
    loss_sum, _, tokens = teacher_forced(model, rows, order[:tree["method"]["batch_size"]], batch_size=8)
    return logged, loss_sum / tokens


@pytest.mark.slow
@pytest.mark.prefect_server
def test_a_nightly_warm_start_continues_the_promoted_model_and_records_its_parent(config_tree, tmp_path):
    promoted = tmp_path / "promoted"
    config_tree["method"] |= {"init_from": "promoted"}
    # The gate here is about lineage: loose enough that a second epoch of this tiny model passes.
    config_tree["promotion"] = {"to": str(promoted)}
    config_tree["validation"] |= {"tolerances": {"loss": 0.05, "token_accuracy": 0.05, "exact_match": None}}

    night1 = run_flow(config_tree)  # nothing promoted yet: from the base weights, gated against the base
    assert night1["lineage"]["kind"] == "base" and "nothing promoted yet" in night1["lineage"]["note"]
    assert night1["validation"]["baseline"].startswith("base model (nothing promoted yet)")
    v1 = night1["validation"]["promotion"]["version"]
    assert night1["lineage"]["promoted_as"] == v1

    night2 = run_flow(config_tree)
    lineage, stored = night2["lineage"], promoted / "versions" / v1 / "adapter"
    assert (lineage["kind"], lineage["version"], lineage["path"]) == ("promoted", v1, str(stored))
    assert lineage["fingerprint"] == adapter_fingerprint(stored)
    assert lineage["started_from"].startswith(f"promoted {v1}")
    trained = night2["stages"]["train"]["result"]
    assert trained["start"]["version"] == v1 and not trained["reused_completed_run"]
    assert trained["output_dir"] != night1["stages"]["train"]["result"]["output_dir"]  # another start: another run
    # Each night's first step scores its starting weights: the base's on night 1, v1's on night 2.
    logged, base = first_step(night1, config_tree, None)
    assert logged == pytest.approx(base, abs=1e-4)
    logged, from_v1 = first_step(night2, config_tree, stored)
    assert logged == pytest.approx(from_v1, abs=1e-4) and abs(from_v1 - base) > 0.01
    assert night2["validation"]["baseline"].startswith(f"promoted {v1}")

    v2 = night2["validation"]["promotion"]["version"]
    chain = version_chain(str(promoted))
    assert [(p.version, p.parent) for p in chain] == [(v2, v1), (v1, None)]
    assert chain[0].started_from.startswith(f"promoted {v1}") and chain[1].started_from.startswith("base model")


@pytest.mark.slow
@pytest.mark.prefect_server
def test_a_nightly_replay_trains_on_the_new_shard_and_a_share_of_the_old(config_tree, tmp_path):
    from flows.phase1a import phase1a

    shards, promoted = tmp_path / "nightly", tmp_path / "promoted"
    shards.mkdir()
    for number in range(2):
        write_jsonl(shards / f"part-{number}.jsonl", date_records(48, seed=200 + number))
    config_tree["data"] |= {"source": str(shards)}
    config_tree["method"] |= {"init_from": "promoted", "epochs": 1, "replay_fraction": 0.5}
    config_tree["promotion"] = {"to": str(promoted)}
    # the gate is not what this test is about
    config_tree["validation"] |= {"tolerances": {"loss": 1.0, "token_accuracy": 1.0, "exact_match": None}}

    night1 = run_flow(config_tree)  # nothing promoted yet: the base, on all the data
    assert night1["replay"] is None and "replay" not in night1["stages"]  # no replay stage ran
    v1 = night1["validation"]["promotion"]["version"]
    trained_on = json.loads((promoted / "versions" / v1 / "adapter" / "trained_on.json").read_text())["shards"]
    assert len(trained_on) == 2

    write_jsonl(shards / "part-2.jsonl", date_records(48, seed=202))
    night2 = run_flow(config_tree)
    stage, tokenized = night2["stages"]["stage"]["result"], night2["stages"]["tokenize"]["result"]
    assert (stage["files_copied"], stage["files_reused"]) == (1, 2)
    assert (tokenized["shards_encoded"], tokenized["shards_reused"]) == (1, 2)
    replay = night2["replay"]
    assert replay["old_examples"] == night1["stages"]["tokenize"]["result"]["train_examples"]
    assert replay["replayed_examples"] == replay["new_examples"] > 0  # half of the mix, when there is enough old
    steps = night2["stages"]["train"]["result"]["steps"]
    assert steps == -(-(replay["new_examples"] + replay["replayed_examples"]) // config_tree["method"]["batch_size"])
    v2 = night2["validation"]["promotion"]["version"]
    assert night2["lineage"]["version"] == v1
    assert len(json.loads((promoted / "versions" / v2 / "adapter" / "trained_on.json").read_text())["shards"]) == 3

    state = phase1a(Phase1aConfig.model_validate(config_tree), return_state=True)  # a night with nothing new
    assert state.is_failed() and f"no training example is new since promoted {v2}" in state.message
