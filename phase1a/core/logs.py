"""Where the library's log lines go: the Prefect run's logger inside a run, else the `phase1a` logger."""
from __future__ import annotations

import logging


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run (its lines reach the flow run's logs in the UI), else a plain one."""
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:  # no Prefect on a bare GPU host, or no active run
        return logging.getLogger("phase1a")
