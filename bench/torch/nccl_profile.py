"""Measures the device memory NCCL takes outside PyTorch's caching
allocator on one rank, for gpumem.predict's device profile
(nccl_communicator_bytes_1rank, _2ranks, _nranks):

    python bench/torch/nccl_profile.py OUT_DIR                       (one GPU: a group of 1 rank)
    torchrun --nproc-per-node N bench/torch/nccl_profile.py OUT_DIR  (N GPUs of one node)

Each rank, on its own GPU: a first kernel (the CUDA context and PyTorch's
kernels loaded), then init_process_group("nccl") with its device (the
communicator made at once), then a 4 MiB all_reduce, all_gather_into_tensor
and reduce_scatter_tensor (DDP's and FSDP2's collectives) and a broadcast,
each waited for. After each stage: the device memory this process holds
outside the caching allocator (gpumem.predict.gpu_context: NVML's figure for
this process where it can tell it from the others, else cudaMemGetInfo's
in-use bytes), torch.cuda.memory_reserved, and cudaMemGetInfo's free bytes.
NCCL's figure is what the memory outside the allocator grew by from the
first kernel to the last collective.

Writes OUT_DIR/nccl_rankR_of_N.json for each rank and prints, from rank
0, the profile entry as JSON ({"nccl_communicator_bytes_...": {"value",
"source": "measured", "why"}}) to put into the device profile. NVLink
multicast (NVLS) stays off unless NCCL_NVLS_ENABLE is set (with it on,
NCCL takes more on H100-class nodes of 4 or more GPUs; the JSON records
the NCCL environment). Takes under a minute."""

import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

MIB = 1 << 20
COLLECTIVE_BYTES = 4 * MIB


def profile_key(world):
    """The device profile's key for a communicator of `world` ranks."""
    from gpumem.predict.distributed import nccl_key

    return nccl_key(world)


def profile_entry(world, nccl_bytes, device, torch_version, nccl_version, how, date):
    """The device profile's entry for what this run measured."""
    return {profile_key(world): {
        "value": int(nccl_bytes), "source": "measured",
        "why": "measured by bench/torch/nccl_profile.py on %s (PyTorch %s, NCCL %s), %s: device memory outside the "
               "caching allocator after a communicator of %d rank%s ran a 4 MiB all_reduce, all_gather_into_tensor, "
               "reduce_scatter_tensor and broadcast, less that after a first kernel (%s)"
               % (device, torch_version, nccl_version, date, world, "" if world == 1 else "s", how),
    }}  # fmt: skip


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.stderr.write(__doc__)
        return 2
    out_dir = argv[0]
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    if "RANK" not in os.environ:  # run by itself: a group of one rank
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})  # fmt: skip
    for key in ("NCCL_NVLS_ENABLE",):
        os.environ.setdefault(key, "0")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])

    from gpumem.predict import gpu_context

    before = gpu_context.others()  # before this process touches CUDA
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    stages = []

    def stage(name):
        torch.cuda.synchronize(dev)
        outside, how = gpu_context.measure(before, dev)
        free, total = torch.cuda.mem_get_info(dev)
        stages.append({"stage": name, "outside_allocator": outside, "how": how,
                       "reserved": torch.cuda.memory_reserved(dev), "free": free, "total": total})  # fmt: skip

    x = torch.ones(COLLECTIVE_BYTES // 4, device=dev)
    x.mul_(2)
    stage("first kernel")
    dist.init_process_group("nccl", device_id=dev)
    stage("init_process_group")
    dist.all_reduce(x)
    stage("all_reduce")
    shard = x[: x.numel() // world].clone()
    dist.all_gather_into_tensor(x, shard)
    stage("all_gather_into_tensor")
    dist.reduce_scatter_tensor(shard, x)
    stage("reduce_scatter_tensor")
    dist.broadcast(x, src=0)
    stage("broadcast")
    nccl = stages[-1]["outside_allocator"] - stages[0]["outside_allocator"]
    nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
    device = torch.cuda.get_device_name(dev)
    date = time.strftime("%Y-%m-%d")
    result = {
        "rank": rank, "world_size": world, "device": device, "torch": torch.__version__, "nccl": nccl_version,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "stages": stages, "nccl_bytes": nccl,
        "profile_entry": profile_entry(world, nccl, device, torch.__version__, nccl_version, stages[-1]["how"], date),
    }  # fmt: skip
    path = os.path.join(out_dir, "nccl_rank%d_of_%d.json" % (rank, world))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if rank == 0:
        for s in stages:
            print("%-24s outside the allocator %8.1f MiB  reserved %8.1f MiB  (%s)"
                  % (s["stage"], s["outside_allocator"] / MIB, s["reserved"] / MIB, s["how"]))  # fmt: skip
        print("NCCL, %d rank%s: %.1f MiB on rank 0" % (world, "" if world == 1 else "s", nccl / MIB))
        print(json.dumps(result["profile_entry"], indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
