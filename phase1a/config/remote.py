"""Config files that are not on this host: `s3://bucket/key.yaml` in an S3 bucket (the store's, say) and
`hf://[datasets/]org/name[@revision]/path.yaml` in a Hugging Face repository, so that a pod, a spot VM or a
Modal container gets its job without a checkout.

Only the text is fetched: the caller parses and validates it as it does a local file. A remote file has no
directory on this host, so the relative paths inside it resolve against the caller's `base` (the flow run's
working directory), as those of a whole config given as a parameter do.
"""
from __future__ import annotations

import os

from phase1a.core.errors import UserError
from phase1a.core.units import MIB

CONFIG_URL_SCHEMES = ("s3://", "hf://")
# A config is a page of YAML; anything larger is the wrong object (a data shard, a checkpoint), not a job.
MAX_CONFIG_BYTES = MIB


class ConfigUrlError(UserError, ValueError):
    """A config URL that cannot be read; the message names the URL and what went wrong."""


def is_config_url(value: str) -> bool:
    """A `scheme://` location rather than a path on this host."""
    return "://" in value


def read_config_url(url: str) -> str:
    """The text of the config file at `url`."""
    scheme = url.split("://", 1)[0].lower() + "://"
    if scheme == "s3://":
        return _from_s3(url)
    if scheme == "hf://":
        return _from_hub(url)
    raise ConfigUrlError(f"config_file {url}: {scheme} is not a config location; give a path on this host, "
                         f"{' or '.join(scheme + '...' for scheme in CONFIG_URL_SCHEMES)}")


def _too_large(url: str, size: int) -> ConfigUrlError:
    return ConfigUrlError(f"config_file {url}: {size} bytes is not a config file (at most {MAX_CONFIG_BYTES}); "
                          f"does the URL name the job's YAML?")


def _from_s3(url: str) -> str:
    """One GET. The config is not read yet, so its endpoint comes from the environment: AWS_ENDPOINT_URL_S3 or
    AWS_ENDPOINT_URL (MinIO, a store off AWS), credentials from the AWS chain as for every S3 access."""
    from phase1a.store.s3 import S3Error, make_client, parse_s3_url, s3_errors  # boto3: only for an s3:// config

    try:
        location = parse_s3_url(url)
        if location.is_prefix:
            raise ConfigUrlError(f"config_file {url}: a prefix, not a file; name the job's YAML "
                                 f"(s3://bucket/path/job.yaml)")
        client = make_client(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
        with s3_errors(client, url, location.bucket, "GET"):
            response = client.get_object(Bucket=location.bucket, Key=location.key)
            if response["ContentLength"] > MAX_CONFIG_BYTES:
                response["Body"].close()
                raise _too_large(url, response["ContentLength"])
            data = response["Body"].read()
    except S3Error as error:  # its message starts with the URL
        raise ConfigUrlError(f"config_file {error}") from None
    return _text(url, data)


def _from_hub(url: str) -> str:
    """hf_hub_download into the HF cache (HF_TOKEN for a private or gated repository; HF_HUB_OFFLINE=1 reads the
    cache alone). `hf://org/name/...` is a model repository, `hf://datasets/org/name/...` a dataset's."""
    from huggingface_hub import parse_hf_uri
    from huggingface_hub.errors import HfUriError

    from phase1a.data.hub import HubError, download_file

    try:
        location = parse_hf_uri(url)
    except HfUriError as error:
        raise ConfigUrlError(f"config_file {url}: not a Hub file URL ({error}); expected "
                             f"hf://org/name/path.yaml or hf://datasets/org/name[@revision]/path.yaml") from None
    if location.is_bucket or not location.path_in_repo:
        raise ConfigUrlError(f"config_file {url}: name a file in a model or dataset repository "
                             f"(hf://org/name/path.yaml or hf://datasets/org/name/path.yaml)")
    try:
        path = download_file(location.id, location.path_in_repo, repo_type=location.type,
                             revision=location.revision, field="config_file")
    except HubError as error:  # worded `<field>: what`, the field config_file or revision: the URL says both
        raise ConfigUrlError(f"config_file {url}: {str(error).split(': ', 1)[-1]}") from None
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise _too_large(url, size)
    return _text(url, path.read_bytes())


def _text(url: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigUrlError(f"config_file {url}: not UTF-8 text (byte {error.start}); is it the job's YAML?") from None
