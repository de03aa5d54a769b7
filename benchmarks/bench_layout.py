"""1. Layout conversion: placements -> NamedSharding, cold / warm / cached, vs building
the same ``NamedSharding(mesh, PartitionSpec(...))`` by hand."""

from __future__ import annotations

import statistics

from caches import clear_package_caches
from catalogue import mesh_of, mesh_text
from harness import Comparison, Config, Section, Table, microseconds, paired, progress, time_each, within
from jax.sharding import NamedSharding, PartitionSpec

from placements2jax import Layout
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


def _measure(case: tuple[tuple[int, ...], int, str, PartitionSpec], config: Config) -> tuple[tuple[str, ...], Comparison]:
    mesh_shape, ndim, text, spec = case
    mesh = mesh_of(mesh_shape)
    jax_mesh = mesh.to_jax()
    placements = parse_placements_or_alias(text)
    entries, unreduced = spec.partitions, spec.unreduced
    built = Layout.from_placements(mesh, placements).bind(ndim)
    assert built.named_sharding == NamedSharding(jax_mesh, spec), (text, built.partition_spec, spec)

    def by_hand() -> NamedSharding:
        return NamedSharding(jax_mesh, PartitionSpec(*entries, unreduced=unreduced))

    def cold() -> NamedSharding:
        clear_package_caches()
        return Layout.from_placements(mesh, placements).bind(ndim).named_sharding

    def warm() -> NamedSharding:
        return Layout.from_placements(mesh, placements).bind(ndim).named_sharding

    def cached() -> NamedSharding:
        return built.named_sharding

    hand_t, cold_t, warm_t, cached_t = time_each((by_hand, cold, warm, cached), config)
    cold_r, warm_r, cached_r = (paired(t, hand_t) for t in (cold_t, warm_t, cached_t))
    row = (
        mesh_text(mesh_shape),
        text,
        str(spec),
        microseconds(statistics.median(hand_t)),
        cold_r.ratio_text(),
        warm_r.ratio_text(),
        cached_r.ratio_text(),
        f"{microseconds(warm_r.ours_median)} / {microseconds(cached_r.ours_median)}",
    )
    return row, cached_r


def run(config: Config) -> Section:
    section = Section(
        "layout",
        "1. Layout conversion: placements -> NamedSharding",
        """
Baseline: `NamedSharding(jax_mesh, PartitionSpec(...))` written by hand (the JAX mesh
already built). **cold**: every placements2jax `functools` cache emptied, then a new `Layout`
from the placements and `.bind(ndim).named_sharding` (clearing the caches is inside the timed
call); **warm**: a new `Layout` from the same (already parsed) placements each call, caches
warm; **cached**: `.named_sharding` of a `Layout` already built (a `cached_property`, what a
DTensor's layout gives). The mesh (`DeviceMesh.to_jax()`, cached on the mesh) exists in all
variants: a program has one mesh.
""",
    )
    rows = []
    cached_results = []
    for case in CASES:
        progress(f"  layout {case[0]} {case[2]}")
        row, cached = _measure(case, config)
        rows.append(row)
        cached_results.append(cached)
    section.tables.append(
        Table(
            "placements -> NamedSharding, ratio to building it by hand",
            ("mesh", "placements", "PartitionSpec", "by hand (µs)", "cold / hand", "warm / hand", "cached / hand",
             "warm / cached (µs)"),
            tuple(rows),
        )
    )
    warm = [float(row[7].split(" / ")[0]) for row in rows]
    section.notes.append(
        f"A new Layout from placements (warm) costs {min(warm):.0f}-{max(warm):.0f} µs: validating the placements "
        "and building the tensor_map tables. The DTensor entry points do it once per placements object (their "
        "front caches) and a bound Layout keeps its NamedSharding, so programs pay the cached figure."
    )
    section.targets.append(within(f"cached conversion within {CACHED_LIMIT:g}x of by hand", cached_results, CACHED_LIMIT))
    return section

