"""The scratch memory of PyTorch's CUDA reductions on this GPU, against what
the CPU recorder puts in its traces for them (gpumem.predict.reductions),
operator by operator, on the jobs of bench/torch/predict_jobs.py.

    python3 bench/torch/reduce_probe.py [--profile h200] [--batch 16] [JOB ...]

Each job runs one step on the GPU at --batch. Each sum and mean on CUDA
tensors, and each bias gradient a convolution's backward sums, is watched
through the caching allocator's counters: the allocations the call makes
besides its outputs, and the bytes they ask for. The recorder's figures come
from the same operator, shapes and strides, and the device profile's
multiprocessor count. One line per distinct kind of call (operator, dtype,
shape, strides, dimensions) gives both and how often it came; the last line
counts the calls where they differ. Exit status 1 when any does.
"""

import collections
import sys

from probes import setup, step_under


def _counters(torch):
    s = torch.cuda.memory_stats()
    return s.get("allocation.all.allocated", 0), s.get("requested_bytes.all.allocated", 0)


def _storages(torch, out):
    from torch.utils._pytree import tree_flatten

    seen, n, nbytes = set(), 0, 0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            s = t.untyped_storage()
            if s.data_ptr() not in seen and s.nbytes():
                seen.add(s.data_ptr())
                n += 1
                nbytes += s.nbytes()
    return n, nbytes


def _name(dtype):
    return str(dtype).replace("torch.", "")


def probe(torch, profile, job, batch):
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from gpumem.predict import reductions

    aten = torch.ops.aten
    kinds = {aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.mean.dim: "mean", aten.mean.default: "mean"}
    mps = profile.value("multiprocessor_count")
    threads = profile.value("max_threads_per_multiprocessor")
    seen = collections.Counter()

    def predicted(kind, x, dims, out):
        plan = reductions.scratch_of(kind, x, dims, out, mps, threads)
        return None if plan is None else tuple(n for n in plan[0] + [n for r in plan[1] for n in r] if n)

    def measured(call):
        """(allocations besides the outputs, the bytes they asked for), and the result."""
        torch.cuda.synchronize()
        n0, b0 = _counters(torch)
        out = call()
        n1, b1 = _counters(torch)
        n_out, b_out = _storages(torch, out)
        return (n1 - n0 - n_out, b1 - b0 - b_out), out

    def kind_of(op, x, dims):
        return (job, op, _name(x.dtype), tuple(x.shape), tuple(x.stride()), tuple(sorted(dims or ())))

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in kinds and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
                dims = args[1] if func in (aten.sum.dim_IntList, aten.mean.dim) and len(args) > 1 else None
                with _disable_current_modes():
                    (n, nbytes), out = measured(lambda: func(*args, **kwargs))
                mine = predicted(kinds[func], args[0], dims, out)
                seen[kind_of(str(func), args[0], dims) + ((n, nbytes), mine)] += 1
                return out
            if func is aten.convolution_backward.default and args[0].is_cuda and args[10][2]:
                with _disable_current_modes():
                    out = func(*args, **kwargs)
                    grad = args[0]
                    dims = [0] + list(range(2, grad.dim()))
                    # the bias's sum again on its own: the backend's workspaces are not in it
                    (n, nbytes), bias = measured(lambda: aten.sum.dim_IntList(grad, dims))
                mine = predicted("sum", grad, dims, bias)
                seen[kind_of("convolution_backward (bias)", grad, dims) + ((n, nbytes), mine)] += 1
                return out
            return func(*args, **kwargs)

    step_under(torch, job, batch, Spy())
    return seen


def agrees(real, mine):
    n, nbytes = real
    return mine is not None and n == len(mine) and nbytes == sum(mine)


def main():
    args, torch, profile = setup("reduce_probe", __doc__, 16)
    if not profile.value("multiprocessor_count"):
        sys.exit("reduce_probe: the device profile %s has no multiprocessor_count" % profile.name)
    differ = total = with_scratch = 0
    print("job | operator | dtype | shape | strides | dims | pytorch (allocations, bytes) | recorder | calls")
    for job in args.jobs:
        try:
            seen = probe(torch, profile, job, args.batch)
        except Exception as e:  # noqa: BLE001 (a job that fails is reported, the others still run)
            print("%s | failed: %s: %s" % (job, type(e).__name__, str(e).splitlines()[0][:200]))
            differ += 1
            continue
        for kind, n in sorted(seen.items(), key=str):
            ok = agrees(kind[-2], kind[-1])
            if kind[-2][0] or not ok:
                print(" | ".join(map(str, kind + (n,))) + ("" if ok else "   <- differs"))
            total += n
            with_scratch += n if kind[-2][0] else 0
            differ += 0 if ok else n
    print("%d of %d calls (%d with scratch memory): the recorder's scratch differs from PyTorch's on %s, batch %d"
          % (differ, total, with_scratch, torch.cuda.get_device_name(), args.batch))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
