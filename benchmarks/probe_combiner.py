"""The combiner model against XLA: per program, each collective kind's count after XLA's
combiner as ``predict`` models it (``Prediction.combined_counts``,
placements2jax/inference/combine.py) and as CPU XLA compiles the prediction's own program
(``apply(execute="pinned")`` under ``jax.jit``, its collectives read from the compiled HLO
as ``check`` reads them). The programs: benchmarks/dump_predictions.py's 19, and with
``--real`` section 14's (benchmarks/bench_real_programs.py). One line per program:
``kind=predicted/compiled`` and ``[equal]``, ``[above]`` (a kind predicted more often than
compiled, none fewer) or ``[BELOW]`` (a kind predicted fewer times than XLA compiles it: a
count target claimed on the model would be false). docs/inference.md section 7 (stop 37)
records a run.

    python benchmarks/probe_combiner.py                 (~3 min on 2 idle cores)
    python benchmarks/probe_combiner.py --real "MoE"    (section 14's rows whose names contain it)
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package next to the benchmarks
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/models

import equinox as eqx  # noqa: E402

from placements2jax import apply, init_device_mesh, predict  # noqa: E402
from placements2jax.hlo import parse_collectives  # noqa: E402

import dump_predictions  # noqa: E402


def _programs(real: bool) -> Iterator[tuple[str, Any, tuple[Any, ...], Any]]:
    if not real:
        yield from dump_predictions._programs()
        return
    import bench_real_programs

    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    for name, build in bench_real_programs.PROGRAMS.items():
        yield name, *build(mesh)


def line(name: str, fn: Any, args: tuple[Any, ...], out_layouts: Any) -> str:
    """``name``'s counts per kind, predicted after the combiner / compiled pinned."""
    predicted = Counter(predict(fn, *args, out_layouts=out_layouts).combined_counts)
    # the arguments returned too: a stateful step's updated Variables are its arguments' (nnx)
    pinned = eqx.filter_jit(lambda *a: (apply(fn, *a, out_layouts=out_layouts, execute="pinned"), a[:2]))
    compiled = Counter(c.op for c in parse_collectives(pinned.lower(*args).compile().compiled.as_text()))
    kinds = sorted(set(predicted) | set(compiled))
    verdict = ("equal" if predicted == compiled
               else "BELOW" if any(predicted[k] < compiled[k] for k in kinds) else "above")
    return f"{name}: {' '.join(f'{k}={predicted[k]}/{compiled[k]}' for k in kinds)} [{verdict}]"


def main(argv: list[str]) -> None:
    real = "--real" in argv
    only = " ".join(a for a in argv if a != "--real")
    for name, fn, args, out_layouts in _programs(real):
        if only in name:
            print(line(name, fn, args, out_layouts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
