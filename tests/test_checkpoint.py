"""Checkpoints that reshard: round trips across meshes and layouts (hypothesis), exact
values, metadata, the CLI, an interrupted save, mismatch errors, two processes x 4 devices
saving for one process x 8 and the reverse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from hypothesis import given, settings
from hypothesis import strategies as st

import placements2jax as p2j
from placements2jax import AbstractDTensor, CheckpointError, DeviceMesh, DTensor, init_device_mesh
from placements2jax.layout import iter_layouts

sys.path.insert(0, str(Path(__file__).parent))
from _checkpoint_tree import LOAD_LAYOUTS, PLAIN, PLAIN_SPECS, SAVE_LAYOUTS, VALUES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MESHES = {
    "grid": init_device_mesh((4, 2), ("dp", "tp")),
    "line": init_device_mesh((8,), ("x",)),
    "cube": init_device_mesh((2, 2, 2), ("a", "b", "c")),
    "half": DeviceMesh([[6, 4], [2, 0]], ("p", "q")),  # a sub-set of the devices, shuffled
    "sub": init_device_mesh((4, 2), ("dp", "tp"))["tp"],  # a sub-mesh of 2 devices
}
LAYOUTS = {name: iter_layouts(mesh, 2, partial_ops=("sum", "max")) for name, mesh in MESHES.items()}
X = (np.arange(11 * 7, dtype=np.float32).reshape(11, 7) * 5) % 19 - 9  # integers: partial sums are exact


def _exact(dtensor: DTensor, want: np.ndarray) -> None:
    np.testing.assert_array_equal(np.asarray(dtensor.full_tensor()), want)
    layout = dtensor.layout
    if not layout.has_partial:
        for rank, block in dtensor.local_shards().items():
            np.testing.assert_array_equal(np.asarray(block), want[layout.local_slices(want.shape, rank)])


layout_choice = st.sampled_from(sorted(MESHES)).flatmap(lambda m: st.sampled_from(LAYOUTS[m]))


@settings(max_examples=15)
@given(layout_choice, layout_choice, st.sampled_from([np.float32, np.int32, ml_dtypes.bfloat16]))
def test_round_trip_reshards_exactly(tmp_path_factory, source, target, dtype) -> None:
    path = tmp_path_factory.mktemp("ckpt")
    if dtype == np.int32 and ("avg" in source.partial or "avg" in target.partial):
        return
    x = X.astype(dtype)
    saved = p2j.distribute_tensor(x, source.mesh, source)
    p2j.save(path, {"x": saved}, step=1)
    loaded = p2j.load(path, {"x": AbstractDTensor(x.shape, x.dtype, target.mesh, target)})["x"]
    assert loaded.layout == target and loaded.dtype == x.dtype
    _exact(loaded, x)
    again = p2j.load(path, {"x": p2j.distribute_tensor(np.zeros_like(x), target.mesh, target)})["x"]
    _exact(again, x)


def test_optimizer_state_and_step_counter_round_trip(tmp_path) -> None:
    mesh = MESHES["grid"]
    params = p2j.init_pytree(
        lambda k: {"w": jax.random.normal(k, (12, 10)), "b": jnp.zeros(10)}, jax.random.key(0), mesh,
        {"w": "S(0),S(1)", "b": "R,S(0)"},
    )
    state = optax.adamw(1e-2).init(params)
    tree = {"params": params, "opt": state, "step": 7}
    p2j.save(tmp_path, tree, step=7)
    other = init_device_mesh((2, 2, 2), ("a", "b", "c"))
    target = {
        "params": {"w": AbstractDTensor((12, 10), np.float32, other, "(a,b),c"), "b": AbstractDTensor((10,), np.float32, other)},
        "opt": jax.tree.map(lambda d: AbstractDTensor(d.shape, d.dtype, other, "R,S(0),R") if d.ndim else d,
                            state, is_leaf=lambda v: isinstance(v, DTensor)),
        "step": 0,
    }
    loaded = p2j.load(tmp_path, target)
    assert loaded["step"] == 7
    _exact(loaded["params"]["w"], np.asarray(params["w"].full_tensor()))
    assert int(loaded["opt"][0].count) == 0
    assert loaded["opt"][0].mu["w"].device_mesh == other


def test_prng_keys_round_trip_as_keys(tmp_path) -> None:
    """Typed PRNG keys (optax.noisy_sgd's state holds one; a DTensor of keys, Replicate, or plain keys)
    are stored as their key data and load as keys of the same implementation, in the
    target's form: a DTensor of keys, plain keys, or keys with a ShapeDtypeStruct's sharding.
    Keys saved into a non-key target (or an array into a key target) are a CheckpointError."""
    mesh = MESHES["grid"]
    params = {"w": p2j.distribute_tensor(np.ones((4, 2), np.float32), mesh, "S(0),R")}
    state = optax.noisy_sgd(1e-3, key=jax.random.key(7)).init(params)
    state = jax.tree.map(lambda x: p2j.distribute_tensor(x, mesh) if not isinstance(x, DTensor) else x, state,
                         is_leaf=lambda v: isinstance(v, DTensor))
    rbg = jax.random.split(jax.random.key(3, impl="rbg"), 3)
    p2j.save(tmp_path, {"params": params, "state": state, "rbg": rbg}, step=1)
    assert p2j.read_metadata(tmp_path)["leaves"]["rbg"] == {"kind": "keys", "shape": [3], "dtype": "key<rbg>", "impl": "rbg"}
    replicated = jax.sharding.NamedSharding(mesh.to_jax(), P())
    loaded = p2j.load(tmp_path, {"params": params, "state": state,
                                 "rbg": jax.ShapeDtypeStruct((3,), rbg.dtype, sharding=replicated)})
    saved_keys, loaded_keys = (
        [x for x in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, DTensor)) if x.dtype == state[0].rng_key.dtype]
        for tree in (state, loaded["state"])
    )
    assert len(saved_keys) == len(loaded_keys) == 1 and isinstance(loaded_keys[0], DTensor)
    assert loaded_keys[0].layout == saved_keys[0].layout
    np.testing.assert_array_equal(jax.random.key_data(loaded_keys[0].full_tensor()),
                                  jax.random.key_data(saved_keys[0].full_tensor()))
    assert loaded["rbg"].dtype == rbg.dtype and loaded["rbg"].sharding.is_equivalent_to(replicated, 1)
    np.testing.assert_array_equal(jax.random.key_data(loaded["rbg"]), jax.random.key_data(rbg))
    np.testing.assert_array_equal(jax.random.key_data(p2j.load(tmp_path, {"rbg": rbg})["rbg"]), jax.random.key_data(rbg))
    from placements2jax.cli import explain_checkpoint

    listed = explain_checkpoint(str(tmp_path))
    assert any(line.split()[:6] == ["rbg", "|", "(3,)", "|", "key<rbg>", "|"] for line in listed.splitlines()) and "(PRNG keys, rbg)" in listed and "(PRNG keys, threefry2x32)" in listed
    with pytest.raises(CheckpointError, match="is key<rbg> keys of shape"):
        p2j.load(tmp_path, {"rbg": np.zeros(3)})


def test_array_leaves_are_written_once_and_load_with_the_target_sharding(tmp_path) -> None:
    """Non-DTensor arrays (optax's count, a sharded plain jax.Array): stored whole, loaded
    into the target's mesh sharding (jax.Array or ShapeDtypeStruct), or uncommitted."""
    grid = MESHES["grid"].to_jax()
    count = jax.device_put(jnp.int32(5), jax.sharding.NamedSharding(grid, P()))
    table = jax.device_put(jnp.arange(16.0).reshape(8, 2), jax.sharding.NamedSharding(grid, P("dp", "tp")))
    p2j.save(tmp_path, {"count": count, "table": table, "host": np.arange(3)}, step=1)
    assert [p.name for p in (tmp_path / "1" / "leaves").iterdir()].count("count") == 1
    line = jax.sharding.NamedSharding(MESHES["line"].to_jax(), P("x"))
    loaded = p2j.load(tmp_path, {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=count.sharding),
                                 "table": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=line),
                                 "host": np.zeros(3, np.int64)})
    assert int(loaded["count"]) == 5 and loaded["count"].sharding == count.sharding
    assert loaded["table"].sharding == line
    np.testing.assert_array_equal(np.asarray(loaded["table"]), np.arange(16.0).reshape(8, 2))
    for shard in loaded["table"].addressable_shards:
        assert shard.data.shape == (1, 2)
    np.testing.assert_array_equal(np.asarray(loaded["host"]), np.arange(3))
    again = p2j.load(tmp_path, {"count": jnp.int32(0), "table": table, "host": np.zeros(3, np.int64)})
    assert int(again["count"]) == 5 and again["table"].sharding == table.sharding


