"""Runs a training script under one allocator and writes its peak memory.

    python3 bench/torch/measure_script.py --allocator native|expandable|async|gpumem --json FILE \
            SCRIPT [ARGS...]

The script runs unedited in this process (runpy, as `python SCRIPT` would),
with the allocator installed before it imports torch; at its end, FILE gets
torch.cuda.max_memory_reserved() and max_memory_allocated() (gpumem's own
figures under gpumem), whether it ran out of memory, the script's wall time
and, under gpumem, the overflow tier's counts. With --snapshot FILE, FILE
gets PyTorch's own memory snapshot of the whole run (_record_memory_history:
every request, free and segment), for seeing how the allocator placed the
job's blocks where a prediction missed. For checking what
`python -m gpumem.predict` said about a script nobody here wrote.
"""

import argparse
import json
import os
import runpy
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

from gpumem import _safefs  # noqa: E402 (files written as gpumem writes its own)
from workloads import install_allocator, is_oom  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocator", choices=["native", "expandable", "async", "gpumem"], default="native")
    ap.add_argument("--json", required=True)
    ap.add_argument("--snapshot", help="write PyTorch's memory snapshot of the run (a pickle) here")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    a.conf, a.limit = None, None  # (install_allocator's gpumem configuration: the default)
    torch = install_allocator(a)
    sys.argv = [a.script] + a.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))
    if a.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    oom = None
    started = time.monotonic()
    try:
        runpy.run_path(a.script, run_name="__main__")
    except Exception as e:  # noqa: BLE001 (only running out of memory is a result)
        if not is_oom(torch, e):
            raise
        oom = str(e).splitlines()[0]
    seconds = time.monotonic() - started
    stats = torch.cuda.memory_stats()
    # under gpumem: the overflow tier's figures (docs/python.md)
    tier = {k: stats[k] for k in ("host_bytes.all.peak", "num_host_allocs", "num_moves_to_host",
                                  "num_moves_to_device", "num_ooms") if k in stats}  # fmt: skip
    result = {"script": a.script, "args": a.args, "allocator": a.allocator, "gpumem_conf": os.environ.get("GPUMEM_CONF"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": round(seconds, 2), **tier,
              "peak_reserved": torch.cuda.max_memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated(),
              "oom": oom}  # fmt: skip
    if a.snapshot:
        import pickle

        _safefs.write_file(a.snapshot, pickle.dumps(torch.cuda.memory._snapshot()))
    _safefs.write_file(a.json, json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
