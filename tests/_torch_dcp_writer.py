"""Writes a torch.distributed.checkpoint of torch DTensors (tests/test_torch_checkpoint.py);
not collected. Usage: ``python tests/_torch_dcp_writer.py RANK WORLD PORT PATH``: one
gloo process per rank of a (2, 2) torch mesh ("dp", "tp"), each saving its own shards."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))
from _torch_dcp_tree import PLACEMENTS, full_values  # noqa: E402


def main() -> None:
    rank, world, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    names = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    state = {
        name: distribute_tensor(torch.from_numpy(value.copy()) if value.dtype.name != "bfloat16"
                                else torch.from_numpy(value.view("int16").copy()).view(torch.bfloat16),
                                mesh, [names[p] for p in PLACEMENTS[name]], src_data_rank=None)
        for name, value in full_values().items()
    }
    dcp.save({"model": state}, checkpoint_id=path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
