"""Maintainer tool, not part of the tests: a PNG screenshot of a run's report.md, for the README.

    python docs/screenshot_report.py runs/demo/<UTC time>-<flow run name> [--out docs/images/run-report.png]
    python docs/screenshot_report.py --url http://127.0.0.1:5000/#/experiments/1/runs/<id> \
        --out docs/images/mlflow-run.png

The first renders the run's report.md to HTML (markdown-it-py, which the project already installs through
rich), with its plots beside it, and screenshots the page with headless Chromium (Debian: `apt-get install -y
chromium`). The PNG is cropped at the end of the page and reduced to a palette so the committed file stays
small. The second screenshots a page that a server renders with JavaScript (the MLflow run a tracked run
logged to: its link is report.json's `tracking.mlflow.url`), letting its scripts run for `--wait` seconds of
virtual time first.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from markdown_it import MarkdownIt
from PIL import Image

STYLE = """
body { font: 15px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1f2328; margin: 0;
       padding: 24px 32px; max-width: 980px; }
h1 { font-size: 1.7em; border-bottom: 1px solid #d1d9e0; padding-bottom: .3em; }
h2 { font-size: 1.3em; border-bottom: 1px solid #d1d9e0; padding-bottom: .2em; margin-top: 1.4em; }
table { border-collapse: collapse; margin: .6em 0; font-size: 13px; }
th, td { border: 1px solid #d1d9e0; padding: 3px 10px; text-align: left; }
tr:nth-child(2n) { background: #f6f8fa; }
code { background: #eff1f3; padding: .1em .3em; border-radius: 4px; font-size: 85%; }
blockquote { border-left: 4px solid #d1d9e0; margin: 0; padding: 0 1em; color: #59636e; }
img { max-width: 100%; }
"""


def render_html(run_dir: Path) -> str:
    body = MarkdownIt("commonmark").enable("table").render((run_dir / "report.md").read_text())
    # <base>: the report's relative image links resolve in the run directory.
    return (f'<!doctype html><html><head><meta charset="utf-8"><base href="{run_dir.resolve().as_uri()}/">'
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def screenshot(page: str, out: Path, chromium: str, size: tuple[int, int], wait_seconds: float = 0.0) -> None:
    """`page`: a URL, or HTML to load from a file."""
    with tempfile.TemporaryDirectory(prefix="report-shot-") as scratch:
        if not page.startswith(("http://", "https://")):
            html = Path(scratch) / "report.html"
            html.write_text(page)
            page = html.as_uri()
        wait = [f"--virtual-time-budget={int(wait_seconds * 1000)}"] if wait_seconds else []
        subprocess.run([chromium, *wait, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync",
                        "--hide-scrollbars", f"--user-data-dir={Path(scratch) / 'profile'}",
                        f"--screenshot={out}", f"--window-size={size[0]},{size[1]}", page],
                       check=True, capture_output=True, timeout=120)


def shrink(path: Path, colours: int = 128) -> None:
    """Crop the blank page below the report and store the image with a palette of `colours`."""
    image = Image.open(path).convert("RGB")
    rows = [y for y in range(image.height) if image.crop((0, y, image.width, y + 1)).getextrema() != ((255, 255),) * 3]
    if rows:
        image = image.crop((0, 0, image.width, min(image.height, rows[-1] + 24)))
    image.quantize(colors=colours, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, nargs="?", help="a run directory with report.md and its plots")
    parser.add_argument("--url", help="instead of a run directory: a page to screenshot (an MLflow run)")
    parser.add_argument("--wait", type=float, default=15.0, help="--url: seconds of virtual time for its scripts")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images" / "run-report.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--width", type=int, default=1040)
    parser.add_argument("--height", type=int, default=4200, help="the window; the blank part is cropped")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if (args.url is None) == (args.run_dir is None):
        parser.error("give a run directory or --url")
    page = args.url or render_html(args.run_dir)
    screenshot(page, args.out.resolve(), args.chromium, (args.width, args.height), args.wait if args.url else 0.0)
    shrink(args.out)
    print(f"{args.out}: {args.out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
