"""Prefect glue shared by the stage tasks: content-keyed caching, and a no-op `task` where Prefect is absent.

The train and benchmark code must import on GPU hosts that have torch but no Prefect, so the task modules
take `task` from here instead of from prefect directly.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from phase1a.fingerprint import hash_json, sha256_file

try:
    from prefect import task
    from prefect.cache_policies import CachePolicy

    HAVE_PREFECT = True
except ImportError:  # a bare GPU host: the plain functions still run, the wrappers are plain calls
    HAVE_PREFECT = False

    def task(*args: Any, **kwargs: Any):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda fn: fn

    @dataclass
    class CachePolicy:  # type: ignore[no-redef]
        pass


@dataclass
class FingerprintCache(CachePolicy):
    """Key a task on its `fingerprint` input (content hashes) and its module's source, never on paths.

    `output_present(inputs)` says whether the files a cached manifest points at still exist; when they
    do not, `refreshed_if_output_missing` makes the call re-run and overwrite the record under the same key.
    """

    output_present: Callable[[dict[str, Any]], bool] = field(default=lambda inputs: True)

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any):
        module_source = sha256_file(Path(inspect.getsourcefile(task_ctx.task.fn)))
        return hash_json([task_ctx.task.name, inputs["fingerprint"], module_source])


def refreshed_if_output_missing(task: Any, inputs: dict[str, Any]) -> Any:
    """The task itself, or a copy that refreshes its cache when a cached result would point at deleted files."""
    policy = getattr(task, "cache_policy", None)
    if isinstance(policy, FingerprintCache) and not policy.output_present(inputs):
        return task.with_options(refresh_cache=True)
    return task
