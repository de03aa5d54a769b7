"""The command line: explain (text and JSON), help, one-line errors with exit code 2."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from placements2jax.__main__ import main

EXPLAIN_8x2 = ["explain", "--mesh", "dp=4,tp=2", "--shape", "8,2"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *EXPLAIN_8x2, "--placements", "S(0),R", "--no-color")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:7] == [
        "mesh           dp=4 x tp=2, ranks [[0, 1], [2, 3], [4, 5], [6, 7]]",
        "tensor shape   (8, 2)",
        "placements     S(0),R",
        "alias form     dp,None",
        "tensor_map     (1, -1)   partial (None, None)",
        "PartitionSpec  P('dp', None)",
        "even           yes",
    ]
    assert lines[8] == "rank  coordinate  local shape  offset  block"
    assert lines[9] == "0     (0, 0)      (2, 2)       (0, 0)  [0:2, 0:2]"
    assert lines[16] == "7     (3, 1)      (2, 2)       (6, 0)  [6:8, 0:2]"
    assert lines[18] == "S(0),R on mesh dp=4 x tp=2, tensor (8, 2)"
    assert "6:8 │ 6,7 │" in out


def test_explain_alias_form_uneven(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "--mesh", "dp=4,tp=2", "--shape", "10,3", "--placements", "(tp,dp),None")
    assert code == 0
    assert "placements     _S(0, 2),S(0)" in out  # torch's _StridedShard encoding of the order
    assert "tensor_map     ((0, 1), -1)   partial (None, None)" in out
    assert "PartitionSpec  P(('tp', 'dp'), None)" in out
    assert "even           no (padded physical shape (16, 3))" in out
    assert "1     (0, 1)      (2, 3)       (5, 0)   [5:7, 0:3]" in out
    assert "7     (3, 1)      (0, 3)       (10, 0)  [10:10, 0:3] (empty)" in out
    assert "empty: ranks 6,7 hold no elements" in out


def test_explain_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "--mesh", "dp=4,tp=2", "--shape", "10", "--placements", "(dp,tp)", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["mesh"] == {"axis_names": ["dp", "tp"], "shape": [4, 2], "ranks": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert report["placements"] == "S(0),S(0)"
    assert report["alias"] == "(dp,tp)"
    assert report["tensor_map"] == [[1, 0]]
    assert report["partition_spec"] == {"entries": [["dp", "tp"]], "unreduced": []}
    assert report["even"] is False
    assert report["physical_shape"] == [16]
    # torch's nested rule: 10 -> 3,3,3,1 over dp, then each over tp.
    assert [(r["local_shape"][0], r["offset"][0]) for r in report["ranks"]] == [
        (2, 0), (1, 2), (2, 3), (1, 5), (2, 6), (1, 8), (1, 9), (0, 10),
    ]  # fmt: skip
    # the torch form's repeated Shard says the same layout, as torch's does
    code, torch_form, _ = run(capsys, "explain", "--mesh", "dp=4,tp=2", "--shape", "10", "--placements", "S(0),S(0)", "--json")
    assert code == 0 and json.loads(torch_form) == report


def test_explain_partial(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "explain", "--mesh", "dp=2,tp=4", "--shape", "8", "--placements", "tp", "--partial", "dp=max", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["placements"] == "P(max),S(0)"
    assert report["partial"] == ["max", None]
    _, out, _ = run(capsys, *EXPLAIN_8x2, "--placements", "P,S(0)", "--json")
    assert json.loads(out)["partition_spec"]["unreduced"] == ["dp"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*EXPLAIN_8x2, "--placements", "S(0),X"], "placement='X': not a placement in short form"),
        ([*EXPLAIN_8x2, "--placements", "S(0)"], "1 placements for a 2-d mesh"),
        ([*EXPLAIN_8x2, "--placements", "(dp,xx),None"], "unknown mesh axis 'xx'"),
        ([*EXPLAIN_8x2, "--placements", "S(0),R", "--partial", "tp"], "the torch form states partials itself"),
        (["explain", "--mesh", "dp=4,tp=4", "--shape", "8", "--placements", "S(0),R"], "needs 16 devices"),
        (["explain", "--mesh", "dp=4,tp2", "--shape", "8", "--placements", "R,R"], "--mesh 'dp=4,tp2'"),
        (["explain", "--mesh", "dp=4", "--shape", "8,x", "--placements", "R"], "--shape '8,x'"),
        (["explain", "--mesh", "dp=4", "--shape", "8", "--placements", "dp", "--partial", "dp=prod"], "--partial"),
        (["explain", "--mesh", "dp=4", "--shape", "8"], "the following arguments are required: --placements"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own checks exit
        code = exit_info.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("command", [[], ["explain"], ["demo"]])
def test_help(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: placements2jax {' '.join(command)}".rstrip())


def test_python_m_placements2jax_explain() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "placements2jax", "explain", "--mesh", "dp=4,tp=2", "--shape", "8,2",
         "--placements", "(dp,tp),None"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tensor_map     ((1, 0), -1)   partial (None, None)" in result.stdout
    assert "7     (3, 1)      (1, 2)       (7, 0)  [7:8, 0:2]" in result.stdout
    assert "\x1b[" not in result.stdout  # not a terminal: plain text


# -- redistribute ---------------------------------------------------------------------------

REDISTRIBUTE_8x2 = ["redistribute", "--mesh", "dp=4,tp=2", "--shape", "8,2"]


def test_redistribute_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "R,S(0)")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:4] == [
        "mesh     dp=4 x tp=2, ranks [[0, 1], [2, 3], [4, 5], [6, 7]]",
        "tensor   float32[8, 2]",
        "from     S(0),R   alias dp,None   PartitionSpec P('dp', None)",
        "to       R,S(0)   alias tp,None   PartitionSpec P('tp', None)",
    ]
    assert lines[5] == (
        "planned by placements2jax (its cost model's route, before XLA): 3 step(s), 40 B sent per device, cost 40"
    )
    # tp takes its columns locally, dp gathers, an all-to-all moves the tp split to the rows; moving the dp split to
    # the columns first (2 over 4 ranks, padded to 4: 24 B) would cost 48 B
    assert [line.split(" | ")[1:5] for line in lines[8:11]] == [
        ["tp       ", "R   ", "S(1)", "local-slice"],
        ["dp       ", "S(0)", "R   ", "all-gather "],
        ["tp       ", "S(1)", "S(0)", "all-to-all "],
    ]
    assert "compiled by XLA (what runs, read from the compiled HLO): " in out
    assert "all-gather" in out.split("compiled by XLA")[1]


def test_redistribute_explains_each_difference_from_the_hlo(capsys: pytest.CaptureFixture[str]) -> None:
    """P,R -> S(0),R in bf16 on CPU: XLA's reshard is one f32 all-reduce where the plan has a
    bf16 reduce-scatter and a tp gather; each difference gets its sentence, with its figures."""
    code, out, _ = run(capsys, *REDISTRIBUTE_8x2, "--from", "P,R", "--to", "S(0),R", "--dtype", "bfloat16", "--json")
    assert code == 0
    report = json.loads(out)
    (collective,) = report["compiled"]["collectives"]
    assert (collective["op"], collective["dtype"], collective["bytes"]) == ("all-reduce", "f32", 96)
    assert report["differences"] == [
        "what runs is schedule xla (policy cost): XLA's own single reshard of the whole move, not the planned steps",
        "planned reduce-scatter on dp (12 B) runs as #0 all-reduce on dp (96 B): XLA on cpu compiled no "
        "reduce-scatter, so every device reduces the whole block and keeps its slice",
        "the tensor is bf16 but XLA on cpu communicates f32 (it computes bf16 in f32 here), so the compiled bytes "
        "are of the wider type",
        "no compiled collective does planned all-gather on tp (4 B): XLA fused it with the other steps",
        "so each device sends 96 B compiled vs 16 B planned",
    ]
    code, out, _ = run(capsys, *REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "R,S(0)")
    assert out.split("why they differ:\n")[1].splitlines()[1:] == [
        "  - XLA replaced planned all-to-all on tp (16 B) by #0 collective-permute on dp,tp (16 B)",
        "  - so each device sends 32 B compiled vs 40 B planned",
    ]
    code, out, _ = run(capsys, *REDISTRIBUTE_8x2, "--from", "P,S(0)", "--to", "R,R")
    assert out.rstrip().endswith("compiled = planned: the same collectives on the same mesh axes, the same bytes")


def test_redistribute_json_matches_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    from placements2jax import distribute_tensor, init_device_mesh, plan_redistribute, redistribute_collectives

    code, out, _ = run(
        capsys, "redistribute", "--mesh", "dp=2,tp=4", "--shape", "10,3", "--from", "P,S(0)", "--to", "S(1),R",
        "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["from"]["placements"] == "P,S(0)"
    assert report["from"]["partition_spec"] == {"entries": ["tp", None], "unreduced": ["dp"]}
    assert report["to"]["alias"] == "None,dp"
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    plan = plan_redistribute((10, 3), np.float32, *(_bound(mesh, p) for p in ("P,S(0)", "S(1),R")))
    assert [(s["axis"], s["from"], s["to"], s["collective"]) for s in report["plan"]["steps"]] == [
        (s.axis, str(s.src), str(s.dst), s.collective) for s in plan.steps
    ]
    assert report["plan"]["bytes"] == plan.nbytes and report["plan"]["cost"] == plan.cost
    compiled = redistribute_collectives(distribute_tensor(np.zeros((10, 3), np.float32), mesh, "P,S(0)"), "S(1),R")
    assert [(c["op"], c["groups"]) for c in report["compiled"]["collectives"]] == [
        (c.op, [list(g) for g in c.groups]) for c in compiled
    ]
    assert {tuple(c["mesh_axes"]) for c in report["compiled"]["collectives"]} <= {("dp",), ("tp",)}


def _bound(mesh, placements: str):
    from placements2jax import resolve_layout

    return resolve_layout(mesh, placements, 2)


def test_redistribute_alias_form_partials_and_axis_weights(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "redistribute", "--mesh", "dp=2,tp=4", "--shape", "8", "--from", "tp", "--from-partial", "dp",
        "--to", "None", "--axis-weights", "dp=4", "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["from"]["placements"] == "P,S(0)"
    dp_steps = [s for s in report["plan"]["steps"] if s["axis"] == "dp"]
    assert dp_steps and all(s["cost"] == 4 * s["bytes"] for s in dp_steps)


def test_redistribute_nothing_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "dp,None")
    assert code == 0
    assert "before XLA): 0 step(s), 0 B sent per device, cost 0" in out
    assert "read from the compiled HLO): 0 collective(s), 0 B sent per device" in out
    assert "why they differ" not in out


def test_redistribute_over_a_size_one_mesh_dim(capsys: pytest.CaptureFixture[str]) -> None:
    """dp=1: the plan keeps its 0-byte steps on dp (a partial over one device reduced, a
    split there given up), XLA compiles nothing there, and that is no difference."""
    argv = ("redistribute", "--mesh", "dp=1,tp=8", "--shape", "16,32", "--to", "R,R", "--json")
    for source, planned in (("P,S(1)", ("all-reduce", 0)), ("S(0),S(1)", ("all-gather", 0))):
        code, out, _ = run(capsys, *argv, "--from", source)
        assert code == 0
        report = json.loads(out)
        steps = [(s["axis"], s["collective"], s["bytes"]) for s in report["plan"]["steps"]]
        assert steps == [("dp", *planned), ("tp", "all-gather", 1792)]
        assert [(c["op"], c["mesh_axes"]) for c in report["compiled"]["collectives"]] == [("all-gather", ["tp"])]
        assert report["differences"] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*REDISTRIBUTE_8x2, "--from", "S(0),X", "--to", "R,R"], "placement='X': not a placement in short form"),
        ([*REDISTRIBUTE_8x2, "--from", "S(0),R"], "the following arguments are required: --to"),
        ([*REDISTRIBUTE_8x2, "--from", "S(0)", "--to", "R,R"], "1 placements for a 2-d mesh"),
        ([*REDISTRIBUTE_8x2, "--from", "S(2),R", "--to", "R,R"], "out of range for a 2-d tensor"),
        ([*REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "P,R"], "--to='P,R': mesh dim 'dp' goes from Shard(0)"),
        ([*REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "R,R", "--dtype", "floot"], "--dtype 'floot'"),
        ([*REDISTRIBUTE_8x2, "--from", "R,R", "--to", "R,R", "--axis-weights", "dp=0"], "--axis-weights 'dp=0'"),
        ([*REDISTRIBUTE_8x2, "--from", "R,R", "--to", "P,R", "--to-partial", "dp"], "states partials itself"),
        (["redistribute", "--mesh", "dp=4,tp=4", "--shape", "8", "--from", "R,R", "--to", "R,R"], "needs 16 devices"),
        (["demo", "--steps", "0"], "argument --steps: '0': write a positive integer"),
    ],
)
def test_redistribute_and_demo_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    test_bad_arguments_give_one_line_and_exit_code_2(capsys, argv, message)


def test_redistribute_help(capsys: pytest.CaptureFixture[str]) -> None:
    test_help(capsys, ["redistribute"])


def test_python_m_placements2jax_demo() -> None:
    """The CLI path of the demos: JAX simulates 8 CPU devices by itself (no XLA_FLAGS)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "placements2jax", "demo", "--steps", "2"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "mesh dp=2 x tp=4 (8 cpu devices)" in result.stdout
    assert "loss went down" in result.stdout
    assert "XLA compiled every updated parameter in its planned layout" in result.stdout
    assert "bytes per device agree" in result.stdout


