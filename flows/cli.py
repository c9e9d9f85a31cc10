"""`phase1a run|plan --config FILE [--set key=value ...]`: the flow, in-process on Prefect's embedded default;
`phase1a runs --config FILE` and `phase1a show RUN`: earlier runs, read back from their reports."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from flows.processes import Terminated, own_processes
from phase1a.config.schema import ConfigError, config_from
from phase1a.core import layout
from phase1a.core.errors import DataError, UserError
from phase1a.evaluate.result import ValidationResult
from phase1a.plan.result import Plan
from phase1a.run_report import RunReport, promoted_line
from phase1a.train.preemption import Preempted
from phase1a.train.result import TrainResult


def _summary(report_path: Path) -> str:
    report = RunReport.load(report_path)
    lines = ["", "stage      state       seconds"]
    for name, section in report.stages.items():
        lines.append(f"{name:<10} {section.state:<11} {section.seconds:>8.1f}")
    train, plan = report.result("train", TrainResult), report.result("plan", Plan)
    if plan and train and not train.reused_completed_run:
        lines.append(f"train: {train.train_tokens} tokens in {train.wall_seconds:.1f} s "
                     f"({train.tokens_per_second:.0f} tokens/s); plan estimated {plan.estimated_train_seconds:.1f} s")
    validation = report.validation_estimate_vs_actual
    if validation:
        lines.append(f"validate: {validation.actual_seconds:.1f} s; plan estimated "
                     f"{validation.estimated_seconds:.1f} s")
    verdict = report.result("validate", ValidationResult)
    if verdict:
        from phase1a.evaluate.present import format_table

        lines += ["", "validation (held-out):", format_table(verdict)]
        promotion = report.validation.promotion if report.validation else None
        if promotion:
            lines.append(promoted_line(promotion.version, promotion.path, promotion.promoted))
    if plan and not verdict:
        from phase1a.plan.present import format_plan

        lines += ["", "plan:", format_plan(plan)]
    lines += ["", f"status: {report.status}, wall {report.wall_seconds or 0:.1f} s", f"report: {report_path}"]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phase1a", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run the whole flow: stage, tokenize, plan, train, validate"),
                            ("plan", "stage, tokenize and plan only: print the plan and its estimate, no training"),
                            ("runs", "list the job's runs: status, seconds, estimate error, metrics, promotion"),
                            ("show", "print one run's report.md (or, without one, a summary of its report.json)")):
        command = commands.add_parser(name, help=help_text)
        if name == "show":
            command.add_argument("run", help="a run directory, its report.json, or (with --config) its name or "
                                             "flow run name")
        # A string, not a Path: a URL (s3://bucket/key.yaml, hf://...) would lose a slash of its `//` in a Path.
        command.add_argument("--config", required=name != "show", help="YAML config file: a path, "
                             "s3://bucket/key.yaml or hf://[datasets/]org/name/path.yaml")
        command.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                             help="override a config field, e.g. --set method.epochs=2 (repeatable)")
        if name == "runs":
            command.add_argument("--last", type=int, default=20, help="the most recent N runs (default 20)")
        if name in ("run", "plan"):
            command.add_argument("--verbose", action="store_true",
                                 help="print an input error's traceback too (it always goes to the run's error.log)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = config_from(config_file=args.config, overrides=args.overrides) if args.config else None
    except ConfigError as error:
        print(f"phase1a: {error}", file=sys.stderr)
        return 2
    if args.command in ("runs", "show"):
        return _read_back(args, config)

    # The embedded server migrates a fresh database on its first start, which on 2 cores can outlast
    # Prefect's 20 s default; and there is no network to send telemetry to.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    own_processes()  # the embedded server and every other process the run starts end with it
    return _run(config, plan_only=args.command == "plan", verbose=args.verbose)


def _run(config, plan_only: bool, verbose: bool = False) -> int:
    """The flow, in this process; its report's summary whatever the end. Exit status: 0 when the flow run
    completed, 128 + the signal's number when SIGTERM (143) or SIGINT (130) stopped it, in training (at a
    checkpoint) or not, else 1."""
    started = time.time()
    try:
        from flows.phase1a import phase1a  # after the settings above: Prefect reads them when it is first imported

        if not verbose:
            _user_errors_in_one_line()
        state = phase1a(config, plan_only=plan_only, return_state=True)
    except BaseException as error:
        signum = _stop_signal(error)  # a signal outside training, after report.json was written
        if signum is None:
            raise
        _print_summary(_latest_report(config, since=started))
        print(f"phase1a: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    report_path = Path(state.result(raise_on_failure=False)) if state.is_completed() else None
    report_path = report_path or _latest_report(config, since=started)
    _print_summary(report_path)
    if state.is_completed():
        return 0
    error = state.result(raise_on_failure=False)
    if isinstance(error, UserError):  # the user's input to mend: the message last, the traceback in a file
        sys.stdout.flush()
        if report_path is not None:
            log = report_path.parent / layout.ERROR_LOG
            log.write_text("".join(traceback.format_exception(error)))
            print(f"phase1a: the traceback is in {log} (--verbose prints it)", file=sys.stderr)
        print(f"phase1a: {error}", file=sys.stderr)
        return 1
    print(f"phase1a: flow run {state.name}: {state.message}", file=sys.stderr)
    stopped_by = error.signal_name if isinstance(error, Preempted) else None  # training stopped at a checkpoint
    return (128 + signal.Signals[stopped_by]) if stopped_by in signal.Signals.__members__ else 1


class _WithoutUserTraceback(logging.Filter):
    """A user error's log lines without their traceback, on the terminal only (Prefect's API handler, on the
    flow- and task-run loggers, has already taken the record whole when it reaches the root's console)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


