"""One process of the two-process checkpoint test (tests/test_checkpoint.py); not collected.

Usage: ``python tests/_checkpoint_worker.py PROCESS_ID PORT MODE PATH`` with MODE ``save``
(this process's shards of TREE, built from its own ranks only, saved as step 3) or ``load``
(the checkpoint loaded into other layouts and checked on this process's ranks). Each
process owns 4 CPU devices. The last stdout line is ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package first
from _checkpoint_tree import LOAD_LAYOUTS, PLAIN, PLAIN_SPECS, SAVE_LAYOUTS, VALUES  # noqa: E402

import placements2jax as p2j  # noqa: E402
from placements2jax import DTensor, init_device_mesh  # noqa: E402


def main() -> None:
    process, port, mode, path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=process, initialization_timeout=60
    )
    assert (jax.process_count(), jax.device_count()) == (2, 8)
    meshes = {"grid": init_device_mesh((2, 4), ("dp", "tp")), "line": init_device_mesh((8,), ("x",))}
    checked = []
    if mode == "save":
        tree = {}
        for name, (mesh_name, placements) in SAVE_LAYOUTS.items():
            mesh = meshes[mesh_name]
            layout = p2j.resolve_layout(mesh, placements, VALUES[name].ndim)
            own = {r: VALUES[name][layout.local_slices(VALUES[name].shape, r)] for r in mesh.rank_list
                   if mesh.device(r).process_index == process}
            if layout.has_partial:  # build from the plain blocks, then split on the devices
                plain = DTensor.from_local(own, mesh, p2j.Layout(mesh, layout.dim_axes), shape=VALUES[name].shape)
                tree[name] = plain.redistribute(placements=layout)
            else:
                tree[name] = DTensor.from_local(own, mesh, layout, shape=VALUES[name].shape)
        for name, value in PLAIN.items():  # global arrays over both processes' devices
            sharding = NamedSharding(meshes["grid"].to_jax(), PartitionSpec(*PLAIN_SPECS[name]))
            tree[name] = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
        p2j.save(path, tree, step=3)
        checked.append("saved")
    else:
        target = {name: p2j.AbstractDTensor(VALUES[name].shape, VALUES[name].dtype, meshes[m], pl)
                  for name, (m, pl) in LOAD_LAYOUTS.items()}
        plain = {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
            meshes["line"].to_jax(), PartitionSpec(*(("x",) if v.ndim else ())))) for name, v in PLAIN.items()}
        keys = {"keys": jax.ShapeDtypeStruct((3,), jax.random.key(0).dtype, sharding=NamedSharding(
            meshes["grid"].to_jax(), PartitionSpec()))}
        loaded = p2j.load(path, {**target, **plain, **keys})
        array = loaded.pop("keys")  # PRNG keys: their key data placed on each process's devices, wrapped there
        assert array.dtype == keys["keys"].dtype and not array.is_fully_addressable
        want = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5), 3)))
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(array).addressable_data(0)), want)
        checked.append("keys")
        for name in PLAIN:  # every process read the one stored copy, placed on its own devices
            array = loaded.pop(name)
            assert array.sharding == plain[name].sharding and not array.is_fully_addressable
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), PLAIN[name][shard.index])
            checked.append(name)
        for name, dtensor in loaded.items():
            layout = dtensor.layout
            for rank, block in dtensor.local_shards().items():
                if not layout.has_partial:
                    np.testing.assert_array_equal(np.asarray(block), VALUES[name][layout.local_slices(VALUES[name].shape, rank)])
            np.testing.assert_array_equal(np.asarray(dtensor.full_tensor().addressable_data(0)), VALUES[name])
            checked.append(name)
    print("RESULT " + json.dumps({"process": process, "checked": checked}), flush=True)


if __name__ == "__main__":
    main()
