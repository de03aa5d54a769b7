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
        return cls(quick=True, repeats=2, sample_time=0.001, warmup=1)


@dataclass(frozen=True)
class Comparison:
    """Paired samples: seconds per call of ours and of the baseline, one pair per repeat."""

    ours: tuple[float, ...]
    baseline: tuple[float, ...]

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


def _warm_up(functions: Sequence[Callable[[], Any]], config: Config) -> int:
    """Call every function ``config.warmup`` times (at least once); return the number of
    calls that makes a sample of the slowest one last ``config.sample_time``."""
    slowest = 0.0
    for _ in range(max(1, config.warmup)):
        slowest = max(timeit.Timer(f).timeit(1) for f in functions)
    return max(1, min(100_000, math.ceil(config.sample_time / max(slowest, 1e-9))))


def time_each(functions: Sequence[Callable[[], Any]], config: Config) -> list[tuple[float, ...]]:
    """Seconds per call of each function, one sample of each per repeat, interleaved: the
    order alternates between repeats so that load from other processes hits all of them.
    Every function must block until its result is ready (``jax.block_until_ready``)."""
    number = _warm_up(functions, config)
    timers = [timeit.Timer(f) for f in functions]
    samples: list[list[float]] = [[] for _ in functions]
    gc.collect()
    for repeat in range(config.repeats):
        order = range(len(functions)) if repeat % 2 == 0 else reversed(range(len(functions)))
        for i in order:
            samples[i].append(timers[i].timeit(number) / number)
    return [tuple(s) for s in samples]


def compare(ours: Callable[[], Any], baseline: Callable[[], Any], config: Config) -> Comparison:
    """Time ``ours`` against ``baseline``, interleaved (see :func:`time_each`)."""
    ours_times, baseline_times = time_each((ours, baseline), config)
    return paired(ours_times, baseline_times)


def paired(ours: Sequence[float], baseline: Sequence[float]) -> Comparison:
    """The Comparison of two sample series taken together by :func:`time_each`."""
    return Comparison(tuple(ours), tuple(baseline))


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def within(name: str, comparisons: Sequence[Comparison], limit: float) -> Target:
    """The target "ours within ``limit`` x of the baseline" over several comparisons.

    Met when the geometric mean of the median ratios is within the limit and no single
    comparison is *consistently* slower: its lower quartile of paired ratios above the
    limit. A median above the limit with the lower quartile below is reported, as noise
    of that comparison (the machine is shared), not as a miss."""
    medians = [c.ratio for c in comparisons]
    mean = geometric_mean(medians)
    above = [c for c in comparisons if c.ratio > limit]
    consistent = [c for c in comparisons if c.spread[0] > limit]
    return Target(
        name,
        f"geometric mean {mean:.2f}x, worst median {max(medians):.2f}x; {len(above)} of {len(medians)} medians "
        f"above {limit}x, {len(consistent)} consistently (lower quartile above)",
        f"mean <= {limit}x, none consistently above",
        mean <= limit and not consistent,
    )


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
