"""Layer blocks (placements2jax/inference/blocks.py): tandem repeats of the equations'
kinds and sources found exactly amid noise and never where the program does not repeat;
the reduced graph and the tiling cover every equation; and the program search seeded from
them on Llama's adamw step with 3, 4 and 8 unrolled layers predicts no more bytes and
collectives than the search alone, checked against XLA."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from models import common, llama
from models.steps import training_step

from placements2jax import DTensor, apply, check, clear_caches, init_device_mesh, predict
from placements2jax.inference import CostModel, blocks, program, use_cost_model
from placements2jax.inference.blocks import MIN_COPIES, MIN_PERIOD, Block, layer_blocks
from placements2jax.inference.program import ProgramGraph, ProgramNode

NOISE = 100  # noise kinds start here: apart from a planted block's, so that the block is found exactly


def _primitive(word: list[int]) -> bool:
    """Not a shorter word repeated (its period would be that word's)."""
    return all(word != word[:d] * (len(word) // d) for d in range(1, len(word)) if len(word) % d == 0)


@st.composite
def planted(draw: Any) -> tuple[list[int], list[tuple[int | None, ...]], Block]:
    """Noise, a block of ``copies`` copies, noise: each copy reads the copy before it (the
    first: the noise before the block), a table before the block every copy reads, its own
    equations and function inputs; the noise reads anything before it."""
    period = draw(st.integers(MIN_PERIOD, 12))
    copies = draw(st.integers(MIN_COPIES, 6))
    word = draw(st.lists(st.integers(0, 3), min_size=period, max_size=period))
    assume(_primitive(word))
    before, after = draw(st.integers(1, 15)), draw(st.integers(0, 15))
    start = before
    kinds = [NOISE + draw(st.integers(0, 5)) for _ in range(before)]
    sources: list[tuple[int | None, ...]] = [
        tuple(draw(st.one_of(st.none(), st.integers(0, i - 1))) for _ in range(draw(st.integers(0, 2)))) if i else ()
        for i in range(before)
    ]
    # per offset in a copy, its inputs: ("own", offset before it in the copy), ("prev", offset in the copy before),
    # ("table",) or ("input",)
    reads = []
    for i in range(period):
        prev = st.tuples(st.just("prev"), st.integers(0, period - 1))
        kinds_of_read = [st.just(("input",)), st.just(("table",)), prev]
        if i:
            kinds_of_read.append(st.tuples(st.just("own"), st.integers(0, i - 1)))
        reads.append(draw(st.lists(st.one_of(*kinds_of_read), max_size=3)))
    table = draw(st.integers(0, before - 1))
    entry = draw(st.integers(0, before - 1))  # what the first copy reads where the others read the copy before
    for k in range(copies):
        for i in range(period):
            here = start + k * period
            srcs: list[int | None] = []
            for read in reads[i]:
                if read[0] == "input":
                    srcs.append(None)
                elif read[0] == "table":
                    srcs.append(table)
                elif read[0] == "own":
                    srcs.append(here + read[1])
                else:
                    srcs.append(here - period + read[1] if k else entry)
            kinds.append(word[i])
            sources.append(tuple(srcs))
    for _ in range(after):
        i = len(kinds)
        kinds.append(NOISE + draw(st.integers(0, 5)))
        sources.append(tuple(draw(st.one_of(st.none(), st.integers(0, i - 1))) for _ in range(draw(st.integers(0, 2)))))
    return kinds, sources, Block(start, period, copies)


def _matches(kinds: list[int], sources: list[tuple[int | None, ...]], i: int, p: int) -> bool:
    """Equation ``i + p`` repeats equation ``i``: the same kind, and per input both a function
    input, or both the same offset back, or both ``p`` or more away (blocks.py's rule)."""
    if kinds[i] != kinds[i + p] or len(sources[i]) != len(sources[i + p]):
        return False
    for a, b in zip(sources[i], sources[i + p]):
        if (a is None) != (b is None):
            return False
        if a is not None and b is not None and i - a != i + p - b and not (abs(i - a) >= p and abs(i + p - b) >= p):
            return False
    return True


def _assert_true_repeats(kinds: list[int], sources: list[tuple[int | None, ...]], found: list[Block]) -> None:
    """Every block found repeats: its copies' kinds equal, each copy after the first repeats the
    one before equation by equation, inputs too; none overlap; in program order."""
    used = np.zeros(len(kinds), dtype=bool)
    for block in found:
        assert block.period >= MIN_PERIOD and block.copies >= MIN_COPIES
        assert not used[block.start : block.stop].any()
        used[block.start : block.stop] = True
        first = [kinds[p] for p in block.copy(0)]
        assert all([kinds[p] for p in block.copy(k)] == first for k in range(block.copies))
        assert all(_matches(kinds, sources, p, block.period) for k in range(1, block.copies - 1) for p in block.copy(k))
    assert [b.start for b in found] == sorted(b.start for b in found)


@settings(max_examples=150, deadline=None)
@given(planted())
def test_a_planted_block_is_found_exactly_amid_noise(case: Any) -> None:
    kinds, sources, block = case
    found = blocks.find_blocks(kinds, sources)
    _assert_true_repeats(kinds, sources, found)
    assert block in found, (block, found)


@settings(max_examples=150, deadline=None)
@given(planted(), st.data())
def test_never_a_false_block(case: Any, data: Any) -> None:
    """On a planted block's program with some equations' sources moved anywhere before them
    (its kinds still repeat: the sources decide)."""
    kinds, sources, _ = case
    for i in data.draw(st.lists(st.integers(1, len(kinds) - 1), max_size=6)):
        sources[i] = tuple(data.draw(st.one_of(st.none(), st.integers(0, i - 1))) for _ in sources[i])
    _assert_true_repeats(kinds, sources, blocks.find_blocks(kinds, sources))


def _blocks_by_definition(kinds: list[int], sources: list[tuple[int | None, ...]]) -> list[Block]:
    """find_blocks' result from its definition, one period and one equation at a time in
    plain Python: an input's offset is 0 for a function input or no such input (blocks.py's
    rule, which _matches states for inputs of equal number)."""
    n, width = len(kinds), max(map(len, sources), default=0)
    offsets = [[i - s if s is not None else 0 for s in srcs] + [0] * (width - len(srcs)) for i, srcs in enumerate(sources)]

    def repeats(i: int, p: int) -> bool:
        return kinds[i] == kinds[i + p] and all(
            a == b or (abs(a) >= p and abs(b) >= p) for a, b in zip(offsets[i], offsets[i + p])
        )

    found = []
    for p in range(MIN_PERIOD, n // MIN_COPIES + 1):
        a = 0
        while a < n - p:
            b = a
            while b < n - p and repeats(b, p):
                b += 1
            if b - a >= max((MIN_COPIES - 2) * p, 1):
                entry = 0  # the equations before a whose kinds repeat p later, back from a (at most p)
                while entry < min(p, a) and kinds[a - 1 - entry] == kinds[a - 1 - entry + p]:
                    entry += 1
                copies = (b + p - (a - entry)) // p
                if copies >= MIN_COPIES:
                    found.append((copies * p, p, a - entry, copies))
            a = b + 1
    found.sort(key=lambda f: (-f[0], f[1], f[2]))
    used = [False] * n
    kept = []
    for span, p, start, copies in found:
        if not any(used[start : start + span]):
            used[start : start + span] = [True] * span
            kept.append(Block(start, p, copies))
    return sorted(kept, key=lambda b: b.start)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_find_blocks_is_its_definition(data: Any) -> None:
    """Programs of a few kinds, long enough that their periods span several of find_blocks'
    batches of periods (blocks._PERIODS_AT_ONCE), some made of a repeated word: the blocks
    are those the definition finds period by period."""
    period = data.draw(st.integers(MIN_PERIOD, 3 * blocks._PERIODS_AT_ONCE))
    word = data.draw(st.lists(st.integers(0, 3), min_size=period, max_size=period))
    # per offset in the word, its inputs: how far back each reads (past the program's start: a function input)
    reads = data.draw(st.lists(st.lists(st.integers(1, 2 * period), max_size=2), min_size=period, max_size=period))
    noise = data.draw(st.lists(st.integers(0, 3), max_size=40))
    kinds = noise + word * data.draw(st.integers(1, 5)) + noise[::-1]
    sources = [tuple(i - back if back <= i else None for back in reads[i % period]) for i in range(len(kinds))]
    for i in data.draw(st.lists(st.integers(1, len(kinds) - 1), max_size=4)):  # some inputs moved anywhere before
        sources[i] = tuple(data.draw(st.integers(0, i - 1)) for _ in sources[i])
    assert blocks.find_blocks(kinds, sources) == _blocks_by_definition(kinds, sources)


def test_a_periodic_program_without_its_sources_repeating_has_no_block() -> None:
    """Kinds repeating with period 5 while each copy reads one further back than the copy
    before (a dataflow that does not repeat) is no block; reading the equation before, it is."""
    kinds = [0, 1, 2, 3, 4] * 4
    assert blocks.find_blocks(kinds, [(i - 1 - i // 5,) if i else () for i in range(len(kinds))]) == []
    assert blocks.find_blocks(kinds, [(i - 1,) if i else () for i in range(len(kinds))]) == [Block(0, 5, 4)]


def test_layer_blocks_keep_the_most_covering_number_of_copies() -> None:
    found = [Block(0, 4, 6), Block(30, 10, 3), Block(70, 10, 3)]
    assert blocks.layer_blocks(found, 100) == [Block(30, 10, 3), Block(70, 10, 3)]
    assert blocks.layer_blocks(found, 121) == []  # under half the program
    assert blocks.layer_blocks([Block(0, 30, 2)], 60) == []  # two copies: no middle to tile
    assert blocks.layer_blocks([], 10) == []


def _graph(n: int, sources: list[tuple[int | None, ...]], outputs: list[int]) -> ProgramGraph:
    nodes = [
        ProgramNode(f"e{i}", (), tuple(("in", 0) if j is None else (f"e{j}", 0) for j in srcs), ())
        for i, srcs in enumerate(sources)
    ]
    return ProgramGraph(None, nodes, tuple((f"e{o}", 0) for o in outputs), ())  # type: ignore[arg-type]


def test_a_second_stack_of_another_depth_is_found_on_the_reduced_graph() -> None:
    """Two stacks of layers, 6 copies then 3 (an encoder and a decoder of other depths):
    the layers kept are the 6 copies (covering the most); the reduced graph, where they are
    2, still has the 3-copy stack, which the search of the reduced graph finds in turn
    (:func:`.program._seeded` searches it by :func:`.program._choose`, which looks for
    blocks again); a stack reduced is never found again (2 copies: no middle to tile)."""
    encoder, decoder = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10]
    kinds = [20, 21, *encoder * 6, 22, *decoder * 3, 23]
    n = len(kinds)
    sources = [(i - 1,) if i else () for i in range(n)]
    found = blocks.find_blocks(kinds, sources)
    assert found == [Block(2, 5, 6), Block(33, 6, 3)] and layer_blocks(found, n) == [Block(2, 5, 6)]
    reduced, _ = blocks.reduce(_graph(n, sources, [n - 1]), [Block(2, 5, 6)])
    reduced_kinds = [kinds[int(node.path[1:])] for node in reduced.nodes]
    again = blocks.find_blocks(reduced_kinds, blocks.graph_sources(reduced))
    assert again == [Block(13, 6, 3)] and layer_blocks(again, len(reduced_kinds)) == again
    assert reduced_kinds[13:31] == decoder * 3
    once_more, _ = blocks.reduce(reduced, again)
    assert layer_blocks(blocks.find_blocks([kinds[int(node.path[1:])] for node in once_more.nodes],
                                           blocks.graph_sources(once_more)), len(once_more.nodes)) == []


@settings(max_examples=100, deadline=None)
@given(planted(), st.data())
def test_the_reduced_graph_and_the_tiling_cover_every_equation(case: Any, data: Any) -> None:
    """The reduced graph keeps every equation outside blocks and each block's first and last
    copy, each reading kept equations (a removed one's stand-in: the first copy's equation
    at its offset); the tiling gives every equation a choice, a middle copy its source copy's."""
    kinds, sources, block = case
    n = len(kinds)
    outputs = data.draw(st.lists(st.integers(0, n - 1), max_size=5))
    graph = _graph(n, sources, outputs)
    reduced, kept_outputs = blocks.reduce(graph, [block])
    middle = set(range(block.copy(1).start, block.copy(-1).start))
    assert [node.path for node in reduced.nodes] == [f"e{i}" for i in range(n) if i not in middle]
    kept = {node.path for node in reduced.nodes}
    for node in reduced.nodes:
        i = int(node.path[1:])
        for src, original in zip(node.sources, sources[i]):
            if original is None:
                assert src == ("in", 0)
                continue
            stand_in = original if original not in middle else block.start + (original - block.start) % block.period
            assert src == (f"e{stand_in}", 0) and src[0] in kept
    assert kept_outputs == [o for o, e in enumerate(outputs) if e not in middle]
    assert reduced.outputs == tuple((f"e{outputs[o]}", 0) for o in kept_outputs)
    paths = [f"e{i}" for i in range(n)]
    choice = {path: data.draw(st.integers(0, 9)) for path in kept}
    for copy in (0, -1):
        whole = blocks.tiled(choice, paths, [block], copy)
        assert set(whole) == set(paths)
        for i, path in enumerate(paths):
            origin = block.copy(copy).start + (i - block.start) % block.period if i in middle else i
            assert whole[path] == choice[paths[origin]]
    for source, onto in blocks.copy_moves(block):
        moved = blocks.copied(whole, paths, block, source, onto)
        for k in range(block.copies):
            want = source if k in onto else k
            assert [moved[paths[p]] for p in block.copy(k)] == [whole[paths[p]] for p in block.copy(want)]


@pytest.fixture(scope="module")
def mesh() -> Any:
    return init_device_mesh((2, 4), ("dp", "tp"))


@pytest.mark.parametrize("model", ["mlp", "gpt2", "llama"])
def test_the_default_training_steps_are_searched_as_before(mesh: Any, model: str) -> None:
    """The default training steps (the MLP, GPT-2 with scanned layers, Llama with 2) have no
    layers of 3 or more copies: no program their predict searches is seeded."""
    step = training_step(model, mesh)
    found: list[list[Block]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(program.blocks, "layer_blocks", lambda *a: found.append(layer_blocks(*a)) or found[-1])
        clear_caches()
        predict(step.fn, *step.args, out_layouts=step.out_layouts)
    clear_caches()
    assert found and not any(found)


# Llama's adamw step with unrolled layers, Megatron dp=2 x tp=4: (predicted bytes / XLA's, predicted collectives
# combined as XLA's combiner merges them) seeded from its layers, as reached at 192 B per collective; the search
# alone (at 82cd485): 0.648 in 38 / 0.632 in 45 / 0.748 in 168 at 3 / 4 / 8 layers, XLA compiles 66 / 84 / 156
# collectives. At 8 layers the search alone is not run again (8-16 s CPU). Seeded: 0.627 / 0.616 / 0.599 in 35 / 42 /
# 70; since moves of one value whose routes begin alike share their first steps (2587786): 0.617 / 0.608 / 0.595 in
# 34 / 41 / 69.
_SEEDED = {3: (0.618, 34), 4: (0.609, 41), 8: (0.596, 69)}


@pytest.mark.parametrize("layers", sorted(_SEEDED))
def test_the_seeded_search_predicts_no_more_than_the_search_alone(
    mesh: Any, layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama's adamw step with unrolled layers: the seeded prediction sends no more bytes in
    no more collectives than the search alone (layers never found), no more bytes than
    eager dispatch (the bound of every result), and checked against XLA's compile its
    outputs agree and its bytes and collectives are as reached. The seeded search's
    mechanics: at the 192 B per collective its schedule was tuned at
    (``CostModel(collective_overhead=192)``, the default until stop 39)."""
    with use_cost_model(CostModel(collective_overhead=192)):
        step = training_step("llama", mesh, layers=layers)
        clear_caches()
        seeded = predict(step.fn, *step.args, out_layouts=step.out_layouts)
        assert seeded.nbytes <= predict(step.fn, *step.args, out_layouts=step.out_layouts, search="eager").nbytes
        report = check(step.fn, *step.args, out_layouts=step.out_layouts)
        assert all(o.verdict in ("equal", "xla reduced partial") for o in report.outputs)
        ratio, collectives = _SEEDED[layers]
        assert 0.5 <= float(report.prediction.lowered_nbytes / report.compiled_bytes) <= ratio
        assert len(report.predicted_combined) <= collectives
        if layers < 8:
            with monkeypatch.context() as patch:
                patch.setattr(program.blocks, "layer_blocks", lambda found, n: [])
                clear_caches()
                alone = predict(step.fn, *step.args, out_layouts=step.out_layouts)
            clear_caches()
            assert seeded.nbytes <= alone.nbytes and seeded.lowered_nbytes <= alone.lowered_nbytes
            assert sum(seeded.collectives.values()) <= sum(alone.collectives.values())
            assert sum(seeded.combined_counts.values()) <= sum(alone.combined_counts.values())


def test_the_seeded_choice_computes_the_gradients(mesh: Any) -> None:
    """Llama's value_and_grad with 3 unrolled layers, whose layers are found: its seeded
    prediction executed as predicted (apply, execute="pinned") gives plain jax.jit's loss
    and gradients, in the predicted layouts. (Not the adamw step: Adam divides a near-zero
    gradient by its own magnitude, so partial sums added in another order move an update
    by a hundredth of the learning rate.)"""
    fn, args, out_layouts = common.checked_programs(llama, llama.Config(layers=3), mesh)["value_and_grad"]
    found = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(program.blocks, "layer_blocks", lambda *a: found.append(layer_blocks(*a)) or found[-1])
        clear_caches()
        prediction = predict(fn, *args, out_layouts=out_layouts)
    assert any(layers and all(block.copies == 3 for block in layers) for layers in found)
    pinned = jax.jit(lambda *a: apply(fn, *a, out_layouts=out_layouts, execute="pinned"))
    want = jax.block_until_ready(jax.tree.leaves(jax.jit(fn)(*common.plain(args))))
    got = jax.tree.leaves(pinned(*args), is_leaf=lambda x: isinstance(x, DTensor))
    jax.block_until_ready([x.to_jax() for x in got])
    assert [x.layout for x in got] == list(prediction.out_layouts)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g.full_tensor()), np.asarray(w), rtol=2e-5, atol=2e-6)
