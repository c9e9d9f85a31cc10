"""Prefect glue shared by the stage tasks: content-keyed caching, retries of the stages that cross the network,
and a no-op `task` where Prefect is absent.

The train and benchmark code must import on GPU hosts that have torch but no Prefect, so the task modules
take `task` from here instead of from prefect directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from phase1a.config import ConfigError, RetryConfig
from phase1a.errors import DataError
from phase1a.fingerprint import code_fingerprint, hash_json
from phase1a.retries import is_transient, retry_delays

try:
    from prefect import task
    from prefect.cache_policies import CachePolicy
except ImportError:  # a bare GPU host: the plain functions still run, the wrappers are plain calls

    def task(*args: Any, **kwargs: Any):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda fn: fn

    @dataclass
    class CachePolicy:  # type: ignore[no-redef]
        pass


@dataclass(kw_only=True)  # Prefect's own fields (key_storage, ...) come first: ours are named, never positional
class StageCache(CachePolicy):
    """A stage's cache key, derived by the stage from its own inputs: `fingerprint(**inputs)` (the content of
    what it reads and the settings it uses, never where the inputs live), where its output lives
    (`output(fingerprint, **inputs)`, a path named by that fingerprint), the task's name, and
    `code_fingerprint` of the task's module (the source of every project module it imports, from the import
    graph), so an edit anywhere in the code a stage runs re-runs it.

    When the output is gone but a record of it is stored (a cleaned cache directory), the stage runs without
    the record and writes the same output back to the same place, where the record points again. A
    fingerprint that fails on bad input gives no key: the stage runs and reports the problem in its own words."""

    fingerprint: Callable[..., str]
    output: Callable[..., Path] | None = None  # None: the result itself is the whole output

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        try:
            fingerprint = self.fingerprint(**inputs)
            output = self.output(fingerprint, **inputs) if self.output else None
        except (DataError, ConfigError, OSError):
            return None
        key = hash_json([task_ctx.task.name, fingerprint, str(output), code_fingerprint(task_ctx.task.fn.__module__)])
        if output is not None and not output.exists() and task_ctx.result_store.exists(key):
            return None
        return key


def with_retries(stage: Any, settings: RetryConfig) -> Any:
    """The stage as the flow runs it when it crosses the network: retried by Prefect after `settings`' delays
    when it failed with a transient error (phase1a/retries.py), failed at once with its own error otherwise."""
    return stage.with_options(retries=settings.count, retry_delay_seconds=retry_delays(settings),
                              retry_jitter_factor=settings.jitter or None, retry_condition_fn=_failed_transiently)


def _failed_transiently(stage: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except BaseException as error:  # the task's own error, as it raised it
        return is_transient(error)
    return False
