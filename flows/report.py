"""report.json: one section per stage with its Prefect state (Completed or Cached) and its manifest.

It runs the flow's tasks (with their cache refresh), so it lives with the flow, above the task layer."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tasks.caching import refreshed_if_output_missing


class RunReport:
    def __init__(self, run_dir: Path, config: BaseModel) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "report.json"
        self._started = time.perf_counter()
        self.data: dict[str, Any] = {
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "run_dir": str(self.run_dir),
            "config": config.model_dump(mode="json"),
            "stages": {},
        }

    @classmethod
    def create(cls, work_dir: Path, name: str, flow_run_name: str, config: BaseModel) -> "RunReport":
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        run_dir = Path(work_dir) / name / f"{stamp}-{flow_run_name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        return cls(run_dir, config)

    def run(self, stage: str, task: Any, **kwargs: Any) -> Any:
        """Run a Prefect task, record its final state and manifest, and return its result; a task's error
        is recorded, then re-raised."""
        started = time.perf_counter()
        state = refreshed_if_output_missing(task, kwargs)(**kwargs, return_state=True)
        section: dict[str, Any] = {"state": state.name, "seconds": round(time.perf_counter() - started, 3)}
        self.data["stages"][stage] = section
        try:
            result = state.result()
        except BaseException as error:
            section["error"] = f"{type(error).__name__}: {error}"
            raise
        section["result"] = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
        return result

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def compare(self, key: str, stage: str, estimated_seconds: float, **detail: Any) -> None:
        """Record the plan's estimate of a stage against its measured seconds, when the stage ran (not cached)."""
        section = self.data["stages"][stage]
        if section["state"] != "Completed":
            return
        actual = section["seconds"]
        self.data[key] = {"estimated_seconds": round(estimated_seconds, 3), "actual_seconds": actual,
                          "estimated_over_actual": round(estimated_seconds / actual, 3) if actual else None, **detail}

    def write(self, status: str) -> Path:
        self.data["status"] = status
        self.data["wall_seconds"] = round(time.perf_counter() - self._started, 3)
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        partial.replace(self.path)
        return self.path
