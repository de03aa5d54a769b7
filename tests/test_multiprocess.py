"""Two processes with 4 CPU devices each (jax.distributed on localhost, gloo collectives):
DTensors built from each process's own shards, redistributed across the process boundary.
The work happens in tests/_multiprocess_worker.py; this test starts both processes, bounds
them in time and shows both processes' output when anything fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_SECONDS = 180  # per process; the two run concurrently


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _run_pair() -> list[tuple[int | None, str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=TIMEOUT_SECONDS)
            results.append((process.returncode, out, err))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        results = [
            (None if p.returncode is None or p.returncode < 0 else p.returncode, *p.communicate()) for p in processes
        ]
        results = [(None, out, err + f"\n[killed after {TIMEOUT_SECONDS} s]") for _, out, err in results]
    return results


def _report(results: list[tuple[int | None, str, str]]) -> str:
    return "\n".join(
        f"--- process {i}: exit code {code}\n[stdout]\n{out[-4000:]}\n[stderr]\n{err[-8000:]}"
        for i, (code, out, err) in enumerate(results)
    )


def test_two_processes_redistribute_across_the_boundary() -> None:
    results = _run_pair()
    assert all(code == 0 for code, _, _ in results), _report(results)
    summaries = [json.loads(out.strip().splitlines()[-1].removeprefix("RESULT ")) for _, out, _ in results]
    assert [s["process"] for s in summaries] == [0, 1]
    assert summaries[0]["passed"] == summaries[1]["passed"], _report(results)
    assert len(summaries[0]["passed"]) >= 20, summaries[0]
