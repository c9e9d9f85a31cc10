"""Retries of what crosses the network (S3 staging, Hub and S3 model downloads, promotion): which errors may pass
if tried again, and the delays between attempts.

Three layers, innermost first:

- botocore retries each S3 request on its own (standard mode: 3 attempts, about 1 to 2 s apart) when it gets
  a 5xx, a throttling answer (503 SlowDown) or a connection error before the response's body;
  `AWS_MAX_ATTEMPTS` and `AWS_RETRY_MODE` tune it. It cannot retry a body cut off mid-transfer.
- A stage that crosses the network (model, start, stage, promote) is retried by Prefect, `retries.count` times
  after `retries.delay`, `delay * backoff`, ... (tasks/caching.py: `with_retries`), when it failed with an error
  `is_transient` accepts. An S3 download cut off mid-object resumes where it stopped (phase1a/store/s3.py).
- Anything else fails at once with its own message: a missing bucket or key, denied access, bad data, a 404,
  a bug. Retrying those only delays the error.

Nothing here imports boto3, Prefect or huggingface_hub.
"""
from __future__ import annotations

import sys
from typing import Protocol


class RetryFields(Protocol):
    """What retries read of the config's `retry` section (phase1a/config/schema.py)."""

    count: int
    delay: str
    backoff: float
    jitter: float


# Errors that may pass if tried again, by module, named so that nothing is imported to test for them: an error
# of a module that was never imported cannot have been raised.
_TRANSIENT = {
    "botocore.exceptions": ("ConnectionError", "HTTPClientError", "IncompleteReadError"),
    "urllib3.exceptions": ("ProtocolError", "TimeoutError"),
    "s3transfer.exceptions": ("RetriesExceededError",),
    "httpx": ("TransportError",),
    "httpx2": ("TransportError",),
    "requests.exceptions": ("ConnectionError", "Timeout", "ChunkedEncodingError"),
}
# Checked first: subclasses of the above (or of ConnectionError) that no retry can fix.
_PERMANENT = {
    "botocore.exceptions": ("SSLError",),  # a certificate the endpoint's name does not match
    "huggingface_hub.errors": ("OfflineModeIsEnabled",),  # HF_HUB_OFFLINE=1: the network is off on purpose
}
# S3 error codes that say "not now" rather than "no"; any 5xx is transient too.
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeoutException",
                    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"}


def is_transient(error: BaseException) -> bool:
    """Whether `error` may pass if the work is tried again: a dropped or refused connection, a timeout, a 5xx
    or throttling answer, a body cut short.

    The whole chain is read, `__cause__` and `__context__`, even where `raise ... from None` hides it from the
    traceback: the library rewords errors into its own (S3Error into DataError, huggingface_hub's into
    HubError), and the reworded error still holds what happened underneath. The first error in the chain with
    a verdict decides; none is permanent."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        verdict = _verdict(current)
        if verdict is not None:
            return verdict
        current = current.__cause__ or current.__context__
    return False


def _verdict(error: BaseException) -> bool | None:
    if _is_any(error, _PERMANENT):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)) or _is_any(error, _TRANSIENT):
        return True
    status, code = _http_status(error)
    if status is None and code is None:
        return None
    return code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status in (408, 429)))


def _is_any(error: BaseException, table: dict[str, tuple[str, ...]]) -> bool:
    for module_name, names in table.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(error, tuple(getattr(module, name) for name in names)):
            return True
    return False


def _http_status(error: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code of an answer the server gave: botocore's ClientError, huggingface_hub's
    HfHubHTTPError (a response with a status_code)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore
        code = response.get("Error", {}).get("Code")
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode"), str(code) if code else None
    status = getattr(response, "status_code", None)
    return (status, None) if isinstance(status, int) else (None, None)


def retry_delays(settings: RetryFields) -> list[float]:
    """Seconds before each retry: `delay`, then `backoff` times the one before."""
    from phase1a.core.units import parse_duration_seconds

    first = parse_duration_seconds(settings.delay)
    return [first * settings.backoff ** index for index in range(settings.count)]
