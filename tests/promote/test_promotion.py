"""Promotion to a local directory and to S3 (a real moto server over HTTP): versions, the pointer, atomicity."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import CHATML, date_records, make_tokenizer, write_jsonl
from helpers.servers import s3_client
from phase1a.config.schema import ValidationConfig
from phase1a.core.fingerprint import sha256_tree
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.baseline import PromotedSource, promoted_baseline
from phase1a.evaluate.metrics import evaluate
from phase1a.evaluate.scoring import Scoring
from phase1a.model.loading import load_for_eval
from phase1a.promote.artifacts import merge_adapter
from phase1a.promote.promotion import Promotion, PromotionConflict, promote
from phase1a.store.promoted import POINTER, PromotionError, PromotionRecord, read_pointer, version_chain
from phase1a.train.packing import TokenRows

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> list[Path]:
    """Two real peft adapters of the tiny model (randomly initialised, so they differ from the base and each other)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = load_for_eval(tiny_model_dir, None, torch.device("cpu"))
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        peft_model = get_peft_model(model, lora)
        peft_model.save_pretrained(root / f"adapter-{seed}")
        out.append(root / f"adapter-{seed}")
    return out


def record(adapter: Path, run: str = "run", parent: str | None = None) -> PromotionRecord:
    return PromotionRecord(run=run, adapter_sha256=sha256_tree(adapter, ("*.safetensors", "*.json")),
                           base_model_fingerprint="model-fp", sample_fingerprint="sample-fp",
                           metric_settings="settings", metrics={"exact_match": 0.5, "loss": 1.0}, parent=parent)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class FailAfter:
    """A real copy (or upload) that raises once `n` files are through: a disk filling up, a dropped connection."""

    def __init__(self, n: int, transfer) -> None:
        self.n, self.transfer, self.done = n, transfer, 0

    def __call__(self, *args) -> None:
        if self.done == self.n:
            raise OSError("No space left on device (simulated after %d files)" % self.n)
        self.transfer(*args)
        self.done += 1


def test_local_promotion_versions_the_adapter_and_moves_the_pointer(adapters, tmp_path):
    root = tmp_path / "promoted"
    first = promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), str(root))
    assert first.promoted and first.pointer.version == "v1"
    assert files_of(root / "versions" / "v1" / "adapter") == files_of(adapters[0])
    assert json.loads((root / POINTER).read_text())["artifacts"]["adapter"] == str(root / "versions" / "v1" / "adapter")
    assert read_pointer(str(root)) == first.pointer

    # The same adapter again (a re-run of a cached verdict) copies nothing and keeps the pointer.
    again = promote(Promotion({"adapter": adapters[0]}, "v1-again", record(adapters[0])), str(root))
    assert not again.promoted and again.pointer.version == "v1" and not (root / "versions" / "v1-again").exists()

    second = promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1]), expected_version="v1"), str(root))
    assert second.promoted and read_pointer(str(root)).version == "v2"
    assert (root / "versions" / "v1" / "adapter").is_dir()  # old versions stay, for rollback
    with pytest.raises(PromotionError, match="version v2 already exists"):
        promote(Promotion({"adapter": adapters[0]}, "v2", record(adapters[0])), str(root))


def test_each_version_names_its_parent_and_the_chain_reads_back(adapters, tmp_path):
    """A warm start records the version it was trained from: base -> v1 -> v2 reads back from the versions."""
    root = tmp_path / "promoted"
    assert version_chain(str(root)) == []
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), str(root))
    promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1], parent="v1")), str(root))
    assert [(p.version, p.parent) for p in version_chain(str(root))] == [("v2", "v1"), ("v1", None)]
    assert json.loads((root / "versions" / "v2" / "version.json").read_text())["parent"] == "v1"

    shutil.rmtree(root / "versions" / "v1")  # pruned by hand: the chain says which link is gone
    with pytest.raises(PromotionError, match=f"{root / 'versions' / 'v1' / 'version.json'}: version v1, a parent"):
        version_chain(str(root))


