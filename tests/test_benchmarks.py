"""Smoke test of the benchmark suite: `benchmarks/run.py --quick` completes and writes
its tables (to a temporary file, not docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = (
    "1. Layout conversion",
    "2. distribute_tensor vs jax.device_put",
    "3. redistribute vs the same reshard written in JAX",
    "4. Communication",
    "5. Temporary memory",
    "6. DTensor operators",
    "7. Signature inference",
    "8. Vocabulary-parallel cross-entropy",
    "9. from_local vs make_array_from_single_device_arrays",
    "10. FSDP (fully_shard) vs replicated data parallelism vs plain JAX",
    "11. Auto-plan vs the Megatron and FSDP presets",
    "12. Flax NNX, Equinox and Flax Linen training code",
    "13. Optimizer state following its parameters",
    "14. Real training programs: predicted vs compiled",
)


@pytest.mark.timeout(300)
def test_quick_run_writes_every_table(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.md"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # run.py sets the 8 devices itself
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--output", str(output)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = output.read_text()
    assert text.startswith("# Benchmarks") and "--quick --output" in text
    for title in SECTIONS:
        assert f"## {title}" in text, title
    assert "FAILED" not in text and "UNEXPLAINED" not in text
    assert text.count("\n| ") > 50  # table rows
    assert "| jitted DTensor functions compile to the plain JAX program |" in text
    assert "check: predicted vs compiled communication per device" in text  # whole-program vs eager vs XLA
    assert "| nnx loss | 1 of 1 |" in text  # bench_frameworks' quick row: check agrees with XLA
    optimizer_targets = [line for line in text.splitlines() if line.startswith("| 13. Optimizer state")]
    assert len(optimizer_targets) == 2 and all(line.endswith("| PASS |") for line in optimizer_targets)
