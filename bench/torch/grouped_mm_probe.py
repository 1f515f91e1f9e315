"""torch._grouped_mm on this GPU for float32, float16 and bfloat16 inputs:
the output's type and shape, the allocations a call makes (count, bytes)
and its peak above what was allocated before; then whether PyTorch's meta
function (what fake tensors run) accepts the same call, and what autocast
makes of float32 inputs. Why the CPU recorder runs float32 and float16
grouped GEMMs itself (gpumem.predict.recorder, _grouped_mm_by_loop).

    python3 bench/torch/grouped_mm_probe.py 2>/dev/null

(stderr carries fake tensors' own log of the refused calls.)
"""

import torch
print(torch.__version__)
E, K, N, S = 8, 512, 1024, 4096
a = torch.randn(S, K, device="cuda")
b = torch.randn(E, K, N, device="cuda")
offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (S // E)
for dt in (torch.float32, torch.float16, torch.bfloat16):
    x, w = a.to(dt), b.to(dt)
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        out = torch._grouped_mm(x, w, offs=offs)
        torch.cuda.synchronize()
        s1 = torch.cuda.memory_stats()
        print(dt, "out", out.dtype, tuple(out.shape),
              "allocs", s1["allocation.all.allocated"] - s0["allocation.all.allocated"],
              "bytes", s1["allocated_bytes.all.allocated"] - s0["allocated_bytes.all.allocated"],
              "out bytes", out.untyped_storage().nbytes(), "peak above", torch.cuda.max_memory_allocated() - base)
        del out
    except Exception as e:
        print(dt, "error", str(e)[:200])
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as m:
        fx, fw, fo = m.from_tensor(x), m.from_tensor(w), m.from_tensor(offs)
        try:
            r = torch._grouped_mm(fx, fw, offs=fo)
            print(dt, "fake ok", r.dtype, tuple(r.shape))
        except Exception as e:
            print(dt, "fake error", str(e)[:160])
# autocast: does it cast _grouped_mm?
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = torch._grouped_mm(a, b, offs=offs)
    print("under autocast fp32 inputs ->", out.dtype)
