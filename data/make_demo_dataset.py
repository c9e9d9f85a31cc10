"""Generate the demo dataset: rewrite an ISO date in a named format, a task whose answers can be checked exactly.

    python data/make_demo_dataset.py [--examples N] [--seed S] [--out data/demo_dates.jsonl]

Chat `messages` records; deterministic for a given seed, so every machine trains on the same bytes.
"""
from __future__ import annotations

import argparse
import calendar
import datetime as dt
import json
import random
from pathlib import Path

FORMATS = {
    "US format (MM/DD/YYYY)": lambda d: d.strftime("%m/%d/%Y"),
    "European format (DD.MM.YYYY)": lambda d: d.strftime("%d.%m.%Y"),
    "long form": lambda d: f"{calendar.month_name[d.month]} {d.day}, {d.year}",
}
SYSTEM = "You rewrite dates. Answer with the date only."


def example(rng: random.Random) -> dict:
    day = dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(365 * 100))
    name, render = rng.choice(list(FORMATS.items()))
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Write {day.isoformat()} in {name}."},
            {"role": "assistant", "content": render(day)},
        ]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=480)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "demo_dates.jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as handle:
        for _ in range(args.examples):
            handle.write(json.dumps(example(rng)) + "\n")
    print(f"wrote {args.examples} examples to {args.out}")


if __name__ == "__main__":
    main()
