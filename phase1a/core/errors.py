"""Errors the library raises about the user's input; tasks and flows import them from here."""
from __future__ import annotations


class DataError(ValueError):
    """Bad or missing input data; the message names the file (and line or row, and field, where there is one)."""