# -- every argument: one line and exit code 2, never a traceback --------------------------------

def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import placements2jax

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"placements2jax {placements2jax.__version__}\n"


def test_dtype_jax_cannot_hold_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    test_bad_arguments_give_one_line_and_exit_code_2(
        capsys, [*REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "R,R", "--dtype", "float128"], "--dtype 'float128'"
    )


def test_unknown_axis_in_axis_weights_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    test_bad_arguments_give_one_line_and_exit_code_2(
        capsys,
        [*REDISTRIBUTE_8x2, "--from", "S(0),R", "--to", "R,R", "--axis-weights", "dp=2,pp=4"],
        "--axis-weights='dp=2,pp=4': mesh dp=4 x tp=2 has no axis 'pp'. Fix: weigh its axes dp, tp",
    )


LAYOUTS = ["S(0),R", "R,S(0)", "P,S(1)", "P(max),R", "(dp,tp),None", "tp,dp", "None", "S(5),R", "R", "dp", "(tp,dp)"]
VALUES: dict[str, list[str]] = {
    "--mesh": ["dp=4,tp=2", "dp=2,tp=4", "8", "dp=2", "dp=4,tp=4", "dp=0", "dp=4,dp=2", "2,2,2"],
    "--shape": ["8,2", "10,3", "8", "0,3", "3,5,7", "", "-1", "2,0"],
    "--placements": LAYOUTS,
    "--from": LAYOUTS,
    "--to": LAYOUTS,
    "--partial": ["tp", "dp=max", "tp=prod", "xx", "dp=avg,tp=min"],
    "--from-partial": ["tp", "dp=max", "xx"],
    "--to-partial": ["tp", "dp=min", "xx"],
    "--dtype": ["float32", "bfloat16", "int8", "bool", "complex64", "float128", "str", "float64", "uint4"],
    "--axis-weights": ["dp=4", "pp=4", "tp=0", "dp=1.5,tp=2", "dp"],
    "--policy": ["cost", "min_bytes", "xla", "fast"],
    "--checkpoint": ["/nonexistent/ckpt", "."],
    "--step": ["1", "x", "-3"],
    "--steps": ["2", "0", "x", "1e3"],
}
FLAGS = {"explain": ["--json", "--color", "--no-color"], "redistribute": ["--json"], "demo": [], "train": []}
OPTIONS = {
    "explain": ["--mesh", "--shape", "--placements", "--partial", "--checkpoint", "--step"],
    "redistribute": ["--mesh", "--shape", "--from", "--to", "--from-partial", "--to-partial", "--dtype",
                     "--axis-weights", "--policy"],
    "demo": ["--steps"],
    "train": [],
}  # fmt: skip
REQUIRED = {"explain": ("--mesh", "--shape", "--placements"), "redistribute": ("--mesh", "--shape", "--from", "--to")}


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    """A command with a random subset of its options (valid, invalid or arbitrary values),
    its flags, and now and then an unknown option or a stray word."""
    command = draw(st.sampled_from([*OPTIONS, "nonsense", "--version"]))
    argv = [command]
    options = draw(st.lists(st.sampled_from(OPTIONS.get(command) or ["--mesh"]), unique=True))
    if draw(st.integers(0, 3)):  # mostly a complete command, so that most examples run it
        options = [*REQUIRED.get(command, ()), *(o for o in options if o not in REQUIRED.get(command, ()))]
    for option in options:
        known = VALUES[option]
        # arbitrary text only where a value cannot make a huge tensor (shapes and meshes stay small)
        arbitrary = st.text(max_size=12) if option not in ("--shape", "--mesh") else st.sampled_from(known)
        argv += [option, draw(st.one_of(st.sampled_from(known), arbitrary))]
    argv += draw(st.lists(st.sampled_from(FLAGS.get(command) or ["--json"]), max_size=2))
    argv += draw(st.lists(st.sampled_from(["--bogus", "extra", "--help"]), max_size=1))
    return argv


