"""1. Layout conversion: placements -> NamedSharding, cold / warm / cached, vs building
the same ``NamedSharding(mesh, PartitionSpec(...))`` by hand."""

from __future__ import annotations

import statistics

from catalogue import mesh_of, mesh_text
from harness import Comparison, Config, Section, Table, Target, microseconds, paired, progress, time_each, within
from jax.sharding import NamedSharding, PartitionSpec

from placements2jax import Layout, clear_caches
from placements2jax.layout import resolve_layout
from placements2jax.placements import parse_placements_or_alias

# (mesh shape, tensor ndim, placements text, the PartitionSpec written by hand)
CASES = (
    ((8,), 2, "S(0)", PartitionSpec("x", None)),
    ((4, 2), 2, "S(0),S(1)", PartitionSpec("a", "b")),
    ((4, 2), 2, "R,S(0)", PartitionSpec("b", None)),
    ((4, 2), 2, "(a,b),None", PartitionSpec(("a", "b"), None)),
    ((4, 2), 2, "P,S(0)", PartitionSpec("b", None, unreduced={"a"})),
    ((2, 2, 2), 3, "S(0),R,S(2)", PartitionSpec("a", None, "c")),
)

CACHED_LIMIT = 2.0
WARM_LIMIT_US = 5.0


def _measure(
    case: tuple[tuple[int, ...], int, str, PartitionSpec], config: Config
) -> tuple[tuple[str, ...], Comparison, float]:
    mesh_shape, ndim, text, spec = case
    mesh = mesh_of(mesh_shape)
    jax_mesh = mesh.to_jax()
    placements = parse_placements_or_alias(text)
    entries, unreduced = spec.partitions, spec.unreduced
    built = resolve_layout(mesh, placements, ndim)
    assert built.named_sharding == NamedSharding(jax_mesh, spec), (text, built.partition_spec, spec)

    def by_hand() -> NamedSharding:
        return NamedSharding(jax_mesh, PartitionSpec(*entries, unreduced=unreduced))

    def cold() -> NamedSharding:
        clear_caches()
        return resolve_layout(mesh, placements, ndim).named_sharding

    def new() -> NamedSharding:
        return Layout.from_device_mesh(mesh)(placements).bind(ndim).named_sharding

    def warm() -> NamedSharding:
        return resolve_layout(mesh, placements, ndim).named_sharding

    def cached() -> NamedSharding:
        return built.named_sharding

    hand_t, cold_t, new_t, warm_t, cached_t = time_each((by_hand, cold, new, warm, cached), config)
    cold_r, new_r, warm_r, cached_r = (paired(t, hand_t) for t in (cold_t, new_t, warm_t, cached_t))
    row = (
        mesh_text(mesh_shape),
        text,
        str(spec),
        microseconds(statistics.median(hand_t)),
        cold_r.ratio_text(),
        new_r.ratio_text(),
        warm_r.ratio_text(),
        cached_r.ratio_text(),
        f"{microseconds(new_r.ours_median)} / {microseconds(warm_r.ours_median)} / {microseconds(cached_r.ours_median)}",
    )
    return row, cached_r, warm_r.ours_median


def run(config: Config) -> Section:
    section = Section(
        "layout",
        "1. Layout conversion: placements -> NamedSharding",
        """
Baseline: `NamedSharding(jax_mesh, PartitionSpec(...))` written by hand (the JAX mesh
already built). **cold**: `placements2jax.clear_caches()` (every registered cache, the
resolver's included), then `resolve_layout(mesh, placements, ndim).named_sharding`
(clearing the caches is inside the timed call; the interned Layout itself survives, as it
does in a program that holds it); **parse**: the RFC's call,
`Layout.from_device_mesh(mesh)(placements).bind(ndim)`, each call (parses and validates
the placements, then finds the interned Layout); **warm**: `resolve_layout(mesh,
placements, ndim)`, the one resolver every entry point (`DTensor`, `distribute_tensor`,
`redistribute`) uses, which remembers placements as given (one dict lookup); **cached**:
`.named_sharding` of a `Layout` already built (a `cached_property`, what a DTensor's layout
gives). The mesh (`DeviceMesh.to_jax()`, cached on the mesh) exists in all variants: a
program has one mesh.
""",
    )
    rows = []
    cached_results = []
    warm_seconds = []
    for case in CASES:
        progress(f"  layout {case[0]} {case[2]}")
        row, cached, warm = _measure(case, config)
        rows.append(row)
        cached_results.append(cached)
        warm_seconds.append(warm)
    section.tables.append(
        Table(
            "placements -> NamedSharding, ratio to building it by hand",
            ("mesh", "placements", "PartitionSpec", "by hand (µs)", "cold / hand", "parse / hand", "warm / hand",
             "cached / hand", "parse / warm / cached (µs)"),
            tuple(rows),
        )
    )
    parsed = [float(row[8].split(" / ")[0]) for row in rows]
    section.notes.append(
        f"Parsing and validating placements into a Layout costs {min(parsed):.0f}-{max(parsed):.0f} µs; Layouts "
        "are interned, so that work ends in finding the existing one. The entry points resolve placements as "
        "given through one cache (warm), and a Layout keeps its NamedSharding (cached)."
    )
    section.targets.append(within(f"cached conversion within {CACHED_LIMIT:g}x of by hand", cached_results, CACHED_LIMIT))
    worst = max(warm_seconds) * 1e6
    section.targets.append(
        Target(
            "warm Layout from placements (resolve_layout) under 5 µs",
            f"median {min(warm_seconds) * 1e6:.1f}-{worst:.1f} µs",
            f"every case <= {WARM_LIMIT_US:g} µs",
            worst <= WARM_LIMIT_US,
        )
    )
    return section

