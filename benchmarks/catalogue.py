"""The catalogue of redistributions measured by the redistribute, communication and
memory benchmarks: every kind of move on (8,), (4,2) and (2,2,2) meshes, even shapes.

Placements are written as text: torch form (``"S(0),R"``, one entry per mesh dim) or
alias form (``"(a,b),None"``, one entry per tensor dim, major to minor axes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import jax
import numpy as np

from placements2jax import (
    DeviceMesh,
    DTensor,
    Layout,
    distribute_tensor,
    init_device_mesh,
    plan_redistribute,
    resolve_layout,
)
from placements2jax.physical import physical
from placements2jax.placements import parse_placements_or_alias
from placements2jax.programs import program
from placements2jax.schedules import Policy, Schedule, choose

MESHES: dict[tuple[int, ...], tuple[str, ...]] = {(8,): ("x",), (4, 2): ("a", "b"), (2, 2, 2): ("a", "b", "c")}

# Tensor shapes per mesh: "large" (64 MiB of int32), "medium" (4 MiB: moving data
# dominates) and "small" (16 KiB: dispatch dominates).
SHAPES: dict[tuple[int, ...], dict[str, tuple[int, ...]]] = {
    (8,): {"small": (64, 64), "medium": (1024, 1024), "large": (4096, 4096)},
    (4, 2): {"small": (64, 64), "medium": (1024, 1024), "large": (4096, 4096)},
    (2, 2, 2): {"small": (16, 16, 16), "medium": (64, 128, 128), "large": (256, 256, 256)},
}

# (kind, source, target) per mesh.
_MOVES: dict[tuple[int, ...], tuple[tuple[str, str, str], ...]] = {
    (8,): (
        ("S->R", "S(0)", "R"),
        ("S->R", "S(1)", "R"),
        ("R->S", "R", "S(0)"),
        ("R->S", "R", "S(1)"),
        ("S(i)->S(j)", "S(0)", "S(1)"),
        ("S(i)->S(j)", "S(1)", "S(0)"),
        ("P->R", "P", "R"),
        ("P->S", "P", "S(0)"),
        ("P->S", "P", "S(1)"),
    ),
    (4, 2): (
        ("S->R", "S(0),S(1)", "R,R"),
        ("S->R", "S(0),R", "R,R"),
        ("S->R", "R,S(0)", "R,R"),
        ("S->R", "(a,b),None", "R,S(0)"),
        ("R->S", "R,R", "S(0),S(1)"),
        ("R->S", "R,R", "(a,b),None"),
        ("S(i)->S(j)", "S(0),S(1)", "S(1),S(0)"),
        ("S(i)->S(j)", "S(0),R", "S(1),R"),
        ("S(i)->S(j)", "R,S(0)", "R,S(1)"),
        ("S(i)->S(j)", "(a,b),None", "None,(a,b)"),
        ("S(i)->S(j)", "S(0),R", "R,S(0)"),
        ("P->R", "P,R", "R,R"),
        ("P->R", "P,P", "R,R"),
        ("P->S", "P,R", "S(0),R"),
        ("P->S", "P,S(0)", "S(1),S(0)"),
        ("P->S", "P,P", "S(0),S(1)"),
        ("P kept", "P,S(0)", "P,S(1)"),
        ("alias", "(a,b),None", "(b,a),None"),
        ("alias", "(a,b),None", "None,(b,a)"),
        ("alias", "(b,a),None", "R,R"),
    ),
    (2, 2, 2): (
        ("S->R", "S(0),S(1),S(2)", "R,R,R"),
        ("S->R", "(a,b,c),None,None", "R,R,R"),
        ("S->R", "(a,b),None,None", "R,S(0),R"),
        ("R->S", "R,R,R", "S(0),S(1),S(2)"),
        ("S(i)->S(j)", "S(0),S(1),S(2)", "S(2),S(1),S(0)"),
        ("S(i)->S(j)", "S(0),S(1),S(2)", "S(1),S(2),S(0)"),
        ("S(i)->S(j)", "(a,b,c),None,None", "None,(a,b,c),None"),
        ("P->R", "P,R,S(0)", "R,R,S(0)"),
        ("P->R", "P,P,P", "R,R,R"),
        ("P->S", "P,P,P", "S(0),S(1),S(2)"),
        ("P->S", "P,S(0),R", "S(1),S(0),R"),
        ("P kept", "P,S(0),S(1)", "P,S(1),S(0)"),
        ("alias", "(a,b,c),None,None", "(c,b,a),None,None"),
        ("alias", "(a,b),c,None", "c,(a,b),None"),
        ("alias", "(a,b,c),None,None", "None,None,(c,b,a)"),
    ),
}


@dataclass(frozen=True)
class Move:
    """One redistribution: a tensor of ``shape`` from ``src`` to ``dst`` on a mesh."""

    kind: str
    mesh_shape: tuple[int, ...]
    src: str
    dst: str
    shape: tuple[int, ...]

    @property
    def mesh(self) -> DeviceMesh:
        return mesh_of(self.mesh_shape)

    @property
    def mesh_text(self) -> str:
        return mesh_text(self.mesh_shape)

    @property
    def label(self) -> str:
        return f"{self.src} -> {self.dst}"

    @property
    def src_placements(self) -> tuple:
        return parse_placements_or_alias(self.src)

    @property
    def dst_placements(self) -> tuple:
        return parse_placements_or_alias(self.dst)

    @cached_property
    def src_layout(self) -> Layout:
        return resolve_layout(self.mesh, self.src_placements, len(self.shape))

    @cached_property
    def dst_layout(self) -> Layout:
        return resolve_layout(self.mesh, self.dst_placements, len(self.shape))

    @property
    def itemsize(self) -> int:
        return 4

    def data(self) -> np.ndarray:
        """int32 values: exact, and a Partial(sum) source holds x on one rank of each
        partial group and zeros on the others, so misrouted partial values would show
        (equal float shares x / n would hide them)."""
        return np.arange(int(np.prod(self.shape)), dtype=np.int32).reshape(self.shape)

    def dtensor(self) -> DTensor:
        return distribute_tensor(self.data(), self.mesh, self.src_placements)

    def argument(self) -> jax.ShapeDtypeStruct:
        """The source's physical array as an abstract value (for lowering without data)."""
        phys = physical(self.src_layout, self.shape)
        return jax.ShapeDtypeStruct(phys.array_shape, np.int32, sharding=phys.sharding)

    def ours(self) -> jax.stages.Wrapped:
        """XLA's single reshard for this move (``redistribute(..., policy="xla")``)."""
        return program(physical(self.src_layout, self.shape), physical(self.dst_layout, self.shape))

    def schedule(self, policy: Policy) -> Schedule:
        """The schedule ``redistribute(..., policy=policy)`` runs for this move."""
        return choose(physical(self.src_layout, self.shape), physical(self.dst_layout, self.shape), np.int32, policy)

    @cached_property
    def compiled_ours(self) -> jax.stages.Compiled:
        return self.ours().lower(self.argument()).compile()

    @cached_property
    def compiled_direct(self) -> jax.stages.Compiled:
        return self.direct_jax.lower(self.argument()).compile()

    @cached_property
    def compiled_stepwise(self) -> jax.stages.Compiled:
        """Our planner's steps (``plan_redistribute``) run as successive reshards, one per
        step, compiled: what the planner's route costs once XLA implements it."""
        plan = plan_redistribute(self.shape, np.int32, self.src_layout, self.dst_layout)
        shardings = [step.after.bind(len(self.shape)).named_sharding for step in plan.steps]

        def stepwise(a: jax.Array) -> jax.Array:
            for sharding in shardings:
                a = jax.sharding.reshard(a, sharding)
            return a

        return jax.jit(stepwise).lower(self.argument()).compile()

    @cached_property
    def direct_jax(self) -> jax.stages.Wrapped:
        """The same reshard written directly in JAX: ``reshard`` to the target's
        ``NamedSharding`` inside ``jax.jit``."""
        sharding = self.dst_layout.named_sharding
        return jax.jit(lambda a: jax.sharding.reshard(a, sharding))


def mesh_text(shape: tuple[int, ...]) -> str:
    """``(8,)``, ``(4,2)``: a mesh shape as the tables print it."""
    return "(" + ",".join(map(str, shape)) + (",)" if len(shape) == 1 else ")")


@cache
def mesh_of(shape: tuple[int, ...]) -> DeviceMesh:
    return init_device_mesh(shape, MESHES[shape])


@cache
def moves(size: str, quick: bool = False) -> tuple[Move, ...]:
    """Every move of the catalogue with tensors of ``size`` ("small", "medium", "large"); in a
    quick run, the first move of each kind and the first move of each mesh."""
    result = []
    kinds: set[str] = set()
    for mesh_shape, entries in _MOVES.items():
        for position, (kind, src, dst) in enumerate(entries):
            if not quick or kind not in kinds or position == 0:
                result.append(Move(kind, mesh_shape, src, dst, SHAPES[mesh_shape][size]))
            kinds.add(kind)
    return tuple(result)
