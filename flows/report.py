"""report.json (phase1a/run_report.py: RunReport): one section per stage with its Prefect state (Completed or
Cached), its seconds, how many times Prefect retried it (`retries`) and its result, written whatever the run's
outcome; then report.md, the plots and the `run-report` artifact drawn from it (flows/report_md.py)."""
from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from prefect.exceptions import TerminationSignal
from pydantic import BaseModel

from flows.report_md import draw_plots, finish_report
from flows.runs import share_run
from phase1a.config.schema import Phase1aConfig
from phase1a.config.stores import open_store
from phase1a.core.layout import REPORT_JSON
from phase1a.core.logs import run_logger
from phase1a.core.redaction import redact, redacted
from phase1a.run_report import FlowRunLink, RunOutcome, RunReport, StageEstimate, StageRecord
from phase1a.train.preemption import Preempted


@dataclass
class Outcome:
    status: RunOutcome = "failed"  # until the flow says otherwise


class ReportWriter:
    """The run's RunReport as the flow fills it (`data`), written to report.json however the run ends."""

    def __init__(self, run_dir: Path, config: BaseModel) -> None:
        self.run_dir = Path(run_dir)
        store_settings = getattr(config, "store", None)
        self.store = open_store(store_settings) if store_settings is not None else None
        self.job = getattr(config, "name", "")
        self.path = self.run_dir / REPORT_JSON
        self._started = time.perf_counter()
        self._closing: list[Callable[[RunOutcome], None]] = []
        self.data = RunReport(started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              run_dir=str(self.run_dir),
                              config=redacted(config.model_dump(mode="json")))  # a URL's user:password stays out

    @classmethod
    def create(cls, config: Phase1aConfig, flow_run_name: str) -> "ReportWriter":
        """A new run directory under work_dir/name, named by the time and the flow run."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        run_dir = Path(config.work_dir) / config.name / f"{stamp}-{flow_run_name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        report = cls(run_dir, config)
        report.data.flow_run = _flow_run()
        return report

    def run(self, stage: str, task: Any, present: Callable[[Any, Path], None] | None = None, **inputs: Any) -> Any:
        """Run a Prefect task, record its final state, seconds, retries and result, and return the result; a
        task's error is recorded, then re-raised. `present(result, run_dir)`: what the stage shows of its result
        (artifacts, a summary printed), every run, whether the result was computed or cached."""
        started = time.perf_counter()
        runs: list[int] = []

        def count_runs(_task: Any, task_run: Any, _state: Any) -> None:  # Prefect calls it on the final state
            runs.append(task_run.run_count)

        counted = task.with_options(on_completion=[*task.on_completion_hooks, count_runs],
                                    on_failure=[*task.on_failure_hooks, count_runs])
        try:
            state = counted(**inputs, return_state=True)
        except BaseException as error:  # no state comes back: a signal crashed the task run
            self.data.stages[stage] = StageRecord(state="Crashed", seconds=round(time.perf_counter() - started, 3),
                                                  error=_described(error, stage))
            raise
        section = StageRecord(state=state.name, seconds=round(time.perf_counter() - started, 3),
                              retries=max(runs[-1] - 1, 0) if runs else 0)
        self.data.stages[stage] = section
        try:
            result = state.result()
        except BaseException as error:
            section.error = redact(f"{type(error).__name__}: {error}")
            raise
        section.result = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
        if present is not None:
            present(result, self.run_dir)
        return result

    def estimate_of(self, stage: str, estimated_seconds: float, **detail: Any) -> StageEstimate | None:
        """The plan's estimate of a stage against its measured seconds, when the stage ran (not cached)."""
        section = self.data.stages[stage]
        if section.state != "Completed":
            return None
        actual = section.seconds
        return StageEstimate(estimated_seconds=round(estimated_seconds, 3), actual_seconds=actual,
                             estimated_over_actual=round(estimated_seconds / actual, 3) if actual else None, **detail)

    @contextmanager
    def finishing(self) -> Iterator[Outcome]:
        """The body sets the outcome's status; report.json is written when it ends, however it ends (an error is
        recorded as `error`), and report.md after it."""
        outcome = Outcome()
        try:
            yield outcome
        except BaseException as error:
            stopped_in = [name for name, section in self.data.stages.items() if section.error]
            self.data.error = _described(error, stopped_in[-1] if stopped_in else None)
            # Stopped at a checkpoint for the next run to resume, or by a signal outside training (the next run
            # reuses the stages that finished): not a failure.
            if isinstance(error, Preempted) or _stop_signal(error):
                outcome.status = "preempted"
            raise
        finally:
            self.write(outcome.status)  # first: a process killed during what follows still leaves its report
            plots = self._closing_step("plots", lambda: draw_plots(self.data, self.run_dir)) or []
            for hook in self._closing:  # after the plots: the trackers log them
                self._closing_step("a closing hook", lambda: hook(outcome.status))
            print(f"report: {self.write(outcome.status)}")
            readable = finish_report(self.data, self.run_dir, plots)
            if readable:
                print(f"run report: {readable}")
            if self.store is not None:  # last: the report as it stays; a host's disk goes with the host
                self._closing_step("the copy in the store", lambda: share_run(self.store, self.job, self.run_dir))

    def _closing_step(self, what: str, step: Callable[[], Any]) -> Any:
        """Plots and trackers come after the run's outcome: a failure there is a warning, and report.json is
        still written (with the run's own error, not this one)."""
        try:
            return step()
        except Exception as error:  # noqa: BLE001 - the report must still be written
            run_logger().warning(f"report: {what} failed: {redact(f'{type(error).__name__}: {error}')}")
            return None

    def on_closing(self, hook: Callable[[RunOutcome], None]) -> None:
        """`hook(status)` runs as the run ends, after the plots are drawn and before report.json is written: what
        it sets in the report is written with it. It must not raise (the trackers turn failures into warnings)."""
        self._closing.append(hook)

    def write(self, status: RunOutcome) -> Path:
        self.data.status = status
        self.data.finished_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.data.wall_seconds = round(time.perf_counter() - self._started, 3)
        return self.data.save(self.path)


def _stop_signal(error: BaseException) -> str | None:
    """The signal behind an exception outside training: SIGINT's KeyboardInterrupt, or SIGTERM's TerminationSignal
    (Prefect's flow engine raises it while a flow runs; a deployment's cancellation too)."""
    if isinstance(error, KeyboardInterrupt):
        return "SIGINT"
    return signal.Signals(error.signal).name if isinstance(error, TerminationSignal) else None


def _described(error: BaseException, stage: str | None = None) -> str:
    stop_signal = _stop_signal(error)
    if stop_signal:  # these exceptions carry no message
        where = f"in stage {stage}" if stage else "between stages"
        return f"{type(error).__name__}: stopped by {stop_signal} {where}; the next run of this job reuses the " \
               "stages that finished"
    return redact(f"{type(error).__name__}: {error}")


def _flow_run() -> FlowRunLink:
    """The Prefect flow run this report belongs to; its UI address only where PREFECT_UI_URL names a UI (the
    embedded server's goes away with the process)."""
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    run_id = flow_run.get_id()
    return FlowRunLink(id=run_id, name=flow_run.get_name(), url=url_for("flow-run", obj_id=run_id) if run_id else None)
