"""Errors the library raises about the user's input; tasks and flows import them from here."""
from __future__ import annotations


class UserError(Exception):
    """An error in what the user gave (a file, a record, a setting, a model or dataset id): its message names where
    and what to change. The CLI ends the run with that one line; the traceback goes to the run's error.log (and to
    the terminal with --verbose): it is the user's input to mend, not the code's path to read."""


class DataError(UserError, ValueError):
    """Bad or missing input data; the message names the file (and line or row, and field, where there is one)."""