def test_a_failure_mid_copy_leaves_the_old_pointer_and_no_half_version(adapters, tmp_path):
    root = tmp_path / "promoted"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), str(root))
    before = (root / POINTER).read_bytes()
    assert len(files_of(adapters[1])) >= 2  # so the failure really comes mid-way
    failing = FailAfter(1, shutil.copyfile)
    with pytest.raises(OSError, match="No space left"):
        promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1])), str(root), copy_file=failing)
    assert failing.done == 1
    assert (root / POINTER).read_bytes() == before
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["v1"]  # the partial copy is gone


def test_a_pointer_moved_by_a_concurrent_promotion_is_not_overwritten(adapters, tmp_path):
    root = tmp_path / "promoted"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), str(root))
    other = record(adapters[1], "other").model_copy(update={"adapter_sha256": "other-adapter"})

    def copy_racing(source, target):
        if not (root / "versions" / "other").exists():  # another run promotes while this one copies
            promote(Promotion({"adapter": adapters[1]}, "other", other), str(root))
        shutil.copyfile(source, target)

    with pytest.raises(PromotionConflict, match="moved to other while v2 was copied"):
        promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1])), str(root), copy_file=copy_racing)
    assert read_pointer(str(root)).version == "other"
    assert (root / "versions" / "v2").is_dir()  # stored, reported, but not pointed at

    # A run validated against v1 refuses to promote over a pointer that is no longer v1.
    with pytest.raises(PromotionConflict, match="validated against v1"):
        promote(Promotion({"adapter": adapters[1]}, "v3", record(adapters[1]), expected_version="v1"), str(root))
    assert read_pointer(str(root)).version == "other"


def test_the_same_adapter_promoted_meanwhile_by_another_run_is_the_outcome(adapters, tmp_path):
    """Two runs of the same training (a manual run beside the nightly one) validate against v1 and promote the
    same adapter: the later one finds it promoted, keeps no second copy, and does not fail."""
    root = tmp_path / "promoted"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), str(root))

    def copy_racing(source, target):
        if not (root / "versions" / "twin").exists():  # the other run lands while this one copies
            promote(Promotion({"adapter": adapters[1]}, "twin", record(adapters[1], "twin"), expected_version="v1"),
                    str(root))
        shutil.copyfile(source, target)

    outcome = promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1]), expected_version="v1"),
                      str(root), copy_file=copy_racing)
    assert not outcome.promoted and outcome.pointer.version == "twin"
    assert sorted(p.name for p in (root / "versions").iterdir()) == ["twin", "v1"]
    # Validated against v1, promoting after the twin landed: already promoted, not a conflict.
    again = promote(Promotion({"adapter": adapters[1]}, "v3", record(adapters[1]), expected_version="v1"), str(root))
    assert not again.promoted and again.pointer.version == "twin"


def s3_keys(endpoint: str, bucket: str) -> list[str]:
    return sorted(item["Key"] for item in s3_client(endpoint).list_objects_v2(Bucket=bucket).get("Contents", []))


def test_s3_promotion_uploads_the_version_then_the_pointer(adapters, endpoint, bucket):
    destination = f"s3://{bucket}/models/dates/"
    first = promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination, endpoint_url=endpoint)
    assert first.promoted and first.pointer.artifacts["adapter"] == f"s3://{bucket}/models/dates/versions/v1/adapter/"
    expected = sorted(f"models/dates/versions/v1/adapter/{name}" for name in files_of(adapters[0]))
    assert s3_keys(endpoint, bucket) == sorted(expected + ["models/dates/promoted.json",
                                                           "models/dates/versions/v1/version.json"])
    key = "models/dates/versions/v1/adapter/adapter_model.safetensors"
    body = s3_client(endpoint).get_object(Bucket=bucket, Key=key)
    assert body["Body"].read() == (adapters[0] / "adapter_model.safetensors").read_bytes()
    assert read_pointer(destination, endpoint).version == "v1"

    second = promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1], parent="v1"), expected_version="v1"),
                     destination, endpoint_url=endpoint)
    assert second.promoted and read_pointer(destination, endpoint).version == "v2"
    assert [(p.version, p.parent) for p in version_chain(destination, endpoint)] == [("v2", "v1"), ("v1", None)]


