"""Reductions of inputs past 32-bit byte offsets, on this GPU, against what
the CPU recorder puts in its traces for them (gpumem.predict.reductions:
the input halved until each piece is indexable with 32 bits, a staging
buffer per piece, an accumulation buffer where a half-precision output
cannot hold the pieces' partial sums).

    python3 bench/torch/reduce_split_probe.py

One line per case: the allocations the call made besides its output, their
bytes and the call's peak above its input and output, measured and modelled
(the GPU's own multiprocessor count). Exit status 1 when any differs. Needs
about 25 GiB of GPU memory.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

# (what, dtype, shape, dims (None: all), output dtype or None, kind)
CASES = [
    ("a float32 tensor of 4.4 GiB summed whole", "float32", [1_192_755_200], None, None, "sum"),
    ("its mean", "float32", [1_192_755_200], None, None, "mean"),
    ("bf16 of 2^31 + 2^20 elements summed whole (too many elements)", "bfloat16", [(1 << 31) + (1 << 20)], None,
     None, "sum"),
    ("a bf16 bias gradient over 400,000 rows of 3,072", "bfloat16", [400_000, 3072], [0], None, "sum"),
    ("the same summed into float32", "bfloat16", [400_000, 3072], [0], "float32", "sum"),
    ("float32 rows of 100M summed along them", "float32", [8, 100_000_000], [1], None, "sum"),
    ("bf16 [3, 1024, 1024, 1024] over its first dimension", "bfloat16", [3, 1024, 1024, 1024], [0], None, "sum"),
    ("a float16 tensor of 1.2e9 elements, its mean in float16", "float16", [1_200_000_000], None, None, "mean"),
]


def main():
    import torch

    from gpumem.predict import reductions

    if not torch.cuda.is_available():
        sys.exit("reduce_split_probe.py: needs a GPU")
    props = torch.cuda.get_device_properties(0)
    mps, threads = props.multi_processor_count, props.max_threads_per_multi_processor
    print("%s, torch %s, %d multiprocessors, %d threads each" % (props.name, torch.__version__, mps, threads))
    print("| case | allocations besides the output: measured | modelled | peak above input and output: measured |"
          " modelled |")
    print("|---|---|---|---|---|")
    differ = 0
    for what, dtype, shape, dims, out_dtype, kind in CASES:
        dt = getattr(torch, dtype)
        x = torch.ones(shape, dtype=dt, device="cuda")
        kwargs = {"dtype": getattr(torch, out_dtype)} if out_dtype else {}
        op = torch.sum if kind == "sum" else torch.mean
        call = (lambda: op(x, **kwargs)) if dims is None else (lambda: op(x, dims, **kwargs))
        # the output alone first: its block, then the call's counters
        out = call()
        out_bytes = -(-out.untyped_storage().nbytes() // 512) * 512  # its block: 512-byte units
        del out
        torch.cuda.synchronize()
        s0 = torch.cuda.memory_stats()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        s1 = torch.cuda.memory_stats()
        n = s1["allocation.all.allocated"] - s0["allocation.all.allocated"] - 1
        nbytes = s1["requested_bytes.all.allocated"] - s0["requested_bytes.all.allocated"] - out.nbytes
        peak = torch.cuda.max_memory_allocated() - base - out_bytes
        plan = reductions.scratch_of(kind, x, dims, out, mps, threads)
        if plan is None:
            modelled = "not modelled"
            same = False
        else:
            held, rounds = plan
            flat = [b for b in held + [b for r in rounds for b in r] if b]
            # the allocator rounds each block to 512 bytes: the peak is in blocks
            rnd = lambda b: -(-b // 512) * 512  # noqa: E731
            mpeak = sum(rnd(b) for b in held if b) + max([sum(rnd(b) for b in r if b) for r in rounds] or [0])
            modelled = (len(flat), sum(flat), mpeak)
            same = modelled == (n, nbytes, peak)
        differ += not same
        m = "%d, %d bytes" % (n, nbytes)
        p = modelled if isinstance(modelled, str) else "%d, %d bytes" % modelled[:2]
        print("| %s | %s | %s | %d | %s |%s" % (what, m, p, peak, "" if isinstance(modelled, str) else modelled[2],
                                                 "" if same else " DIFFERS"))  # fmt: skip
        del x, out
        torch.cuda.empty_cache()
    print("%d of %d cases differ" % (differ, len(CASES)))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
