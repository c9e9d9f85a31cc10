"""The model card of a promoted version: a README.md in the Hugging Face model-card format (YAML metadata and a
body), made with huggingface_hub's ModelCard from what the run's report knows: the data, the config, the plan
against what happened, the validation table with its baseline and gate, the lineage and the flow run."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from phase1a.core.hardware import CUDA
from phase1a.core.locators import looks_like_hub_id
from phase1a.core.markdown import markdown_table
from phase1a.core.units import format_seconds
from phase1a.data.tokenized import TokenizedData
from phase1a.evaluate.present import metric_rows, validation_table
from phase1a.evaluate.result import ValidationResult
from phase1a.model.loading import BUILTIN_GGUF, builtin_origin
from phase1a.plan.result import Plan
from phase1a.train.result import TrainResult

CARD = "README.md"
Artifact = Literal["adapter", "merged", "gguf"]
_LIBRARY = {"adapter": "peft", "merged": "transformers", "gguf": "gguf"}

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## Data

{{ data }}

## Training

{{ training }}

## Validation

{{ validation }}

## Serving

{{ serving }}

## Lineage

{{ lineage }}

## Config

```yaml
{{ config }}```
"""


class BaseModelFacts(BaseModel):
    """What the base model's own card says: its Hub id and license, where known."""

    hub_id: str | None = None
    license: str | None = None

    @classmethod
    def of(cls, name_or_path: str, model_dir: Path) -> BaseModelFacts:
        """The id from the config (a Hub id), the license from the base's card (README.md beside its weights); a
        built-in model's from its GGUF."""
        from huggingface_hub import ModelCard

        if name_or_path in BUILTIN_GGUF:
            hub_id, declared = builtin_origin(name_or_path)
            return cls(hub_id=hub_id, license=declared)
        card = Path(model_dir) / CARD
        data = ModelCard.load(card).data.to_dict() if card.is_file() else {}
        return cls(hub_id=name_or_path if looks_like_hub_id(name_or_path) else None, license=data.get("license"))


class FlowRunLink(BaseModel):
    """The Prefect flow run a version came from (the card's lineage, report.json's `flow_run`)."""

    id: str | None = None
    name: str | None = None
    url: str | None = None  # only where PREFECT_UI_URL names a UI


class RunFacts(BaseModel):
    """What the flow knows of the run beyond the promote stage's own inputs."""

    config: dict[str, Any]  # the run's resolved config, credentials cut out (report.json's)
    data: TokenizedData
    plan: Plan
    flow_run: FlowRunLink | None = None


class CardFacts(BaseModel):
    """Everything the card says: the run's results as the stages returned them."""

    version: str
    parent: str | None  # the promoted version it was trained from; None: the base model
    started_from: str
    base: BaseModelFacts
    base_name: str  # the model as configured
    method: str  # lora, qlora, full
    run: RunFacts
    trained: TrainResult
    verdict: ValidationResult
    exports: dict[str, list[str]] = {}  # artifact -> its files


def model_card(facts: CardFacts, artifact: Artifact = "adapter") -> str:
    """The card's text for one artifact of the version (its library differs: peft, transformers, gguf)."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(
        model_name=facts.version, base_model=facts.base.hub_id, license=facts.base.license or "other",
        library_name=_LIBRARY[artifact], pipeline_tag="text-generation", datasets=_datasets(facts),
        tags=_tags(facts, artifact),
        eval_results=_eval_results(facts))
    card = ModelCard.from_template(
        data, template_str=TEMPLATE, title=facts.version, summary=_summary(facts, artifact),
        data=_data(facts), training=_training(facts), validation=_validation(facts), serving=_serving(facts),
        lineage=_lineage(facts), config=yaml.safe_dump(facts.run.config, sort_keys=False))
    return str(card)


def write_card(facts: CardFacts, directory: Path, artifact: Artifact) -> Path:
    path = Path(directory) / CARD
    path.write_text(model_card(facts, artifact))
    return path


def _tags(facts: CardFacts, artifact: Artifact) -> list[str]:
    return ["phase1a", facts.method, *(["lora"] if facts.method != "full" else []),
            *([artifact] if artifact != "adapter" else [])]


def _datasets(facts: CardFacts) -> list[str] | None:
    source = (facts.run.config.get("data") or {}).get("source")
    return [source] if isinstance(source, str) and looks_like_hub_id(source) else None


def _eval_results(facts: CardFacts):
    """The candidate's held-out metrics and benchmark scores as model-index entries: what the Hub shows."""
    from huggingface_hub import EvalResult

    results, examples = [], facts.verdict.candidate.examples
    for name, row in metric_rows(facts.verdict).items():
        if row.candidate is None:
            continue
        task, _, metric = name.rpartition("/")
        results.append(EvalResult(
            task_type="text-generation", metric_type=metric, metric_value=row.candidate,
            dataset_type=task or f"phase1a-held-out-{facts.verdict.sample_fingerprint[:12]}",
            dataset_name=f"lm-eval {task}" if task else f"held-out sample ({examples} examples)"))
    return results