def test_s3_failure_mid_upload_leaves_the_old_pointer(adapters, endpoint, bucket):
    from phase1a.promote.promotion import _upload

    destination = f"s3://{bucket}/m/"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination, endpoint_url=endpoint)
    before = s3_client(endpoint).get_object(Bucket=bucket, Key="m/promoted.json")["Body"].read()
    failing = FailAfter(1, _upload)
    with pytest.raises(OSError, match="No space left"):
        promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1])), destination, endpoint_url=endpoint,
                upload_file=failing)
    assert failing.done == 1
    assert s3_client(endpoint).get_object(Bucket=bucket, Key="m/promoted.json")["Body"].read() == before
    assert not [key for key in s3_keys(endpoint, bucket) if "/v2/" in key]  # the uploaded part was cleaned up


def test_s3_pointer_moved_by_a_concurrent_promotion_is_not_overwritten(adapters, endpoint, bucket):
    from phase1a.promote.promotion import _upload

    destination = f"s3://{bucket}/m/"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination, endpoint_url=endpoint)
    other = record(adapters[1], "other").model_copy(update={"adapter_sha256": "other-adapter"})

    def upload_racing(client, path, bucket_name, key):
        if read_pointer(destination, endpoint).version == "v1":  # another run lands its pointer mid-upload
            promote(Promotion({"adapter": adapters[1]}, "other", other), destination, endpoint_url=endpoint)
        _upload(client, path, bucket_name, key)

    with pytest.raises(PromotionConflict, match="moved while v2 was uploaded"):
        promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1])), destination, endpoint_url=endpoint,
                upload_file=upload_racing)
    assert read_pointer(destination, endpoint).version == "other"


def test_s3_the_same_adapter_promoted_meanwhile_by_another_run_is_the_outcome(adapters, endpoint, bucket):
    from phase1a.promote.promotion import _upload

    destination = f"s3://{bucket}/same/"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination, endpoint_url=endpoint)

    def upload_racing(client, path, bucket_name, key):
        if read_pointer(destination, endpoint).version == "v1":  # the other run lands its pointer mid-upload
            promote(Promotion({"adapter": adapters[1]}, "twin", record(adapters[1], "twin")), destination,
                    endpoint_url=endpoint)
        _upload(client, path, bucket_name, key)

    outcome = promote(Promotion({"adapter": adapters[1]}, "v2", record(adapters[1]), expected_version="v1"),
                      destination, endpoint_url=endpoint, upload_file=upload_racing)
    assert not outcome.promoted and outcome.pointer.version == "twin"
    assert read_pointer(destination, endpoint).version == "twin"
    assert not [key for key in s3_keys(endpoint, bucket) if key.startswith("same/versions/v2/")]  # removed


def test_a_promoted_adapter_on_s3_is_scored_again_on_a_new_sample(tiny_model_dir, adapters, endpoint, bucket, tmp_path):
    data = tokenize_dataset(write_jsonl(tmp_path / "d.jsonl", date_records(40)), make_tokenizer(), 256,
                            TokenizeOptions(validation_fraction=0.2), tmp_path / "cache" / "fp")
    rows = TokenRows.load(data.validation_path)
    indices = np.arange(4)
    settings, promote_to = ValidationConfig(max_examples=4, baseline="promoted"), f"s3://{bucket}/m/"
    promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), promote_to, endpoint_url=endpoint)
    pointer = read_pointer(promote_to, endpoint)
    assert pointer.sample_fingerprint == "sample-fp"  # scored on some other sample: must be scored again here

    scoring = Scoring(make_tokenizer(), rows, indices, settings, tmp_path / "cache", "model-fp")
    source = PromotedSource(tiny_model_dir, tmp_path / "staging", endpoint)
    baseline = promoted_baseline(pointer, scoring, source, torch.device("cpu"))
    local = evaluate(load_for_eval(tiny_model_dir, adapters[0], torch.device("cpu")), make_tokenizer(), rows, indices,
                     settings)
    assert "scored on this sample" in baseline.source
    assert baseline.metrics["loss"] == pytest.approx(local.loss, rel=1e-6)
    assert baseline.metrics["exact_match"] == local.exact_match

    with pytest.raises(Exception, match="trained from another base model"):
        promoted_baseline(pointer.model_copy(update={"base_model_fingerprint": "another"}), scoring, source,
                          torch.device("cpu"))


