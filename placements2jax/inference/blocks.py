"""Layer blocks: a program's repeated layers, found in its dataflow graph (pure).

A model whose layers are unrolled (not under ``scan``) walks into a graph whose equations
repeat: Llama's adamw step with ``L`` layers holds each layer's forward, backward and
optimizer update as runs of ``L`` copies of the same equations, in program order. The
program search (:mod:`.program`) grows worse than linearly with them: its descents end in
dearer basins with depth (the objective 265,396 at 4 layers, 618,228 at 8, 1,241,684 at
16: 0.75x XLA's bytes in 168 collectives where XLA compiles 156 at 8 layers) and its
time grows quadratically (a cold predict 3.1 / 8.5 / 43.9 s CPU at 4 / 8 / 16 layers).
So the search is seeded from the blocks (:func:`.program._seeded`): a reduced graph
keeping each block's first and last copies (:func:`reduce`) is searched as any program,
its choices tiled over the middle copies (:func:`tiled`), whole copies then copied onto
others where that is cheaper (:func:`copy_moves`, :func:`copied`), and the finishing
descent runs on the whole graph, offered the moves at the blocks' seams first
(:func:`boundaries`). Measured (Llama's adamw step, Megatron dp=2 x tp=4, alternated at
load 6-9): the objective is then exactly linear in the layers (57,600 per layer from 3 to
16), 0.60x XLA's bytes in 70 collectives at 8 layers, and a cold predict takes 1.5 / 2.7 /
2.9 s.

**Detection** (:func:`find_blocks`, 8 / 23 / 67 ms CPU at 2 / 4 / 8 layers, its periods
compared in batches of rows, :func:`_runs`; one period at a time 38 / 73 / 146 ms): tandem
repeats of the equations' signatures along program order. An equation's signature is its
search *kind* (its candidate tuple and avals: :attr:`.program._Search.kinds`) and where
its inputs come from relative to itself: two equations ``p`` apart match when their kinds
are equal and, input by input, both read a function input or literal, or both read the
equation the same offset before them, or both read an equation at least ``p`` away (a
layer's backward reads its forward's activations, a copy further away for each copy).
For each period ``p``, a run of equations matching the one ``p`` later is a block, with
the equations before it up to ``p`` whose kinds alone match: a block's first copy reads
the program before it (the embeddings, tables every layer reads: an offset that differs)
where the others read the copy before them, so its run starts inside the first copy. The
blocks of at least 3 copies are kept longest first, none overlapping. Llama's adamw step:
13 blocks of ``L`` copies covering 3,768 of its 4,017 equations at 8 layers (periods
9-127); the programs of the tests' dump (an MLP, GPT-2 and Llama at their defaults, Flax
NNX's and Equinox's loss, value_and_grad and adamw step) only short repeats, under 9% of
their graphs. :func:`layer_blocks` keeps the blocks of the number of copies covering the
most equations, when that is at least 3 and they cover half the graph (else none, and the
search runs as before).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the graph's classes (program imports this module)
    from .program import ProgramGraph

__all__ = [
    "Block", "boundaries", "copied", "copy_moves", "find_blocks", "graph_sources", "layer_blocks", "reduce", "tiled",
]

MIN_PERIOD = 4  # shorter repeats are chains of elementwise equations, not layers
MIN_COPIES = 3  # with two copies there is no middle to tile (the reduced graph would be the graph)


@dataclass(frozen=True)
class Block:
    """``copies`` copies of ``period`` equations from position ``start`` on, in program order."""

    start: int
    period: int
    copies: int

    def copy(self, k: int) -> range:
        """The positions of copy ``k`` (negative: from the last)."""
        k %= self.copies
        return range(self.start + k * self.period, self.start + (k + 1) * self.period)

    @property
    def stop(self) -> int:
        return self.start + self.period * self.copies


def graph_sources(graph: ProgramGraph) -> list[tuple[int | None, ...]]:
    """Per equation, the position of the equation each input comes from (None: a
    function input, a literal or a constant)."""
    position = {node.path: p for p, node in enumerate(graph.nodes)}
    return [
        tuple(None if src is None or src[0] == "in" else position[src[0]] for src in node.sources)
        for node in graph.nodes
    ]


def find_blocks(kinds: Sequence[int], sources: Sequence[Sequence[int | None]]) -> list[Block]:
    """The tandem repeats of at least ``MIN_COPIES`` copies of ``MIN_PERIOD`` equations or
    more (module docstring), none overlapping, longest first (ties: the shorter period, then
    the earlier start), returned in program order. ``kinds[i]``: equation ``i``'s kind;
    ``sources[i]``: the positions its inputs come from (None: not an equation's)."""
    n = len(kinds)
    sig = np.asarray(kinds, dtype=np.int64)
    width = max(map(len, sources), default=0)
    # offsets to each input's producer (0: a function input, literal or constant, or no such input: an equation
    # never reads itself, and equal kinds have equal numbers of inputs)
    offsets = np.zeros((n, width), dtype=np.int64)
    for i, srcs in enumerate(sources):
        offsets[i, : len(srcs)] = [0 if j is None else i - j for j in srcs]
    far = np.abs(offsets)
    found = []
    for first in range(MIN_PERIOD, n // MIN_COPIES + 1, _PERIODS_AT_ONCE):
        for p, a, b in _runs(sig, offsets, far, first, min(first + _PERIODS_AT_ONCE, n // MIN_COPIES + 1)):
            # equations a..b-1 match p later: b - a + p equations repeat, and the first copy's part before a
            # where the kinds match (the first copy reads the program before the block, the embeddings, tables
            # every layer reads, where the others read the copy before them: the run starts inside it), at most
            # one copy more
            start = a - _entry(sig, a, p)
            copies = (b + p - start) // p
            if copies >= MIN_COPIES:
                found.append((copies * p, p, start, copies))
    found.sort(key=lambda f: (-f[0], f[1], f[2]))
    used = np.zeros(n, dtype=bool)
    blocks = []
    for span, p, start, copies in found:
        if not used[start : start + span].any():
            used[start : start + span] = True
            blocks.append(Block(start, p, copies))
    return sorted(blocks, key=lambda b: b.start)


def _runs(sig: np.ndarray, offsets: np.ndarray, far: np.ndarray, first: int, stop: int) -> list[tuple[int, int, int]]:
    """Per period ``p`` from ``first`` to ``stop - 1``, the runs ``a..b-1`` of equations
    matching the one ``p`` later (:func:`find_blocks`: equal kinds, and input by input the
    same offset or both at least ``p`` away) at least ``(MIN_COPIES - 2) * p`` long, as
    ``(p, a, b)``. The periods are compared at once, a row each: the kinds against a
    sliding window over them (a view, a row per start) padded past the end with a kind no
    equation has; the inputs where the kinds match. (A loop over the periods, ten array
    operations each, was 38 ms CPU of Llama's 2-layer adamw step, 146 ms at 8 layers.)"""
    n = len(sig)
    later = np.concatenate([sig, np.full(stop, sig.min(initial=0) - 1)])
    same = np.lib.stride_tricks.sliding_window_view(later, n)[first:stop] == sig
    if offsets.shape[1]:
        # where the kinds match (few places for most periods), the inputs: the same offset or both far
        rows, at = np.nonzero(same)
        there = at + rows + first
        apart = (rows + first)[:, None]
        same[rows, at] = ((offsets[at] == offsets[there]) | ((far[at] >= apart) & (far[there] >= apart))).all(axis=1)
    rows, edges = np.nonzero(np.diff(same, axis=1, prepend=False, append=False))
    periods, a, b = rows[::2] + first, edges[::2], edges[1::2]  # each row's edges alternate: a run's start, its end
    long = b - a >= (MIN_COPIES - 2) * periods
    return list(zip(periods[long].tolist(), a[long].tolist(), b[long].tolist()))


_PERIODS_AT_ONCE = 128  # periods per _runs() call: its arrays hold 128 rows of the graph's equations


def _entry(sig: np.ndarray, a: int, p: int) -> int:
    """How many of the (at most ``p``) equations before ``a`` match by kind the equation
    ``p`` after them, back from ``a``: the part of a block's first copy its run missed."""
    before = np.arange(max(a - p, 0), a)
    misses = np.flatnonzero(sig[before] != sig[before + p])
    return len(before) if not len(misses) else len(before) - 1 - int(misses[-1])


def layer_blocks(blocks: Sequence[Block], n: int) -> list[Block]:
    """The blocks of the number of copies covering the most of the ``n`` equations (ties:
    more copies) when that number is at least ``MIN_COPIES`` and they cover at least half
    of them: the model's layers; else none."""
    covered: dict[int, int] = {}
    for block in blocks:
        covered[block.copies] = covered.get(block.copies, 0) + block.period * block.copies
    if not covered:
        return []
    layers = max(covered, key=lambda c: (covered[c], c))
    if layers < MIN_COPIES or 2 * covered[layers] < n:
        return []
    return [block for block in blocks if block.copies == layers]


def _origins(blocks: Sequence[Block], n: int, copy: int) -> np.ndarray:
    """Per position of ``n``, itself, or in a block's middle copies the position at the
    same offset in its copy ``copy`` (0: the first, -1: the last)."""
    origin = np.arange(n)
    for block in blocks:
        middle = np.arange(block.copy(1).start, block.copy(-1).start)
        origin[middle] = block.copy(copy).start + (middle - block.start) % block.period
    return origin


def reduce(graph: ProgramGraph, blocks: Sequence[Block]) -> tuple[ProgramGraph, list[int]]:
    """The graph with each block's middle copies removed (its first and last kept, as a
    two-layer model's), an input read from a removed copy read from the first copy's
    equation at the same offset; and the indices of the function's outputs it keeps
    (those no removed equation makes)."""
    origin = _origins(blocks, len(graph.nodes), 0)
    paths = [node.path for node in graph.nodes]
    removed = {paths[p] for p in np.flatnonzero(origin != np.arange(len(paths))).tolist()}
    stand_in = {path: paths[origin[p]] for p, path in enumerate(paths) if path in removed}
    nodes = []
    for node in graph.nodes:
        if node.path in removed:
            continue
        if any(src is not None and src[0] in removed for src in node.sources):
            sources = tuple(
                (stand_in[src[0]], src[1]) if src is not None and src[0] in removed else src for src in node.sources
            )
            node = dataclasses.replace(node, sources=sources)
        nodes.append(node)
    kept = [o for o, src in enumerate(graph.outputs) if src is None or src[0] not in removed]
    outputs = tuple(graph.outputs[o] for o in kept)
    return dataclasses.replace(graph, nodes=nodes, outputs=outputs), kept


def tiled(choice: Mapping[str, int], paths: Sequence[str], blocks: Sequence[Block], copy: int) -> dict[str, int]:
    """The reduced graph's ``choice`` (:func:`reduce`) tiled over the whole graph, whose
    equations are ``paths`` by position: each block's middle copies take copy ``copy``'s
    choices (0: the first, -1: the last), every other equation its own."""
    return {path: choice[paths[p]] for path, p in zip(paths, _origins(blocks, len(paths), copy).tolist())}


def copy_moves(block: Block) -> list[tuple[int, range]]:
    """The block-copy moves tried on ``block``: (the copy copied, the copies it is copied
    onto). The first, the last and the second copy, onto the middle ones or onto all: the
    reduced graph's choice tiled is not always the cheapest per copy on the whole graph
    (Llama's adamw step: the objective 265,396 -> 258,580 at 4 layers, 495,796 -> 488,980
    at 8: the first or second copy's choice carries over better once a layer reads a
    middle layer's outputs)."""
    middle, every = range(1, block.copies - 1), range(block.copies)
    return [(0, middle), (block.copies - 1, middle), (0, every), (block.copies - 1, every), (1, every)]


def copied(choice: Mapping[str, int], paths: Sequence[str], block: Block, source: int, onto: range) -> dict[str, int]:
    """``choice`` with copy ``source``'s choices copied onto the copies ``onto`` of
    ``block``, equation by equation (``paths``: the equations by position)."""
    taken = [choice[paths[p]] for p in block.copy(source)]
    trial = dict(choice)
    for k in onto:
        trial.update(zip(map(paths.__getitem__, block.copy(k)), taken))
    return trial


def boundaries(blocks: Sequence[Block], n: int) -> list[int]:
    """The positions of ``n`` outside every block and at each copy's ends (its first and
    last equation): where the finishing descent on a tiled choice offers its moves first.
    Offered every equation, that descent was the quadratic part of the seeded search and
    found nothing on Llama's adamw step at 3, 4, 8 or 16 layers; offered these, it finds
    the same (nothing) in 0.04 / 0.06 / 0.11 / 0.29 s CPU where 0.12 / 0.19 / 0.47 / 1.55 s
    (load ~2.5). Offered those outside blocks and those reading or read across a copy's
    bounds (half of the program: a layer's backward reads its forward), 0.08 / 0.15 / 0.25
    / 0.95 s, the same."""
    inside = np.zeros(n, dtype=bool)
    for block in blocks:
        inside[block.start : block.stop] = True
    ends = [p for block in blocks for k in range(block.copies) for p in (block.copy(k)[0], block.copy(k)[-1])]
    return sorted([*np.flatnonzero(~inside).tolist(), *ends])
