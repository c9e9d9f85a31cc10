"""Prefect glue shared by the stage tasks: content-keyed caching, retries of the stages that cross the network,
and a no-op `task` where Prefect is absent.

The train and benchmark code must import on GPU hosts that have torch but no Prefect, so the task modules
take `task` from here instead of from prefect directly.

A task that loads a model (plan, train, validate) imports that work inside its function: the flow, the CLI and
`prefect deploy` import without torch (tests/project/test_architecture.py), so `phase1a runs`, a deployment's
registration and a run that ends on its config start in seconds. (Loading a tokenizer imports torch through
transformers: a run that reaches tokenize pays for it there.) The cache key still covers that code:
`code_fingerprint` follows imports inside functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from phase1a.config.schema import ConfigError, RetryConfig, StoreConfig
from phase1a.core.errors import DataError
from phase1a.core.fingerprint import code_fingerprint, hash_json
from phase1a.core.retries import is_transient, retry_delays

try:
    from prefect import task
    from prefect.cache_policies import CachePolicy
    from prefect.filesystems import WritableFileSystem
except ImportError:  # a bare GPU host: the plain functions still run, the wrappers are plain calls
    WritableFileSystem = None  # type: ignore[assignment,misc]

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
    `code_fingerprint` of the task's module: the code of every project module it imports, from the import graph,
    without its prose (docstrings, comments, pydantic Field descriptions), and the FORMAT_VERSIONS of those among
    them that a stage's output is keyed on (phase1a/core/fingerprint.py). An edit to any code a stage runs re-runs
    it; rewording its documentation does not.

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
    when it failed with a transient error (phase1a/core/retries.py), failed at once with its own error otherwise."""
    return stage.with_options(retries=settings.count, retry_delay_seconds=retry_delays(settings),
                              retry_jitter_factor=settings.jitter or None, retry_condition_fn=_failed_transiently)


def _failed_transiently(stage: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except BaseException as error:  # the task's own error, as it raised it
        return is_transient(error)
    return False


# ---- task records in the store ------------------------------------------------------------------------------

if WritableFileSystem is not None:
    class StoreRecords(WritableFileSystem):
        """Prefect's task records (results and cache keys) in the store (phase1a/store/base.py) under `prefect/`, so
        that a cached stage is found from every host: a plan calibrated on one host is taken on the next. A
        record that points at a local file (staged data, tokenized Arrow) still counts only where the file is
        (`StageCache` checks its output)."""

        _block_type_name = "phase1a store records"
        url: str
        endpoint_url: str | None = None

        def _store(self):
            from phase1a.config.stores import open_store

            return open_store(StoreConfig(url=self.url, endpoint_url=self.endpoint_url))

        def read_path(self, path: str, _sync: bool = True) -> bytes:
            fetched = self._store().get(f"prefect/{path}")
            if fetched is None:  # as LocalFileSystem says it: a record that is not there
                raise ValueError(f"Path {path} does not exist.")
            return fetched.data

        def write_path(self, path: str, content: bytes, _sync: bool = True) -> str:
            self._store().put(f"prefect/{path}", content)
            return path

        async def aread_path(self, path: str) -> bytes:
            return self.read_path(path)

        async def awrite_path(self, path: str, content: bytes) -> str:
            return self.write_path(path, content)


def kept_in(stage: Any, records: Any | None) -> Any:
    """The stage with its records in `records` (store_records), or as it is."""
    return stage if records is None else stage.with_options(result_storage=records)


def store_records(settings: StoreConfig) -> Any | None:
    """Where the cached stages keep their records: the store, when there is one (saved as a block on the Prefect
    server the run talks to, which Prefect requires of result storage: its settings hold no credential); None
    leaves them in Prefect's default place (PREFECT_HOME/storage)."""
    if settings.url is None or WritableFileSystem is None:
        return None
    block = StoreRecords(url=settings.url, endpoint_url=settings.endpoint_url)
    block.save("phase1a-" + hash_json([settings.url, settings.endpoint_url])[:12], overwrite=True)
    return block