def test_a_chat_template_override_travels_with_the_merged_model(tiny_model_dir, adapters, tmp_path):
    """Data rendered with `data.chat_template` trains a model that expects that format: serving must get it."""
    from transformers import AutoTokenizer

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}")
    merged = merge_adapter(tiny_model_dir, adapters[0], tmp_path / "merged", chat_template=str(template))
    assert AutoTokenizer.from_pretrained(merged).chat_template == template.read_text()
    plain = merge_adapter(tiny_model_dir, adapters[0], tmp_path / "plain")
    assert AutoTokenizer.from_pretrained(plain).chat_template == CHATML  # the tiny model's own


def test_the_merged_model_loads_without_peft_and_computes_what_base_plus_adapter_does(tiny_model_dir, adapters,
                                                                                       tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = merge_adapter(tiny_model_dir, adapters[0], tmp_path / "merged")
    outcome = promote(Promotion({"adapter": adapters[0], "merged": merged}, "v1", record(adapters[0])),
                      str(tmp_path / "promoted"))
    stored = Path(outcome.pointer.artifacts["merged"])
    assert not (stored / "adapter_config.json").exists() and (stored / "tokenizer.json").is_file()
    ids = AutoTokenizer.from_pretrained(stored)("write 2020-03 in us format", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(stored).eval()(input_ids=ids).logits
        with_adapter = load_for_eval(tiny_model_dir, adapters[0], torch.device("cpu"))(input_ids=ids).logits
        base = load_for_eval(tiny_model_dir, None, torch.device("cpu"))(input_ids=ids).logits
    torch.testing.assert_close(plain, with_adapter, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(plain, base, atol=1e-3)  # the adapter really changed the weights


def test_an_s3_promotion_cut_off_at_the_pointer_is_retried_to_the_end(adapters, endpoint, bucket):
    """A 503 on the pointer's PUT after botocore's own attempts: the version is stored, the pointer not moved,
    and the retry (what the promote stage's Prefect retry runs) writes the version again and moves it."""
    from helpers.faults import Fault, FaultProxy
    from phase1a.core.retries import is_transient
    from phase1a.store.s3 import S3Error

    destination = f"s3://{bucket}/m/"
    with FaultProxy(endpoint) as proxy:
        proxy.faults = [Fault("slow_down", "PUT", rf"^/{bucket}/m/promoted\.json", times=3)]
        with pytest.raises(S3Error, match=rf"s3://{bucket}/m/promoted.json: PUT failed with S3 error "
                                                 "SlowDown") as slow:
            promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination, endpoint_url=proxy.url)
        assert is_transient(slow.value) and read_pointer(destination, endpoint) is None
        assert "m/versions/v1/version.json" in s3_keys(endpoint, bucket)  # stored, but pointed at by nothing

        again = promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination,
                        endpoint_url=proxy.url)
    assert again.promoted and read_pointer(destination, endpoint).version == "v1"
    # Another run's version of the same name is never overwritten.
    with pytest.raises(PromotionError, match="version v1 already exists"):
        promote(Promotion({"adapter": adapters[1]}, "v1", record(adapters[1], run="other")), destination,
                endpoint_url=endpoint)


def test_a_pointer_put_whose_answer_was_lost_is_recognised_as_ours(adapters, endpoint, bucket):
    """The PUT lands but its answer is cut off: botocore sends it again, the condition (no pointer yet) now
    fails with 412, and the pointer found is this promotion's own: promoted, not a conflict."""
    from helpers.faults import Fault, FaultProxy

    destination = f"s3://{bucket}/m/"
    with FaultProxy(endpoint) as proxy:
        proxy.faults = [Fault("drop", "PUT", rf"^/{bucket}/m/promoted\.json", times=1, after_bytes=0)]
        outcome = promote(Promotion({"adapter": adapters[0]}, "v1", record(adapters[0])), destination,
                          endpoint_url=proxy.url)
        assert [seen.fault for seen in proxy.requests("PUT", rf"^/{bucket}/m/promoted\.json")] == ["drop", None]
    assert outcome.promoted and read_pointer(destination, endpoint).version == "v1"