def test_metadata_records_mesh_and_torch_placements(tmp_path) -> None:
    mesh = MESHES["grid"]
    p2j.save(tmp_path, {"w": p2j.distribute_tensor(X, mesh, "P(max),S(1)"), "v": p2j.distribute_tensor(X, mesh, "(tp,dp),None")}, step=2)
    meta = p2j.read_metadata(tmp_path)
    assert meta["step"] == 2 and p2j.latest_step(tmp_path) == 2
    w = meta["leaves"]["w"]
    assert w["placements"] == "P(max),S(1)" and w["mesh"] == {"shape": [4, 2], "axis_names": ["dp", "tp"], "ranks": list(range(8))}
    assert w["shape"] == [11, 7] and w["dtype"] == "float32"
    assert meta["leaves"]["v"]["placements"] == "_S(0, 2),S(0)" and meta["leaves"]["v"]["alias"] == [["tp", "dp"], "None"]
    done = subprocess.run([sys.executable, "-m", "placements2jax", "explain", "--checkpoint", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "P(max),S(1)" in done.stdout and "dp=4 x tp=2" in done.stdout and "(tp,dp),None" in done.stdout, done.stdout


def test_interrupted_save_leaves_the_previous_step_loadable(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import os, signal
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, numpy as np
        import placements2jax as p2j
        from placements2jax import checkpoint
        mesh = p2j.init_device_mesh((4, 2), ("dp", "tp"))
        x = np.arange(77, dtype=np.float32).reshape(11, 7)
        tree = {{"a": p2j.distribute_tensor(x, mesh, "S(0),S(1)"), "b": p2j.distribute_tensor(x + 1, mesh, "R,S(0)")}}
        p2j.save({str(tmp_path)!r}, tree, step=1)
        original = checkpoint._save_dtensor
        def killed_midway(directory, leaf):
            if directory.name == "b":
                os.kill(os.getpid(), signal.SIGKILL)
            return original(directory, leaf)
        checkpoint._save_dtensor = killed_midway
        p2j.save({str(tmp_path)!r}, {{"a": tree["a"], "b": tree["b"]}}, step=2)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("XLA_")})
    assert done.returncode == -9, done.stderr
    assert sorted(p.name.split(".")[0] for p in tmp_path.iterdir()) == ["1", "2"]  # step 2 only partial
    assert p2j.latest_step(tmp_path) == 1
    mesh = MESHES["line"]
    x = np.arange(77, dtype=np.float32).reshape(11, 7)
    loaded = p2j.load(tmp_path, {"a": AbstractDTensor((11, 7), np.float32, mesh, "S(1)"),
                                 "b": AbstractDTensor((11, 7), np.float32, mesh, "S(0)")})
    _exact(loaded["a"], x)
    _exact(loaded["b"], x + 1)
    with pytest.raises(CheckpointError, match="no complete step 2"):
        p2j.load(tmp_path, loaded, step=2)


def test_mismatches_name_the_leaf(tmp_path) -> None:
    mesh = MESHES["grid"]
    p2j.save(tmp_path, {"w": p2j.distribute_tensor(X, mesh, "S(0),R")}, step=0)
    with pytest.raises(CheckpointError, match="'v'") as info:
        p2j.load(tmp_path, {"v": AbstractDTensor((11, 7), np.float32, mesh)})
    assert info.value.argument == "target at 'v'"
    with pytest.raises(CheckpointError, match=r"shape \(11, 7\), the target \(7, 11\)"):
        p2j.load(tmp_path, {"w": AbstractDTensor((7, 11), np.float32, mesh)})
    with pytest.raises(CheckpointError, match="dtype float32, the target int32"):
        p2j.load(tmp_path, {"w": AbstractDTensor((11, 7), np.int32, mesh)})
    chunks = [f for f in (tmp_path / "0" / "leaves" / "w").rglob("*") if f.is_file() and f.name != "zarr.json"]
    assert chunks
    for chunk in chunks:
        chunk.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="'w'"):
        p2j.load(tmp_path, {"w": AbstractDTensor((11, 7), np.float32, mesh)})


