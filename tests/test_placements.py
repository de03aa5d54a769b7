"""Placements: value semantics, reduce ops, and the short text form both ways."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements2jax import (
    ArgumentTypeError,
    Partial,
    Placement,
    PlacementError,
    Replicate,
    Shard,
    format_placements,
    parse_placement,
    parse_placements,
)
from placements2jax.placements import REDUCE_OPS, format_alias, parse_alias, parse_placements_or_alias

# -- value semantics -----------------------------------------------------------------


def test_exact_reprs() -> None:
    assert repr(Shard(0)) == "Shard(dim=0)"
    assert repr(Shard(-1)) == "Shard(dim=-1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(reduce_op='sum')"
    assert repr(Partial("max")) == "Partial(reduce_op='max')"


def test_equality_is_by_value() -> None:
    assert Shard(0) == Shard(0)
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum")
    assert Partial("sum") != Partial("avg")
    assert Shard(0) != Replicate()
    assert Replicate() != Partial()
    assert Shard(0) != 0


def test_hash_is_by_value() -> None:
    assert hash(Shard(1)) == hash(Shard(1))
    assert hash(Partial()) == hash(Partial("sum"))
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum"), Partial("max")}) == 4
    assert {(Shard(0), Replicate()): "dp"}[(Shard(0), Replicate())] == "dp"


@pytest.mark.parametrize(
    ("placement", "field", "value"),
    [(Shard(0), "dim", 1), (Partial("sum"), "reduce_op", "max")],
)
def test_placements_are_immutable(placement: Placement, field: str, value: object) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(placement, field, value)


def test_replicate_has_no_state() -> None:
    with pytest.raises((AttributeError, TypeError)):
        Replicate().extra = 1  # type: ignore[attr-defined]


def test_kind_predicates() -> None:
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert not Shard(1).is_replicate() and not Shard(1).is_partial()
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("max").is_partial() and Partial("max").is_partial("max")
    assert not Partial("max").is_partial("sum") and not Partial("max").is_shard()


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_all_four_reduce_ops(op: str) -> None:
    partial = Partial(op)  # type: ignore[arg-type]
    assert partial.reduce_op == op
    assert partial.is_partial(op)


def test_reduce_ops_listed_in_order() -> None:
    assert REDUCE_OPS == ("sum", "avg", "max", "min")
    assert Partial().reduce_op == "sum"


@pytest.mark.parametrize("op", ["prod", "SUM", "", "mean"])
def test_bad_reduce_op(op: str) -> None:
    with pytest.raises(PlacementError, match=r"Partial\.reduce_op=.*unknown reduce op; supported: sum, avg, max, min") as info:
        Partial(op)  # type: ignore[arg-type]
    assert "Fix: use Partial('sum'), Partial('avg'), Partial('max') or Partial('min')" in str(info.value)


@pytest.mark.parametrize("dim", ["0", 1.0, None, True])
def test_shard_dim_must_be_int(dim: object) -> None:
    with pytest.raises(ArgumentTypeError, match=r"Shard\.dim=.*must be an int\. Fix: pass e\.g\. Shard\(0\)"):
        Shard(dim)  # type: ignore[arg-type]


# -- short text form ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "text"),
    [
        (Shard(0), "S(0)"),
        (Shard(3), "S(3)"),
        (Shard(-1), "S(-1)"),
        (Replicate(), "R"),
        (Partial(), "P"),
        (Partial("sum"), "P"),
        (Partial("avg"), "P(avg)"),
        (Partial("max"), "P(max)"),
        (Partial("min"), "P(min)"),
    ],
)
def test_short_form_both_ways(placement: Placement, text: str) -> None:
    assert str(placement) == text
    assert parse_placement(text) == placement


@pytest.mark.parametrize(
    ("text", "placement"),
    [
        ("P(sum)", Partial("sum")),
        (" S( -2 ) ", Shard(-2)),
        ("s(1)", Shard(1)),
        ("r", Replicate()),
        ("p(MAX)", Partial("max")),
    ],
)
def test_parse_accepts_spacing_case_and_explicit_sum(text: str, placement: Placement) -> None:
    assert parse_placement(text) == placement


def test_lists_both_ways() -> None:
    assert parse_placements("S(0),R") == (Shard(0), Replicate())
    assert parse_placements("P(max), S(1)") == (Partial("max"), Shard(1))
    assert parse_placements("R") == (Replicate(),)
    assert parse_placements("S(-1), P, R") == (Shard(-1), Partial(), Replicate())
    assert format_placements((Shard(0), Replicate())) == "S(0),R"
    assert format_placements((Partial("max"), Shard(1), Partial())) == "P(max),S(1),P"
    assert format_placements([]) == ""


@pytest.mark.parametrize("text", ["", "S", "S(x)", "S()", "Q", "Shard(0)", "S(0)R", "P[max]", "S(0))"])
def test_parse_placement_errors(text: str) -> None:
    with pytest.raises(PlacementError, match=r"placement=.*: not a placement in short form\. Fix: write S\(<dim>\), R, P or P\("):
        parse_placement(text)


def test_parse_placement_unknown_reduce_op_names_it() -> None:
    with pytest.raises(PlacementError, match=r"Partial\.reduce_op='prod': unknown reduce op"):
        parse_placement("P(prod)")


@pytest.mark.parametrize("text", ["", " ", ",", "S(0),,R", "R,", ",R"])
def test_parse_placements_rejects_empty_items(text: str) -> None:
    with pytest.raises(PlacementError, match=r"placements=.*: not a comma-separated list of placements\. Fix: write e\.g\. \"S\(0\),R\""):
        parse_placements(text)


@pytest.mark.parametrize("text", ["S(0)R", "S(0) R", "S(0),Q"])
def test_parse_placements_rejects_bad_items(text: str) -> None:
    with pytest.raises(PlacementError, match=r"placement=.*: not a placement in short form"):
        parse_placements(text)


@pytest.mark.parametrize("func", [parse_placement, parse_placements])
def test_parse_needs_a_string(func: object) -> None:
    with pytest.raises(ArgumentTypeError, match=r"=\(Shard\(dim=0\),\): expected a string\. Fix: pass e\.g\."):
        func((Shard(0),))  # type: ignore[operator]


placements_strategy = st.one_of(
    st.builds(Shard, st.integers(-8, 8)),
    st.just(Replicate()),
    st.builds(Partial, st.sampled_from(REDUCE_OPS)),
)


@given(placements_strategy)
def test_round_trip_one(placement: Placement) -> None:
    assert parse_placement(str(placement)) == placement


@given(st.lists(placements_strategy, min_size=1, max_size=6))
def test_round_trip_format_parse(placements: list[Placement]) -> None:
    text = format_placements(placements)
    assert parse_placements(text) == tuple(placements)
    assert format_placements(parse_placements(text)) == text
    assert parse_placements(text.replace(",", " , ")) == tuple(placements)


# -- the alias form's text syntax ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "entries"),
    [
        ("(dp,tp),None", (("dp", "tp"), "None")),
        (" dp , None ", ("dp", "None")),
        ("( tp , dp ),cp", (("tp", "dp"), "cp")),
        ("None", ("None",)),
    ],
)
def test_parse_alias(text: str, entries: tuple) -> None:
    assert parse_alias(text) == entries
    assert parse_alias(format_alias(entries)) == entries


@pytest.mark.parametrize("text", ["", "dp,", "dp,,tp", "(dp,tp", "()", "S(0),R", "d p"])
def test_parse_alias_rejects(text: str) -> None:
    with pytest.raises(PlacementError, match="placements="):
        parse_alias(text)


def test_parse_placements_or_alias() -> None:
    assert parse_placements_or_alias("S(0),R") == (Shard(0), Replicate())
    assert parse_placements_or_alias("(dp,tp),None") == (("dp", "tp"), "None")
    assert format_alias([None, "dp", ("tp", "cp")]) == "None,dp,(tp,cp)"
    with pytest.raises(PlacementError, match="placement='X': not a placement in short form"):
        parse_placements_or_alias("S(0),X")
    with pytest.raises(PlacementError, match="not the alias form"):
        parse_placements_or_alias("dp,,tp")