@given(argv=command_lines())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_fuzzed_arguments_exit_0_or_2_with_one_line(argv: list[str]) -> None:
    """Every command's arguments, fuzzed, run in-process through the CLI's main: exit 0,
    or exit 2 with exactly one line on stderr; never a traceback. The demo and the training
    run are stubbed (their parsing is what is fuzzed; tests above run them for real)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr("placements2jax.demo.main", lambda steps=None: print("demo", steps))
        patch.setattr("placements2jax.train_demo.main", lambda: print("train"))
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse's own checks, --help and --version exit
            code = exit_info.code
    assert code in (0, 2), (argv, code, err.getvalue())
    event(f"exit {code}")
    if code == 2:
        assert out.getvalue() == "" and err.getvalue().count("\n") == 1, (argv, err.getvalue())
        assert err.getvalue().startswith("placements2jax"), (argv, err.getvalue())
    else:
        assert err.getvalue() == "", (argv, err.getvalue())


PLAN = ["plan", "placements2jax.autoplan:example_mlp", "--mesh", "dp=2,tp=4", "--fixed", "args/1=S(0),R",
        "--fixed", "args/2=S(0),R", "--max-evaluations", "6", "--score", "predict"]


def test_plan_prints_the_plan_and_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    from placements2jax import auto_plan, init_device_mesh
    from placements2jax.autoplan import example_mlp

    assert main([*PLAN, "--preset", "tp=placements2jax.autoplan:example_mlp_tp_plan"]) == 2
    assert "no function 'example_mlp_tp_plan'" in capsys.readouterr().err
    assert main(PLAN) == 0
    text = capsys.readouterr().out
    chosen = auto_plan(*example_mlp(), mesh=init_device_mesh((2, 4), ("dp", "tp")),
                       fixed={"args/1": "S(0),R", "args/2": "S(0),R"}, max_evaluations=6, score="predict")
    assert text.rstrip() == str(chosen)
    assert main([*PLAN, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"] == chosen.torch_form() and report["args"]["args/1"] == "S(0),R"
    assert report["figures"]["auto"]["nbytes"] == chosen.figures.nbytes
    assert set(report["figures"]) == {"auto", "fsdp"}
    assert report["score"] == "predict" and report["compiled"] == {}
    assert main([*PLAN[:-2], "--json"]) == 0  # score="xla", the default: the finalists compiled
    report = json.loads(capsys.readouterr().out)
    assert report["score"] == "xla" and set(report["compiled"]) == {"auto", "fsdp"}
    assert report["compiled"]["auto"]["nbytes"] <= report["compiled"]["fsdp"]["nbytes"]
    # the memory checked against a budget: the larger of the estimate and XLA's memory_analysis()
    assert report["memory"] == max(report["figures"]["auto"]["memory"], report["compiled"]["auto"]["memory"])
    assert report["memory_source"] == ("XLA" if report["memory"] > report["figures"]["auto"]["memory"] else "estimate")