# -- two processes x 4 devices <-> one process x 8 ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _pair(mode: str, path: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    port = str(_free_port())
    worker = Path(__file__).with_name("_checkpoint_worker.py")
    processes = [subprocess.Popen([sys.executable, str(worker), str(i), port, mode, str(path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=240)
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    report = "\n".join(f"--- {i}: {code}\n{out[-2000:]}\n{err[-4000:]}" for i, (code, out, err) in enumerate(results))
    assert all(code == 0 for code, _, _ in results), report
    return [json.loads(out.strip().splitlines()[-1].removeprefix("RESULT ")) for _, out, _ in results]


def test_two_processes_save_one_process_loads(tmp_path) -> None:
    summaries = _pair("save", tmp_path)
    assert [s["checked"] for s in summaries] == [["saved"], ["saved"]]
    meta = p2j.read_metadata(tmp_path)
    assert meta["leaves"]["b"]["placements"] == "P,S(0)"
    meshes = {"grid": MESHES["grid"], "line": MESHES["line"]}
    target = {name: AbstractDTensor(VALUES[name].shape, VALUES[name].dtype, meshes[m], pl)
              for name, (m, pl) in LOAD_LAYOUTS.items()}
    for name, dtensor in p2j.load(tmp_path, target).items():
        _exact(dtensor, VALUES[name])
    assert sorted(p.name for p in (tmp_path / "3" / "leaves").iterdir()) == sorted([*VALUES, *PLAIN])
    plain = p2j.load(tmp_path, {name: np.zeros_like(v) for name, v in PLAIN.items()})
    for name, value in PLAIN.items():  # written once (by process 0), whole: the split array gathered
        np.testing.assert_array_equal(np.asarray(plain[name]), value)


def test_one_process_saves_two_processes_load(tmp_path) -> None:
    meshes = {"grid": init_device_mesh((2, 4), ("dp", "tp")), "line": MESHES["line"]}
    tree = {name: p2j.distribute_tensor(VALUES[name], meshes[m], pl) for name, (m, pl) in SAVE_LAYOUTS.items()}
    for name, value in PLAIN.items():
        tree[name] = jax.device_put(value, jax.sharding.NamedSharding(meshes["grid"].to_jax(), P(*PLAIN_SPECS[name])))
    tree["keys"] = jax.random.split(jax.random.key(5), 3)  # loaded as keys on both processes' devices
    p2j.save(tmp_path, tree, step=3)
    summaries = _pair("load", tmp_path)
    assert [sorted(s["checked"]) for s in summaries] == [sorted([*VALUES, *PLAIN, "keys"])] * 2


def test_a_strided_dtensor_round_trips(tmp_path) -> None:
    """A strided DTensor (a split factor from a view) is saved as its logical tensor (the
    devices unstride it first) and loads into a strided or a plain target, exact values
    and per-device shards; metadata has its torch placements and no alias form."""
    line, grid = MESHES["line"], MESHES["grid"]
    value = np.arange(128, dtype=np.float32).reshape(8, 16)
    strided = p2j.distribute_tensor(value, line, "S(1)").reshape(128)
    cube = np.arange(512, dtype=np.float32).reshape(4, 8, 16)
    strided2 = p2j.distribute_tensor(cube, grid, "S(1),R").reshape(32, 16)
    assert str(strided.layout) == "_S(0, 8)" and str(strided2.layout) == "_S(0, 4),R"
    p2j.save(tmp_path, {"a": strided, "b": strided2}, step=1)
    meta = p2j.read_metadata(tmp_path)["leaves"]
    assert meta["a"]["placements"] == "_S(0, 8)" and meta["a"]["alias"] is None
    same = p2j.load(tmp_path, {"a": strided, "b": strided2})
    for name, want in (("a", strided), ("b", strided2)):
        assert same[name].layout is want.layout
        np.testing.assert_array_equal(np.asarray(same[name].full_tensor()), np.asarray(want.full_tensor()))
        mine = {s.device: np.asarray(s.data) for s in same[name].array.addressable_shards}
        for s in want.array.addressable_shards:  # every device holds torch's local tensor again
            np.testing.assert_array_equal(mine[s.device], np.asarray(s.data))
    targets = {"a": AbstractDTensor((128,), jnp.float32, grid, "S(0),R"), "b": AbstractDTensor((32, 16), jnp.float32, line, "_S(0, 2)")}
    other = p2j.load(tmp_path, targets)
    _exact(other["a"], value.reshape(128))
    assert str(other["b"].layout) == "_S(0, 2)"
    np.testing.assert_array_equal(np.asarray(other["b"].full_tensor()), cube.reshape(32, 16))
    rows = cube.reshape(32, 16)
    by_device = {s.device: np.asarray(s.data) for s in other["b"].array.addressable_shards}
    for rank in line.rank_list:  # rank r: its 2 rows of each of the 2 groups of 16
        want = np.concatenate([rows[2 * rank:2 * rank + 2], rows[16 + 2 * rank:16 + 2 * rank + 2]])
        np.testing.assert_array_equal(by_device[line.device(rank)], want)
