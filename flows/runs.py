"""`phase1a runs` and `phase1a show`: a job's runs read back from their report.json files, for people who live
in a terminal. A run directory is `work_dir/name/<UTC time>-<flow run name>/`, so names sort by time. With a
store, every run's directory is also kept there (`jobs/<name>/runs/<run>/`, a bundle), and `runs` lists those
of other hosts too."""
from __future__ import annotations

from pathlib import Path

from phase1a.core import layout
from phase1a.core.errors import DataError
from phase1a.run_report import RunReport
from phase1a.store.base import Store
from phase1a.store.bundles import upload_bundle

_COLUMNS = ("run", "status", "wall s", "train s", "estimate", "loss", "token acc", "exact", "promoted")


def run_reports(runs_dir: Path) -> tuple[list[tuple[Path, RunReport]], int]:
    """Every run's report under `runs_dir`, oldest first, and how many could not be read (a run killed while
    its report was written leaves none; a damaged one is counted, not fatal)."""
    reports, unreadable = [], 0
    for path in sorted(Path(runs_dir).glob(f"*/{layout.REPORT_JSON}")):
        try:
            reports.append((path, RunReport.load(path)))
        except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
            unreadable += 1
    return reports, unreadable


def _store_prefix(job: str) -> str:
    return f"jobs/{job}/runs/"


def share_run(store: Store, job: str, run_dir: Path) -> None:
    """The run's directory (report.json, report.md, plots, plan.json) into the store, where it outlives the host."""
    upload_bundle(store, run_dir, f"{_store_prefix(job)}{Path(run_dir).name}/")


def stored_reports(store: Store, job: str, known: set[str]) -> list[tuple[Path, RunReport]]:
    """The reports of the job's runs in the store whose run directories are not in `known` (other hosts' runs),
    each with where it lies in the store."""
    found = []
    for item in store.list(_store_prefix(job)):
        run, _, name = item.key.removeprefix(_store_prefix(job)).partition("/")
        fetched = store.get(item.key) if name == layout.REPORT_JSON and run not in known else None
        if fetched is not None:
            try:
                found.append((Path(store.where(item.key)), RunReport.model_validate_json(fetched.data)))
            except ValueError:
                continue
    return found


def _row(path: Path, report: RunReport) -> tuple[str, ...]:
    train, validation = report.estimate_vs_actual, report.validation
    promotion = validation.promotion if validation else None
    accuracy = train.time_accuracy if train else None

    def candidate(metric: str, digits: int) -> str:
        row = validation.metrics.get(metric) if validation else None
        return "-" if row is None or row.candidate is None else f"{row.candidate:.{digits}f}"

    return (path.parent.name, report.status or "?", f"{report.wall_seconds or 0:.0f}",
            f"{train.actual_train_seconds:.0f}" if train else "-",
            f"{accuracy - 1:+.0%}" if accuracy else "-",
            candidate("loss", 4), candidate("token_accuracy", 3), candidate("exact_match", 3),
            promotion.version if promotion and promotion.promoted else "-")


def format_runs(reports: list[tuple[Path, RunReport]], unreadable: int = 0) -> str:
    """A table of runs: status, wall and training seconds, the plan's training estimate against the actual
    (+: it said longer), the candidate's held-out metrics, the version it was promoted as."""
    rows = [_COLUMNS] + [_row(path, report) for path, report in reports]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if unreadable:
        lines.append(f"({unreadable} run directories with an unreadable report.json left out)")
    return "\n".join(lines)


def find_report(run: str, runs_dir: Path | None) -> Path:
    """A run's report.json from its directory, its report's path, or (under `runs_dir`) its directory's name or
    the flow run name it ends with."""
    given = Path(run)
    for candidate in (given, given / layout.REPORT_JSON):
        if candidate.is_file():
            return candidate
    if runs_dir is None:
        raise DataError(f"{run}: no such run directory or report.json (give --config to look a run up by name)")
    matches = [path for path in sorted(Path(runs_dir).glob(f"*/{layout.REPORT_JSON}"))
               if path.parent.name == run or path.parent.name.endswith(f"-{run}")]
    if len(matches) != 1:
        found = "no run" if not matches else f"{len(matches)} runs ({', '.join(p.parent.name for p in matches)})"
        raise DataError(f"{run}: {found} of that name under {runs_dir}")
    return matches[0]
