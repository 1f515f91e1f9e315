"""Host cost of one tensor allocation and free through PyTorch, per allocator.

    python3 bench/torch/alloc_overhead.py --allocator native|gpumem [--pairs N]

Allocates and drops CUDA tensors of a few sizes in a loop, with nothing else
on the GPU, after a warm-up: the time per pair is PyTorch's own dispatch plus
the allocator's malloc and free, as a training step pays it for each
temporary tensor. Under gpumem this also includes torch's pluggable
allocator interface (CUDAPluggableAllocator: a map of pointers under a
mutex). Run the two allocators in separate processes, interleaved, and
compare the difference: the dispatch part is the same for both. Prints one
JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocator", choices=["native", "gpumem"], default="native")
    ap.add_argument("--pairs", type=int, default=100000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.allocator == "gpumem":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpumem.torch

        gpumem.torch.enable()
    import torch

    torch.cuda.init()
    # Sizes of a transformer step's temporaries: small (bias grads, norms),
    # activations, and a large logits-sized buffer; a few live at once so
    # that the allocator splits and merges as in a real step.
    sizes = [3072, 786432, 6291456, 25165824, 4096, 3145728]
    keep = []

    def loop(n):
        for i in range(n):
            t = torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device="cuda")
            keep.append(t)
            if len(keep) > 3:
                keep.pop(0)

    loop(20000)  # warm the cache
    torch.cuda.synchronize()
    per_pair = []
    for _ in range(args.repeats):
        t0 = time.perf_counter_ns()
        loop(args.pairs)
        per_pair.append((time.perf_counter_ns() - t0) / args.pairs)
    keep.clear()
    print(
        json.dumps(
            {
                "allocator": args.allocator,
                "pairs": args.pairs,
                "ns_per_pair_median": round(statistics.median(per_pair), 1),
                "ns_per_pair_min": round(min(per_pair), 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
