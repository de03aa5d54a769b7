"""Pictures of layouts: exact text for 1-D, 2-D and 3-D meshes, uneven, empty and partial
blocks; colours; the matplotlib figure."""

import io
import re
import sys
from types import SimpleNamespace

import pytest

from placements2jax import DeviceMesh, Layout, init_device_mesh, resolve_layout
from placements2jax.errors import ArgumentTypeError, ShapeError
from placements2jax import checkpoint
from placements2jax.visualize import format_ranks, layout_blocks, plot, print_layout, visualize


def picture(mesh_shape, names, placements, shape, **kwargs) -> str:
    return visualize(Layout.from_device_mesh(init_device_mesh(mesh_shape, names))(placements), shape, **kwargs)


def test_2d_mesh_2d_tensor() -> None:
    assert picture((4, 2), ("dp", "tp"), "S(0),S(1)", (8, 2), color=False) == "\n".join(
        [
            "S(0),S(1) on mesh dp=4 x tp=2, tensor (8, 2)",
            "      0:1   1:2",
            "    ┌─────┬─────┐",
            "0:2 │  0  │  1  │",
            "    ├─────┼─────┤",
            "2:4 │  2  │  3  │",
            "    ├─────┼─────┤",
            "4:6 │  4  │  5  │",
            "    ├─────┼─────┤",
            "6:8 │  6  │  7  │",
            "    └─────┴─────┘",
        ]
    )


def test_1d_mesh_uneven_1d_tensor() -> None:
    assert picture((4,), ("x",), "S(0)", (10,), color=False) == "\n".join(
        [
            "S(0) on mesh x=4, tensor (10,)",
            "  0:3   3:6   6:9   9:10",
            "┌─────┬─────┬─────┬──────┐",
            "│  0  │  1  │  2  │  3   │",
            "└─────┴─────┴─────┴──────┘",
            "uneven: dim 0 (10) split 4 ways into blocks of [3, 3, 3, 1]",
        ]
    )


def test_3d_mesh_partial_max() -> None:
    assert picture((2, 2, 2), ("a", "b", "c"), "S(0),P(max),S(1)", (6, 4), color=False) == "\n".join(
        [
            "S(0),P(max),S(1) on mesh a=2 x b=2 x c=2, tensor (6, 4)",
            "         0:2          2:4",
            "    ┌────────────┬────────────┐",
            "0:3 │ P(max) 0,2 │ P(max) 1,3 │",
            "    ├────────────┼────────────┤",
            "3:6 │ P(max) 4,6 │ P(max) 5,7 │",
            "    └────────────┴────────────┘",
            "partial: ranks hold P(max) values; the tensor is their max over mesh dim b",
        ]
    )


def test_partial_sum_lists_the_ranks_holding_partial_values() -> None:
    text = picture((4, 2), ("dp", "tp"), "P,S(0)", (8, 2), color=False)
    assert "0:4 │ P(sum) 0,2,4,6 │" in text
    assert "4:8 │ P(sum) 1,3,5,7 │" in text
    assert text.endswith("partial: ranks hold P(sum) values; the tensor is their sum over mesh dim dp")


def test_split_out_of_mesh_order_with_empty_blocks() -> None:
    assert picture((4, 2), ("dp", "tp"), [("tp", "dp"), None], (10, 3), color=False) == "\n".join(
        [
            "(tp,dp),None on mesh dp=4 x tp=2, tensor (10, 3)",
            "       0:3",
            "     ┌─────┐",
            " 0:2 │  0  │",
            "     ├─────┤",
            " 2:4 │  2  │",
            "     ├─────┤",
            " 4:5 │  4  │",
            "     ├─────┤",
            " 5:7 │  1  │",
            "     ├─────┤",
            " 7:9 │  3  │",
            "     ├─────┤",
            "9:10 │  5  │",
            "     └─────┘",
            "uneven: dim 0 (10) split 2x4 ways into blocks of [2, 2, 1, 0, 2, 2, 1, 0]",
            "empty: ranks 6,7 hold no elements",
        ]
    )


def test_permuted_ranks_are_shown_and_replicas_grouped() -> None:
    layout = Layout.from_device_mesh(DeviceMesh([[3, 1], [0, 2]], ("x", "y")))("R,S(1)")
    assert visualize(layout, (3, 3), color=False) == "\n".join(
        [
            "R,S(1) on mesh x=2 x y=2, tensor (3, 3), ranks [[3, 1], [0, 2]]",
            "      0:2   2:3",
            "    ┌─────┬─────┐",
            "0:3 │ 0,3 │ 1,2 │",
            "    └─────┴─────┘",
            "uneven: dim 1 (3) split 2 ways into blocks of [2, 1]",
        ]
    )


def test_everything_empty() -> None:
    text = picture((2,), ("x",), "S(0)", (0, 3), color=False)
    assert text.splitlines()[1:] == ["(no elements: every block is empty)", "empty: ranks 0,1 hold no elements"]


def test_blocks_tile_the_tensor_on_every_layout_of_a_3d_mesh() -> None:
    from placements2jax.layout import iter_layouts

    mesh = init_device_mesh((2, 2, 2), ("a", "b", "c"))
    for layout in iter_layouts(mesh, 2):
        _, _, blocks = layout_blocks(layout, (5, 3))
        covered = sorted((r, c) for b in blocks for r in range(*b.bounds[0]) for c in range(*b.bounds[1]))
        assert covered == [(r, c) for r in range(5) for c in range(3)]
        assert sorted(r for b in blocks for r in b.ranks) == sorted(
            r for r in mesh.rank_list if all(layout.local_shape((5, 3), r))
        )


