"""benchmarks/host_steadiness.py: the windows' rates and their spread, on every core torch uses and on one thread,
with the host's steal time beside them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import host_steadiness  # noqa: E402 - after its folder is on the path


def test_the_spread_is_read_from_the_windows_rates():
    got = host_steadiness.summary([90.0, 100.0, 110.0])
    assert got["mean"] == 100.0 and got["min_over_max"] == pytest.approx(90 / 110, abs=1e-3)
    assert got["half_range_over_mean"] == 0.1 and got["stdev_over_mean"] == 0.1


def test_a_short_run_writes_both_thread_counts(tmp_path):
    out = tmp_path / "steadiness.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_steadiness.py"), "--windows", "2", "--seconds",
                    "0.2", "--size", "128", "--out", str(out)], check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    single = result["threads_1"]
    assert len(single["gflops"]) == 2 and all(rate > 0 for rate in single["gflops"])
    assert single["steal_share"] is None or 0.0 <= single["steal_share"] <= 1.0
    assert result["window_seconds"] == 0.2 and result["size"] == 128
