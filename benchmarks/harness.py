"""Measurement and reporting shared by every benchmark family.

Timing is always *paired*: ours and the baseline are measured alternately in the same
loop (the first of each pair alternates too), so a burst of load from other processes
hits both sides of a pair. Each sample is ``timeit`` over enough calls to last
``sample_time`` seconds (garbage collection off, as timeit does); the figure reported
is the median over the samples of the per-pair ratio ours / baseline, with the
interquartile range of those ratios as the spread.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Config:
    """How hard to measure: ``repeats`` paired samples of at least ``sample_time`` seconds
    each, after ``warmup`` untimed calls of both sides."""

    quick: bool
    repeats: int
    sample_time: float
    warmup: int

    @classmethod
    def full(cls) -> Config:
        return cls(quick=False, repeats=15, sample_time=0.02, warmup=3)

    @classmethod
    def smoke(cls) -> Config:
        return cls(quick=True, repeats=3, sample_time=0.001, warmup=1)


@dataclass(frozen=True)
class Comparison:
    """Paired samples: seconds per call of ours and of the baseline, one pair per repeat."""

    ours: tuple[float, ...]
    baseline: tuple[float, ...]
    number: int

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(o / b for o, b in zip(self.ours, self.baseline))

    @property
    def ratio(self) -> float:
        """Median of the per-pair ratios ours / baseline."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """Interquartile range of the per-pair ratios."""
        return quartiles(self.ratios)

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline)

    def ratio_text(self) -> str:
        low, high = self.spread
        return f"{self.ratio:.2f} ({low:.2f}–{high:.2f})"


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], q[2])


def _calls_per_sample(functions: Sequence[Callable[[], Any]], sample_time: float) -> int:
    """The number of calls that makes the slower function's sample last ``sample_time``."""
    slowest = max(timeit.Timer(f).timeit(1) for f in functions)
    return max(1, min(100_000, math.ceil(sample_time / max(slowest, 1e-9))))


def compare(ours: Callable[[], Any], baseline: Callable[[], Any], config: Config) -> Comparison:
    """Time ``ours`` against ``baseline``, interleaved (see the module docstring). Both
    must block until their result is ready (``jax.block_until_ready``)."""
    for _ in range(config.warmup):
        ours()
        baseline()
    number = _calls_per_sample((ours, baseline), config.sample_time)
    timers = (timeit.Timer(ours), timeit.Timer(baseline))
    ours_times: list[float] = []
    baseline_times: list[float] = []
    gc.collect()
    for repeat in range(config.repeats):
        order = (0, 1) if repeat % 2 == 0 else (1, 0)
        sample = [0.0, 0.0]
        for side in order:
            sample[side] = timers[side].timeit(number) / number
        ours_times.append(sample[0])
        baseline_times.append(sample[1])
    return Comparison(tuple(ours_times), tuple(baseline_times), number)


def time_each(functions: Sequence[Callable[[], Any]], config: Config) -> list[tuple[float, ...]]:
    """Seconds per call of several functions, interleaved the same way (for figures that
    are ratios between more than two variants)."""
    for _ in range(config.warmup):
        for f in functions:
            f()
    number = _calls_per_sample(functions, config.sample_time)
    timers = [timeit.Timer(f) for f in functions]
    samples: list[list[float]] = [[] for _ in functions]
    gc.collect()
    for repeat in range(config.repeats):
        order = range(len(functions)) if repeat % 2 == 0 else reversed(range(len(functions)))
        for i in order:
            samples[i].append(timers[i].timeit(number) / number)
    return [tuple(s) for s in samples]


def paired(ours: Sequence[float], baseline: Sequence[float]) -> Comparison:
    """A Comparison from samples taken by :func:`time_each`."""
    return Comparison(tuple(ours), tuple(baseline), 0)


def microseconds(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


# -- results -------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def markdown(self) -> str:
        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", " ")

        lines = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |"]
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """One target of the issue: what was measured, the limit, and whether it was met
    (None: not measured, e.g. the code under test does not exist yet)."""

    name: str
    measured: str
    limit: str
    passed: bool | None

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "MISS", None: "n/a"}[self.passed]


@dataclass
class Section:
    """The result of one benchmark family: prose, tables, targets and explanations."""

    name: str
    title: str
    intro: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self, level: int = 2) -> str:
        parts = [f"{'#' * level} {self.title}", "", self.intro.strip(), ""]
        if self.targets:
            parts.append(
                Table(
                    "Targets",
                    ("target", "measured", "limit", "verdict"),
                    tuple((t.name, t.measured, t.limit, t.verdict) for t in self.targets),
                ).markdown()
            )
            parts.append("")
        for table in self.tables:
            parts += [table.markdown(), ""]
        if self.notes:
            parts += [note.strip() + "\n" for note in self.notes]
        return "\n".join(parts).rstrip() + "\n"


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
