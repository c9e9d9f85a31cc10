"""One endpoint for the store's bucket: a MinIO or R2 store names its endpoint once (`store.endpoint_url`), and
promotion, the promoted pointer a warm start and the gate read, and a warm start's adapter there all use it.
Elsewhere `data.s3_endpoint_url` (or AWS) still serves."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from helpers.servers import s3_client
from phase1a.config.schema import Phase1aConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.baseline import baseline_identity
from phase1a.evaluate.validation import validate
from phase1a.model.adapters import adapter_fingerprint
from phase1a.promote.candidate import promote_candidate
from phase1a.start.warmstart import resolve_start
from phase1a.train.result import TrainResult

DEAD = "http://127.0.0.1:9"  # the discard port: nothing answers, so a request that goes anywhere but the store fails


def config_for(tiny_model_dir: Path, tmp_path: Path, store: str, endpoint: str, promote_to: str,
               **method) -> Phase1aConfig:
    return Phase1aConfig.model_validate({
        "cache_dir": str(tmp_path / "cache"),
        "data": {"source": "unused", "staging_dir": str(tmp_path / "staging")},  # no s3_endpoint_url
        "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, **method},
        "store": {"url": store, "endpoint_url": endpoint},
        "validation": {"max_examples": 8, "tolerances": {"loss": None, "token_accuracy": None, "exact_match": None}},
        "promotion": {"to": promote_to}})


def test_the_rule_the_stores_bucket_is_the_stores_endpoint_anything_else_the_datas():
    config = Phase1aConfig.model_validate({
        "data": {"source": "unused", "s3_endpoint_url": "http://data:9000"},
        "store": {"url": "s3://runs/nightly/", "endpoint_url": "http://store:9000"}})
    assert config.endpoint_for("s3://runs/models/") == "http://store:9000"
    assert config.endpoint_for("s3://runs") == "http://store:9000"
    assert config.endpoint_for("s3://runs-archive/models/") == "http://data:9000"
    assert config.endpoint_for("/mnt/models") == config.endpoint_for(None) == "http://data:9000"
    local_store = config.model_copy(update={"store": config.store.model_copy(update={"url": "/mnt/store"})})
    assert local_store.endpoint_for("s3://runs/models/") == "http://data:9000"
    aws_store = config.model_copy(update={"store": config.store.model_copy(update={"endpoint_url": None})})
    assert aws_store.endpoint_for("s3://runs/models/") is None  # the store is on AWS: so is its bucket


@pytest.mark.slow  # 80 s on two busy cores: the tiny model scored, promoted, fetched back
def test_promotion_and_warm_start_use_the_stores_endpoint_set_once(tiny_model_dir, aws_env, endpoint, bucket,
                                                                   tmp_path, monkeypatch):
    """The store on moto, its endpoint given only there; the default endpoint (AWS_ENDPOINT_URL) answers nothing.
    A passing run is promoted into the store's bucket, the gate's promoted baseline is read from it, and the next
    night's warm start fetches the promoted adapter from it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AWS_ENDPOINT_URL", DEAD)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a refused connection fails at once, not after botocore's retries
    promote_to = f"s3://{bucket}/models/"
    config = config_for(tiny_model_dir, tmp_path, f"s3://{bucket}/runs/", endpoint, promote_to)
    model = resolved(config)

    torch.manual_seed(1)
    adapter = tmp_path / "run" / "final"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).save_pretrained(adapter)
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(validation_fraction=0.2), tmp_path / "tok")
    verdict = validate(config, model, Path(data.validation_path), adapter)
    trained = TrainResult(adapter_dir=str(adapter), output_dir=str(adapter.parent), steps=1, resumed_from_step=None,
                          reused_completed_run=False, wall_seconds=1.0, train_tokens=1, tokens_per_second=1.0,
                          final_loss=None, checkpoints_written=0, checkpoint_seconds=0.0)
    outcome = promote_candidate(config, model, verdict, trained, tmp_path / "v1")
    assert outcome.promoted and outcome.pointer.artifacts["adapter"] == f"{promote_to}versions/v1/adapter/"
    keys = [item["Key"] for item in s3_client(endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert "models/promoted.json" in keys and "models/versions/v1/adapter/adapter_model.safetensors" in keys

    # The gate's promoted baseline (its identity in the verdict's key) and the warm start read it back from moto.
    nightly = config.model_copy(update={
        "method": config.method.model_copy(update={"init_from": "promoted"}),
        "validation": config.validation.model_copy(update={"baseline": "promoted"})})
    assert baseline_identity(nightly).startswith("promoted v1 ")
    start = resolve_start(nightly, model)
    assert start.kind == "promoted" and start.version == "v1" and start.fingerprint == adapter_fingerprint(adapter)
    assert Path(start.adapter_dir).is_relative_to(tmp_path / "staging")

    # Outside the store's bucket the default endpoint still serves: here it answers nothing.
    elsewhere = config.model_copy(update={"promotion": config.promotion.model_copy(
        update={"to": "s3://another-bucket/models/"})})
    with pytest.raises(Exception, match="127.0.0.1:9"):
        promote_candidate(elsewhere, model, verdict, trained, tmp_path / "v2")

    # The same adapter again (a second `make demo`): the pointer already names it, so nothing is built or copied;
    # the candidate's files are not even read.
    shutil.rmtree(adapter)
    again = promote_candidate(config, model, verdict, trained, tmp_path / "v1-again")
    assert not again.promoted and again.pointer.version == "v1" and not (tmp_path / "v1-again").exists()
