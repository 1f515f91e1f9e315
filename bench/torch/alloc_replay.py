"""A trace's requests through PyTorch's own allocator interface, in C++.

    python3 bench/torch/alloc_replay.py --allocator native|gpumem [--passes N] TRACE...

Replays each trace (traces/*.trace.gz) through
c10::cuda::CUDACachingAllocator::raw_alloc_with_stream and raw_delete, the
entry points PyTorch's tensors reach: with `native` that is PyTorch's caching
allocator, with `gpumem` it is gpumem installed by gpumem.torch.enable, so
every request also passes through torch's CUDAPluggableAllocator (a
std::function call and a per-pointer map under a mutex) exactly as in a
training program. The loop is compiled C++ (no Python per request), so the
figure is what the allocator costs the host per request, the part a host-bound
training step pays. Each trace stream gets its own torch.cuda.Stream; no
kernels run. The first pass is cold; what a pass leaves live is freed,
untimed, before the next. Prints one JSON line per trace.

One allocator per process: run the two in separate processes, in the same
call (alternating, or at once on two GPUs, swapping them), and compare.
"""

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

_SOURCE = r"""
#include <c10/cuda/CUDACachingAllocator.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

namespace cca = c10::cuda::CUDACachingAllocator;

// kind[i]: 0 allocate size[i] bytes as id[i] on streams[stream_ix[i]], 1 free id[i].
extern "C" int gm_bench_replay(int64_t n, const int8_t* kind, const int64_t* id, const int64_t* size,
                               const int32_t* stream_ix, const uint64_t* streams, int64_t num_ids,
                               int32_t passes, double* ns_per_op, char* err, int64_t err_len) {
  std::vector<void*> live((size_t)num_ids, nullptr);
  try {
    for (int32_t p = 0; p < passes; p++) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < n; i++) {
        if (kind[i] == 0) {
          live[(size_t)id[i]] = cca::raw_alloc_with_stream(
              (size_t)size[i], reinterpret_cast<cudaStream_t>(streams[stream_ix[i]]));
        } else {
          cca::raw_delete(live[(size_t)id[i]]);
          live[(size_t)id[i]] = nullptr;
        }
      }
      auto t1 = std::chrono::steady_clock::now();
      ns_per_op[p] = (double)std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count() /
                     (double)n;
      for (void*& q : live) {
        if (q) cca::raw_delete(q);
        q = nullptr;
      }
    }
  } catch (const std::exception& e) {
    std::snprintf(err, (size_t)err_len, "%s", e.what());
    return 1;
  }
  return 0;
}
"""


def build_helper(torch, cache):
    """Compiles the replay loop against this torch's headers and libc10_cuda
    (with gpumem.torch's compiler driver, as its shim is built)."""
    import hashlib

    sys.path.insert(0, os.path.join(REPO, "python"))
    from gpumem.torch import _compile_direct

    key = hashlib.sha256((_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    out = os.path.join(cache, "alloc_replay_%s.so" % key)
    if os.path.exists(out):
        return out
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    why = _compile_direct(torch, _SOURCE, out, libs=("c10_cuda", "c10"), includes=(os.path.join(cuda, "include"),))
    if why is not None:
        sys.exit("alloc_replay: compiling the helper failed: " + why)
    return out


def load_trace(path):
    """(kind, id, size, stream_ix) lists and the distinct stream values."""
    opener = gzip.open if path.endswith(".gz") else open
    kind, ids, size, six = [], [], [], []
    dense, streams = {}, {}
    next_ix = 0
    with opener(path, "rt") as f:
        for line in f:
            p = line.split()
            if not p or p[0].startswith("#"):
                continue
            if p[0] == "a":
                dense[p[1]] = next_ix
                next_ix += 1
                kind.append(0)
                ids.append(dense[p[1]])
                size.append(int(p[2]))
                six.append(streams.setdefault(int(p[3]), len(streams)))
            elif p[0] == "f" and p[1] in dense:
                kind.append(1)
                ids.append(dense.pop(p[1]))
                size.append(0)
                six.append(0)
    return kind, ids, size, six, streams, next_ix


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocator", choices=["native", "gpumem"], default="native")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    if args.allocator == "gpumem":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import gpumem.torch

        gpumem.torch.enable()
    import ctypes

    import torch

    torch.zeros(1, device="cuda")  # the context, and the allocator in place
    cache = os.environ.get("GPUMEM_CACHE_DIR") or tempfile.gettempdir()
    os.makedirs(cache, exist_ok=True)
    helper = ctypes.CDLL(build_helper(torch, cache))
    fn = helper.gm_bench_replay
    fn.restype = ctypes.c_int
    for path in args.traces:
        kind, ids, size, six, stream_values, num_ids = load_trace(path)
        keep = [None] * len(stream_values)
        handles = (ctypes.c_uint64 * max(1, len(stream_values)))()
        for value, ix in stream_values.items():
            if value != 0:
                keep[ix] = torch.cuda.Stream()
                handles[ix] = keep[ix].cuda_stream
        n = len(kind)
        c_kind = (ctypes.c_int8 * n)(*kind)
        c_id = (ctypes.c_int64 * n)(*ids)
        c_size = (ctypes.c_int64 * n)(*size)
        c_six = (ctypes.c_int32 * n)(*six)
        ns = (ctypes.c_double * args.passes)()
        err = ctypes.create_string_buffer(4096)
        torch.cuda.synchronize()
        rc = fn(
            ctypes.c_int64(n), c_kind, c_id, c_size, c_six, handles, ctypes.c_int64(num_ids),
            ctypes.c_int32(args.passes), ns, err, ctypes.c_int64(len(err)),
        )
        torch.cuda.synchronize()
        name = os.path.basename(path).split(".")[0]
        if rc != 0:
            print(json.dumps({"allocator": args.allocator, "trace": name, "error": err.value.decode()[:500]}))
            continue
        per = [round(x, 1) for x in ns]
        print(
            json.dumps(
                {
                    "allocator": args.allocator,
                    "trace": name,
                    "ops": n,
                    "ns_per_op_cold": per[0],
                    "ns_per_op_warm": statistics.median(per[1:]) if len(per) > 1 else None,
                    "ns_per_op": per,
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                }
            ),
            flush=True,
        )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
