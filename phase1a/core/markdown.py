"""A Markdown table, as report.md and the model card write them."""
from __future__ import annotations


def markdown_table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """The table's lines; a `|` or a line break inside a cell is escaped, so a cell never splits a row."""
    cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(value) for value in row) + " |" for row in rows)]
