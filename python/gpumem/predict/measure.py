"""Measures this machine's GPU into a device profile for gpumem.predict's
CPU recorder (what a run on the CPU cannot see) and writes it as JSON:

    python -m gpumem.predict.measure [--out PATH] [--base NAME_OR_PATH]

Default --out: <the user's gpumem cache>/profiles/<gpu>-torch<major.minor>.json
(h100-80gb-hbm3-torch2.11.json on an H100 with PyTorch 2.11), where
`python -m gpumem.predict` finds it: on a machine with that GPU it is
picked by itself, elsewhere `--profile NAME` or `--profile PATH` takes it.
--base: the shipped profile of that name, else h200. Each value measured
replaces the base's ("source": "measured"); the others are kept as they
were. Takes a few seconds; the context is this process's own, as NVML
lists it, where other processes use the GPU too (gpumem.predict.gpu_context).

Measured: the CUDA context (device memory used outside the allocator
after initialisation and a first kernel), the multiprocessor count and
threads per multiprocessor (which size reductions' staging buffers), the
cuBLAS workspaces (the
allocations a first matmul and a first backward leave that are no
tensor's storage), cuBLASLt's (a first addmm with bias), the attention
backend scaled_dot_product_attention runs for bf16 inputs and the scratch
its backward takes per element of q."""

import argparse
import json
import os
import re
import sys
import time

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


# ---- pure parts (tested on the CPU) --------------------------------------


def profile_name(gpu, torch_version):
    """'NVIDIA H200', '2.11.0+cu130' -> 'h200-torch2.11'."""
    name = re.sub(r"^nvidia\s+", "", gpu.strip(), flags=re.I).lower()
    name = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    return "%s-torch%s" % (name, mm)


def extra_allocations(blocks, known):
    """Sizes of the live blocks [(address, size)] at no known address."""
    return [size for addr, size in blocks if addr not in known]


def sdpa_backend_of(op_names):
    """The backend a profile of scaled_dot_product_attention shows."""
    names = " ".join(op_names)
    for key, backend in (("flash_attention", "flash"), ("efficient_attention", "efficient"),
                         ("cudnn_attention", "cudnn")):  # fmt: skip
        if key in names:
            return backend
    return "math"


# What each measured value is, for its "why" (the profile says where every
# figure comes from; a value measured here must not keep the base's account
# of another card's measurement).
MEANINGS = {
    "cuda_context_bytes": "device memory in use outside the allocator after initialisation and a first kernel",
    "multiprocessor_count": "torch.cuda.get_device_properties: sizes reductions' staging buffers",
    "max_threads_per_multiprocessor": "torch.cuda.get_device_properties: sizes reductions' staging buffers",
    "cublas_workspace_bytes": "the largest allocation a first matmul leaves that is no tensor's storage",
    "cublas_workspaces_in_backward": "the workspaces a first backward (autograd's own thread) adds",
    "cublaslt_workspace_bytes": "what a first addmm with bias (cuBLASLt) leaves that is no tensor's storage",
    "sdpa_backend": "the backend scaled_dot_product_attention runs for bf16 inputs without a mask",
    "sdpa_backward_scratch_bytes_per_q_element": "the backward's peak beyond its gradients, per element of q",
}


def merge(base, measured, gpu, capability, total, torch_version, where=None):
    """base profile (dict) with the measured values in, marked so; where
    (the card, software and date, in words) goes into each one's "why"."""
    out = json.loads(json.dumps(base))
    out["name"] = profile_name(gpu, torch_version)
    out["gpu"] = gpu
    out["torch"] = ".".join(torch_version.split("+")[0].split(".")[:2])
    out["compute_capability"] = list(capability)
    out["total_memory_bytes"] = int(total)
    values = out.setdefault("values", {})
    for key, value in measured.items():
        entry = values.setdefault(key, {})
        entry["value"] = value
        entry["source"] = "measured"
        entry["why"] = "measured by python -m gpumem.predict.measure%s%s" % (
            " on " + where if where else "", ": " + MEANINGS[key] if key in MEANINGS else "")
    return out


# ---- measuring (needs a GPU) ---------------------------------------------