def _summary(facts: CardFacts, artifact: Artifact) -> str:
    what = {"adapter": "A LoRA adapter" if facts.method != "full" else "A full fine-tune",
            "merged": "The model with its LoRA adapter merged in", "gguf": "GGUF files of the merged model"}[artifact]
    base = facts.base.hub_id or facts.base_name
    return (f"{what} of `{base}`, fine-tuned and promoted as version `{facts.version}` by phase1a after its gate "
            f"passed against {facts.verdict.baseline.source}.")


def _data(facts: CardFacts) -> str:
    data = facts.run.data
    skipped = sum(data.skipped.values())
    return "\n".join([
        f"- source: `{(facts.run.config.get('data') or {}).get('source')}`",
        f"- fingerprint: `{data.fingerprint}`",
        f"- examples: {data.train_examples} train, {data.validation_examples} held out",
        f"- skipped: {skipped}" + (f" ({', '.join(f'{k}: {v}' for k, v in data.skipped.items())})" if skipped else ""),
        f"- duplicates dropped: {data.duplicates_dropped}; truncated: {data.truncated_examples}; "
        f"max sequence length {data.max_seq_length}",
    ])


def _training(facts: CardFacts) -> str:
    plan, trained = facts.run.plan, facts.trained
    rows = [("steps", str(plan.steps), str(trained.steps)),
            ("train tokens", str(plan.train_tokens), str(trained.train_tokens)),
            ("tokens/s", f"{plan.tokens_per_second:.0f}", f"{trained.tokens_per_second:.0f}"),
            ("train seconds", format_seconds(plan.estimate.train_seconds), format_seconds(trained.wall_seconds)),
            ("micro batch", str(plan.micro_batch_size), str(trained.micro_batch_size or plan.micro_batch_size))]
    hardware = plan.detected if plan.target == CUDA else plan.target  # this machine's GPU: its device name
    lines = [f"Method `{facts.method}` on {hardware} ({plan.precision}), profile `{plan.profile}`, "
             f"epochs {plan.epochs:g}, sequence length {plan.max_seq_length}.", "",
             *markdown_table(("", "plan", "actual"), rows)]
    if trained.final_loss is not None:
        lines += ["", f"Final training loss {trained.final_loss:.4f}."]
    return "\n".join(lines)


def _validation(facts: CardFacts) -> str:
    verdict = facts.verdict
    header, *rows = validation_table(metric_rows(verdict), verdict.checks)
    return "\n".join([f"Baseline: {verdict.baseline.source}; {verdict.candidate.examples} held-out examples. "
                      f"Gate: {'PASS' if verdict.passed else 'FAIL'}.", "", *markdown_table(header, rows)])


def _serving(facts: CardFacts) -> str:
    serving = facts.verdict.serving
    lines = [f"- {serving.describe()}" if serving else "- vLLM multi-LoRA: not checked"]
    lines += [f"- {artifact}: {', '.join(f'`{name}`' for name in files)}" for artifact, files in facts.exports.items()]
    return "\n".join(lines)


def _lineage(facts: CardFacts) -> str:
    lines = [f"- started from: {facts.started_from}", f"- parent version: {facts.parent or 'none (the base model)'}"]
    if facts.run.flow_run is not None and facts.run.flow_run.id:
        where = f" ({facts.run.flow_run.url})" if facts.run.flow_run.url else ""
        lines.append(f"- flow run: `{facts.run.flow_run.name}` `{facts.run.flow_run.id}`{where}")
    return "\n".join(lines)
