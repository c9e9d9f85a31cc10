"""Credentials never leave the process: a URL's user-info (`scheme://user:password@host`) is cut out of anything
written to a report, a log or a tracker. Keys and tokens come only from the environment and are never copied."""
from __future__ import annotations

import re
from typing import Any

# Whatever sits between `://` and `@` is a credential.
_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact(text: str) -> str:
    """The text with the user-info of every URL in it replaced by `***`."""
    return _USERINFO.sub("***@", text)


def redacted(tree: Any) -> Any:
    """A JSON tree (dicts, lists, scalars) with `redact` applied to every string in it."""
    if isinstance(tree, dict):
        return {key: redacted(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [redacted(value) for value in tree]
    return redact(tree) if isinstance(tree, str) else tree