def _user_errors_in_one_line() -> None:
    """Prefect logs a failed task's and flow's exception with its traceback, twice: for a user error (a bad
    record, a missing file, a setting) that is 150 lines before the one that matters."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not any(
                isinstance(f, _WithoutUserTraceback) for f in handler.filters):
            handler.addFilter(_WithoutUserTraceback())


def _stop_signal(error: BaseException) -> int | None:
    """The signal behind an exception: SIGINT's KeyboardInterrupt, SIGTERM's Terminated (flows/processes.py) or
    Prefect's TerminationSignal, which its flow engine raises for SIGTERM while a flow runs."""
    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    prefect_exceptions = sys.modules.get("prefect.exceptions")  # imported, where Prefect raised one
    if prefect_exceptions is not None and isinstance(error, prefect_exceptions.TerminationSignal):
        return error.signal
    return error.signal if isinstance(error, Terminated) else None


def _print_summary(report_path: Path | None) -> None:
    if report_path and report_path.is_file():
        print(_summary(report_path))


def _read_back(args: argparse.Namespace, config) -> int:
    """`runs` and `show`: nothing runs, reports are read."""
    from flows.runs import find_report, format_runs, run_reports, stored_reports
    from phase1a.config.stores import open_store

    runs_dir = Path(config.work_dir) / config.name if config else None
    if args.command == "runs":
        reports, unreadable = run_reports(runs_dir)
        store = open_store(config.store)
        if store is not None:  # other hosts' runs: the store keeps every run's report
            try:
                reports += stored_reports(store, config.name, {path.parent.name for path, _ in reports})
            except Exception as error:  # noqa: BLE001 - the local runs are still worth listing
                print(f"phase1a: runs in the store {store.url} left out: {error}", file=sys.stderr)
            reports.sort(key=lambda pair: pair[0].parent.name)
        print(format_runs(reports[-args.last:], unreadable) if reports else f"no runs under {runs_dir}")
        return 0
    try:
        report_path = find_report(args.run, runs_dir)
    except DataError as error:
        print(f"phase1a: {error}", file=sys.stderr)
        return 2
    readable = report_path.parent / layout.REPORT_MD  # the whole report, written at the end of the run
    print(f"{readable.read_text()}\nreport: {readable}" if readable.is_file() else _summary(report_path))
    return 0


def _latest_report(config, since: float = 0.0) -> Path | None:
    """The newest report.json of the job written after `since` (this run's, not an earlier run's)."""
    reports = sorted(path for path in (config.work_dir / config.name).glob(f"*/{layout.REPORT_JSON}")
                     if path.stat().st_mtime >= since)
    return reports[-1] if reports else None


if __name__ == "__main__":
    sys.exit(main())
