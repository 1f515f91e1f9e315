"""One run of a bundled workload (bench/torch/workloads.py) for the what-if
checks of bench/torch/whatif.sh, leaving what gpumem replays afterwards:

    python3 bench/torch/whatif_run.py OUTDIR WORKLOAD MODE [workloads.py options]

MODE native, expandable: PyTorch's allocator (expandable:
expandable_segments:True) with torch.cuda.memory._record_memory_history on
from the start; writes OUTDIR/WORKLOAD.MODE.pickle (_dump_snapshot).
MODE async: PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (no history
there). MODE gpumem-P: gpumem with policy P and record:OUTDIR/WORKLOAD.MODE.trace.gz.
Prints workloads.py's JSON line (peak_reserved: torch.cuda.max_memory_reserved
over the whole run) with "mode" added, and writes it to OUTDIR/WORKLOAD.MODE.json.
"""

import io
import json
import os
import sys
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    outdir, workload, mode = sys.argv[1:4]
    rest = sys.argv[4:]
    argv = [workload] + rest
    if mode in ("native", "expandable"):
        argv += ["--allocator", mode]
    elif mode == "async":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
        argv += ["--allocator", "native"]
    elif mode.startswith("gpumem-"):
        policy = mode[len("gpumem-"):]
        trace = os.path.join(outdir, f"{workload}.{mode}.trace.gz")
        argv += ["--allocator", "gpumem", "--conf", f"policy:{policy},record:{trace}"]
    else:
        sys.exit(f"whatif_run: unknown mode {mode}")
    sys.path.insert(0, HERE)
    import workloads

    history = mode in ("native", "expandable")
    if history:
        if mode == "expandable":
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        import torch

        # Python frames only: C++ unwinding would slow every allocation
        torch.cuda.memory._record_memory_history(max_entries=20_000_000, stacks="python")
    sys.argv = ["workloads.py"] + argv
    buf = io.StringIO()
    with redirect_stdout(buf):
        workloads.main()
    line = [l for l in buf.getvalue().splitlines() if l.startswith("{")][-1]
    result = json.loads(line)
    result["mode"] = mode
    import torch

    result["device_total"] = torch.cuda.mem_get_info()[1]
    if history:
        torch.cuda.memory._dump_snapshot(os.path.join(outdir, f"{workload}.{mode}.pickle"))
    if mode.startswith("gpumem-"):
        import gpumem

        gpumem.allocator(None).record_trace(None)  # finish the file
    with open(os.path.join(outdir, f"{workload}.{mode}.json"), "w") as f:
        json.dump(result, f)
    print(json.dumps({k: result.get(k) for k in ("workload", "mode", "peak_reserved", "oom")}))


if __name__ == "__main__":
    main()