def test_dtensor_duck_typing_and_print_layout() -> None:
    layout = Layout.from_device_mesh(init_device_mesh((4, 2), ("dp", "tp")))("S(0),R")
    fake_dtensor = SimpleNamespace(layout=layout.bind(2), shape=(8, 2))
    assert visualize(fake_dtensor, color=False) == visualize(layout, (8, 2), color=False)
    out = io.StringIO()
    print_layout(fake_dtensor, color=False, file=out)
    assert out.getvalue() == visualize(layout, (8, 2), color=False) + "\n"


def test_color_uses_ansi_and_keeps_the_text() -> None:
    pytest.importorskip("rich")
    colored = picture((4, 2), ("dp", "tp"), "S(0),S(1)", (8, 2), color=True)
    assert "\x1b[" in colored
    assert re.sub(r"\x1b\[[0-9;]*m", "", colored) == picture((4, 2), ("dp", "tp"), "S(0),S(1)", (8, 2), color=False)


def test_color_auto_is_plain_when_not_a_terminal() -> None:
    # pytest captures stdout, which is then no terminal.
    assert "\x1b[" not in picture((2,), ("x",), "S(0)", (4,))


def test_bad_input() -> None:
    layout = Layout.from_device_mesh(init_device_mesh((2,), ("x",)))("S(0)")
    with pytest.raises(ArgumentTypeError, match="shape=None: a Layout does not know the tensor's shape"):
        visualize(layout)
    with pytest.raises(ShapeError, match="1-D or 2-D"):
        visualize(layout, (2, 2, 2))
    with pytest.raises(ArgumentTypeError, match="expected a Layout or a DTensor"):
        visualize("S(0)", (4,))
    with pytest.raises(ShapeError, match="not a non-negative int"):
        visualize(layout, (-1,))


def test_text_helpers() -> None:
    assert format_ranks([0, 1, 2, 3, 6]) == "0-3,6"
    assert format_ranks([0, 1, 5, 6, 7]) == "0,1,5-7"
    assert format_ranks([4]) == "4"
    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    assert str(resolve_layout(mesh, "(tp,dp),None", 2)) == "(tp,dp),None"
    assert str(resolve_layout(mesh, "S(0),R", 2)) == "S(0),R"


def test_plot_rfc_figure(tmp_path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from placements2jax.visualize import plot

    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    layouts = [Layout.from_device_mesh(mesh)(p) for p in ("S(0),R", "S(1),S(0)", "(tp,dp),None", "P,S(0)")]
    figure = plot(layouts, (8, 2))
    assert [ax.get_title() for ax in figure.axes if ax.get_title()] == [
        "S(0),R",
        "S(1),S(0)\n(empty: 4-7)",
        "(tp,dp),None",
        "P,S(0)",
    ]
    figure.savefig(tmp_path / "figure.png")
    assert (tmp_path / "figure.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("module", "extra", "call"),
    [
        ("matplotlib.pyplot", "plot", lambda layout: plot(layout, (8, 2))),
        ("rich", "rich", lambda layout: visualize(layout, (8, 2), color=True)),
        ("tensorstore", "train", lambda layout: checkpoint._tensorstore()),
    ],
)
def test_a_missing_extra_is_named_with_its_pip_command(module: str, extra: str, call) -> None:
    from placements2jax.errors import MissingDependencyError

    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    layout = Layout.from_device_mesh(mesh)("S(0),R")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, module, None)  # an import of it now fails as if it were not installed
        with pytest.raises(MissingDependencyError, match=re.escape(f"Fix: pip install 'placements2jax[{extra}]'")):
            call(layout)


def test_plot_draws_replicas_as_one_block_with_ranges_and_notes() -> None:
    """The figure's artists: a replicated block is one rectangle (not a stripe per rank),
    the blocks' row / column ranges label the borders, and the partial, empty and
    replicated facts are marked as the terminal picture marks them."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mesh = init_device_mesh((4, 2), ("dp", "tp"))
    layouts = [Layout.from_device_mesh(mesh)(p) for p in ("S(0),R", "S(1),S(0)", "P,S(0)")]
    figure = plot(layouts, (8, 2))
    replicated, empty, partial = figure.axes[:3]
    # S(0),R: four full-width blocks, each one rectangle held by a tp pair, one colour per pair
    rectangles = [(p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in replicated.patches]
    assert rectangles == [(0, 0, 2, 2), (0, 2, 2, 2), (0, 4, 2, 2), (0, 6, 2, 2)]
    assert len({p.get_facecolor() for p in replicated.patches}) == 4
    texts = [t.get_text() for t in replicated.texts]
    assert texts[:4] == ["0,1", "2,3", "4,5", "6,7"]
    assert {"0:2", "2:4", "4:6", "6:8"} <= set(texts)  # row ranges; "0:2" is also the one column range
    assert "replicated over tp: each block held by 2\nranks" in texts
    # S(1),S(0) on (8, 2): dim 1 in 4 pieces, ranks 4-7 empty
    texts = [t.get_text() for t in empty.texts]
    assert {"0:1", "1:2", "0:4", "4:8"} <= set(texts)
    assert any("empty: ranks 4-7 hold no elements" in t for t in texts)
    assert empty.get_title() == "S(1),S(0)\n(empty: 4-7)"
    # P,S(0): hatched, labelled with the reduce op, noted
    assert all(p.get_hatch() == "//" for p in partial.patches)
    texts = [t.get_text() for t in partial.texts]
    assert texts[:2] == ["P(sum)\n0,2,4,6", "P(sum)\n1,3,5,7"]
    assert any(t.startswith("partial: ranks hold P(sum) values") for t in texts)
    plt.close(figure)
