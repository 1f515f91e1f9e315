"""What a block on host pages costs the kernels that touch it: gpumem's
overflow tier (GPUMEM_CONF=overflow:host) on the GPU, one process.

A tensor moved to host pages (gpumem.torch.prefer_host) keeps its address;
kernels reach it over the host link. This times, on device pages and then
on host pages, the same work:

    read        x.sum() over a tensor of --gib GiB
    write       x.fill_(1.0)
    read+write  x.mul_(1.0001) (each byte crosses the link twice)
    AdamW       torch.optim.AdamW's step (its default implementation) over
                parameters of --gib GiB: with the moments (exp_avg,
                exp_avg_sq) on host pages, then with the parameters too

and prints each as GB/s of link traffic, and AdamW's added time per GiB
on host pages: the floor of what a step that keeps that much optimizer
state off the card pays, when kernels read it where it lies.

    python bench/torch/host_link_probe.py [--gib 1] [--json OUT.json]
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 1 << 30


def timed(torch, fn, reps):
    """Median seconds of fn over reps runs, each synchronized."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def host_bytes(torch):
    return torch.cuda.memory_stats().get("host_bytes.all.current") or 0


def elementwise(torch, gpumem, n_bytes, reps):
    x = torch.empty(n_bytes // 4, device="cuda")
    x.fill_(0.5)
    work = {
        "read": (lambda: x.sum(), 1),
        "write": (lambda: x.fill_(1.0), 1),
        "read+write": (lambda: x.mul_(1.0001), 2),
    }
    out = {}
    for where in ("device", "host"):
        if where == "host":
            torch.cuda.synchronize()
            before = host_bytes(torch)
            if not gpumem.torch.prefer_host(x):
                raise SystemExit("host_link_probe: the tensor did not move to host pages")
            torch.cuda.synchronize()
            out["moved_bytes"] = host_bytes(torch) - before
        for name, (fn, crossings) in work.items():
            s = timed(torch, fn, reps)
            out["%s %s s" % (name, where)] = s
            out["%s %s GB/s" % (name, where)] = crossings * n_bytes / s / 1e9
    del x
    return out


def adamw(torch, gpumem, n_bytes, reps):
    # parameters in tensors of 64 MiB, as a model's layers are
    per = 16 << 20
    params = [torch.nn.Parameter(torch.randn(per, device="cuda") * 0.01) for _ in range(max(1, n_bytes // (per * 4)))]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()  # makes the state
    out = {"adamw_param_bytes": sum(p.numel() * 4 for p in params)}
    out["adamw device s"] = timed(torch, opt.step, reps)
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    torch.cuda.synchronize()
    gpumem.torch.prefer_host(moments)
    torch.cuda.synchronize()
    out["adamw moments_on_host_bytes"] = host_bytes(torch)
    out["adamw moments on host s"] = timed(torch, opt.step, reps)
    gpumem.torch.prefer_host(params)
    torch.cuda.synchronize()
    out["adamw moments_and_params_on_host_bytes"] = host_bytes(torch)
    out["adamw moments and params on host s"] = timed(torch, opt.step, reps)
    for key in ("moments", "moments and params"):
        on_host = out["adamw %s_on_host_bytes" % key.replace(" ", "_")]
        extra = out["adamw %s on host s" % key] - out["adamw device s"]
        out["adamw %s: added ms per GiB on host" % key] = extra * 1e3 / (on_host / GIB) if on_host else None
    del opt, params, moments
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="size of each measured tensor set (GiB)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the figures here (a new file)")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(REPO, "python"))
    import gpumem.torch

    gpumem.torch.enable("overflow:host")
    import torch

    n_bytes = int(a.gib * GIB) // (64 << 20) * (64 << 20)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "bytes": n_bytes}
    result.update(elementwise(torch, gpumem, n_bytes, a.reps))
    torch.cuda.empty_cache()
    result.update(adamw(torch, gpumem, n_bytes, a.reps))
    for k, v in result.items():
        print("%-50s %s" % (k, "%.4g" % v if isinstance(v, float) else v))
    if a.json:
        from gpumem import _safefs

        _safefs.write_file(a.json, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