def _live_blocks(torch):
    blocks = []
    for seg in torch.cuda.memory_snapshot():
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                blocks.append((addr, b["requested_size"] if "requested_size" in b else b["size"]))
            addr += b["size"]
    return blocks


def _known(*tensors):
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def measure(torch, others=None):
    from gpumem.predict import gpu_context

    out = {}
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=dev).add_(1)  # a first kernel: lazily loaded modules
    torch.cuda.synchronize()
    out["cuda_context_bytes"], how = gpu_context.measure(others)
    print("gpumem.predict.measure: the CUDA context: %s" % how)
    props = torch.cuda.get_device_properties(dev)
    out["multiprocessor_count"] = int(props.multi_processor_count)
    out["max_threads_per_multiprocessor"] = int(props.max_threads_per_multi_processor)

    # cuBLAS: the forward's workspace (this thread), the backward's (autograd's thread)
    a = torch.randn(256, 256, device=dev, requires_grad=True)
    b = torch.randn(256, 256, device=dev, requires_grad=True)
    c = a @ b
    torch.cuda.synchronize()
    fwd = extra_allocations(_live_blocks(torch), _known(a, b, c))
    c.sum().backward()
    torch.cuda.synchronize()
    both = extra_allocations(_live_blocks(torch), _known(a, b, c, a.grad, b.grad))
    if fwd:
        out["cublas_workspace_bytes"] = max(fwd)
    bwd = list(both)
    for s in fwd:
        if s in bwd:
            bwd.remove(s)
    out["cublas_workspaces_in_backward"] = len(bwd)

    # cuBLASLt: addmm with a bias goes through cublasLt; a new block is its own workspace
    before = set(_live_blocks(torch))
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    lin = torch.nn.Linear(256, 256, device=dev, dtype=torch.bfloat16)
    y = lin(x)
    torch.cuda.synchronize()
    new = [blk for blk in _live_blocks(torch) if blk not in before]
    out["cublaslt_workspace_bytes"] = sum(extra_allocations(new, _known(x, y, lin.weight, lin.bias)))

    # attention: the backend, and the backward's scratch per element of q
    q, k, v = (torch.randn(2, 8, 1024, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out["sdpa_backend"] = sdpa_backend_of([e.key for e in prof.key_averages()])
    g = torch.ones_like(o)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    o.backward(g)
    torch.cuda.synchronize()
    grads = sum(t.grad.untyped_storage().nbytes() for t in (q, k, v))
    scratch = torch.cuda.max_memory_allocated() - start - grads
    out["sdpa_backward_scratch_bytes_per_q_element"] = round(max(0, scratch) / q.numel(), 6)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpumem.predict.measure", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="where to write the profile (default: the user's profiles directory)")
    p.add_argument("--base", help="profile to start from (name or path; default: same name, else h200)")
    a = p.parse_args(argv)
    from .. import _safefs
    from . import gpu_context, profiles

    others = gpu_context.others()  # before this process's CUDA context exists
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("gpumem.predict.measure: no GPU: run this on the GPU the profile is for\n")
        return 2
    props = torch.cuda.get_device_properties(0)
    torch.cuda.memory._record_memory_history(max_entries=100000)
    measured = measure(torch, others)
    torch.cuda.memory._record_memory_history(enabled=None)
    name = profile_name(props.name, torch.__version__)
    try:
        base = profiles.load(a.base or (name if name in profiles.available() else "h200")).data
    except ValueError as e:
        p.error(str(e))
    where = "an %s (PyTorch %s, CUDA %s), %s" % (props.name, torch.__version__, torch.version.cuda,
                                                 time.strftime("%Y-%m-%d", time.gmtime()))
    prof = merge(base, measured, props.name, (props.major, props.minor), props.total_memory, torch.__version__,
                 where)  # fmt: skip
    out = a.out or os.path.join(_safefs.private_dir(profiles.user_dir()), name + ".json")
    try:
        _safefs.write_file(out, json.dumps(prof, indent=2) + "\n")
    except OSError as e:
        sys.stderr.write("gpumem.predict.measure: %s\n" % e)
        return 1
    print("gpumem.predict.measure: %s -> %s" % (json.dumps(measured), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
