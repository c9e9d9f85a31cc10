"""The phase1a flow: stage -> tokenize -> plan -> train -> validate, one Prefect task each."""
from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from phase1a.config import Phase1aConfig, config_from
from phase1a.models import model_fingerprint, model_max_positions, resolve_model, tokenizer_fingerprint
from flows.report import RunReport
from tasks.plan import format_plan, plan_fingerprint, plan_task, publish_plan
from tasks.stage import StagedData, source_fingerprint, stage, stage_model
from tasks.tokenize import TokenizeOptions, publish_length_report, tokenize, tokenize_fingerprint
from tasks.train import record_run, train_settings, train_task
from tasks.validate import (format_table, promote_task, publish_validation, validate_fingerprint,
                            validate_task, validation_section)


class GateFailed(RuntimeError):
    pass


def _stage(report: RunReport, name: str, field: str, config: Phase1aConfig) -> StagedData:
    """Stage one dataset source: `field` is data.source, or data.validation_source (a separate held-out set)."""
    data = config.data
    source = getattr(data, field.removeprefix("data."))
    return report.run(name, stage, source=source, staging_dir=str(data.staging_dir), endpoint_url=data.s3_endpoint_url,
                      revision=data.revision, config=data.config,
                      fingerprint=source_fingerprint(source, data.s3_endpoint_url, data.revision, field=field))


@flow(name="phase1a")
def phase1a(config: Phase1aConfig | None = None, config_file: str | None = None, overrides: list[str] | None = None,
            plan_only: bool = False) -> str:
    """Returns the path of the run's report.json. A bad config fails the run before any stage.

    Args:
        config: The whole config. Give this or config_file.
        config_file: A YAML config file, e.g. configs/h100.yaml, relative to the project root; its own relative
            paths are relative to the file. Give this or config.
        overrides: `key.sub=value` strings applied on top, as the CLI's --set, e.g. method.epochs=2.
        plan_only: Stop after the plan: no training.
    """
    # Deployment parameters arrive with `~` and relative paths: they resolve against the working directory.
    config = config_from(config, config_file, overrides, base=Path.cwd())
    report = RunReport.create(config.work_dir, config.name, flow_run.get_name() or "local", config)
    status = "failed"
    try:
        endpoint = config.data.s3_endpoint_url
        model_dir = resolve_model(config.model, stage=lambda source: stage_model(
            source, config.data.staging_dir / "models", endpoint, copy_local=config.model.stage_local))
        staged = _stage(report, "stage", "data.source", config)
        held_out = (_stage(report, "stage_validation", "data.validation_source", config)
                    if config.data.validation_source else None)

        options = TokenizeOptions(**config.data.model_dump(include=set(TokenizeOptions.model_fields)),
                                  max_seq_length=config.model.max_seq_length)
        fingerprint = tokenize_fingerprint([item.fingerprint for item in (staged, held_out) if item],
                                           tokenizer_fingerprint(model_dir), model_max_positions(model_dir), options)
        data = report.run("tokenize", tokenize, data=staged, validation=held_out, model_dir=str(model_dir),
                          options=options, cache_dir=str(config.cache_dir), fingerprint=fingerprint,
                          trust_remote_code=config.model.trust_remote_code)
        publish_length_report(data, report.run_dir)

        model_fp = model_fingerprint(model_dir)
        history = config.cache_dir / "history.jsonl"
        plan = report.run("plan", plan_task, config=config, model_dir=str(model_dir), data=data,
                          fingerprint=plan_fingerprint(config, model_fp, data), model_fingerprint=model_fp,
                          history_path=str(history))
        publish_plan(plan, report.run_dir)
        print(format_plan(plan))
        if plan_only:
            status = "planned"
            return str(report.path)

        settings = train_settings(config, plan, data, model_dir, model_fp)
        trained = report.run("train", train_task, settings=settings)
        if not trained.reused_completed_run:
            report.set("estimate_vs_actual", record_run(history, plan, trained, model_fp, config).model_dump(mode="json"))

        verdict = report.run("validate", validate_task, model_dir=str(model_dir), adapter_dir=trained.adapter_dir,
                             validation_path=data.validation_path, settings=config.validation,
                             cache_dir=str(config.cache_dir), model_fingerprint=model_fp,
                             staging_dir=str(config.data.staging_dir), endpoint_url=endpoint,
                             trust_remote_code=config.model.trust_remote_code,
                             fingerprint=validate_fingerprint(model_fp, trained.adapter_dir, data.fingerprint,
                                                              config.validation, endpoint))
        report.compare("validation_estimate_vs_actual", "validate", plan.estimate.evaluation_seconds,
                       base_cached=verdict.base_cached)
        report.set("validation", validation_section(verdict))
        publish_validation(verdict, report.run_dir)
        print(format_table(verdict))
        if not verdict.passed:
            raise GateFailed(f"validation gate failed against {verdict.baseline.source}: " + "; ".join(verdict.reasons))
        if config.validation.promote_to:  # only a pass gets here: a failed gate never moves the pointer
            promotion = report.run("promote", promote_task, verdict=verdict, adapter_dir=trained.adapter_dir,
                                   model_dir=str(model_dir), settings=config.validation, version=report.run_dir.name,
                                   run=str(report.run_dir), work_dir=str(report.run_dir), endpoint_url=endpoint,
                                   trust_remote_code=config.model.trust_remote_code,
                                   chat_template=config.data.chat_template)
            report.set("validation", validation_section(verdict, promotion))
            print(f"promoted: {promotion.pointer.version} at {promotion.pointer.path}"
                  + ("" if promotion.promoted else " (already the promoted model)"))
        status = "passed"
    finally:
        path = report.write(status)
        print(f"report: {path}")
    return str(path)
