"""`benchmarks/partial_rollouts.py --quick` in process on its tiny random model: both rows, the speed-up's direction,
the idle share and what stays in flight."""
import pytest

from benchmarks import partial_rollouts


@pytest.mark.slow
def test_quick_benchmark_rows(tmp_path):
    result = partial_rollouts.main(["--quick", "--out", str(tmp_path)])
    sync, part = result["rows"]
    assert (sync["mode"], part["mode"]) == ("synchronous", "partial")
    assert sync["in_flight_at_end"] == 0 and part["in_flight_at_end"] > 0
    assert sync["trained_per_step"] == 8  # 4 prompts x 2 samples, every step
    assert part["trained_per_step"] > 0
    assert result["speedup"] > 1.0 and part["idle_frac"] < sync["idle_frac"]
    assert (tmp_path / "table.md").read_text().startswith("| mode |")
