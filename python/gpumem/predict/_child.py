"""The process `python -m gpumem.predict` runs a training script in, once
per batch size:

    python -m gpumem.predict._child MODE OUT_DIR STEPS PROFILE SCRIPT [ARGS...]

MODE cpu: the script runs on fake CUDA tensors under the recorder
(recorder.py) and OUT_DIR/trace gets the trace. MODE gpu: the script runs
on the GPU with PyTorch's own allocation history on, and OUT_DIR/snapshot.pickle
gets a memory snapshot. Either way the script is stopped (SystemExit from
the optimizer step hook) once STEPS optimizer steps are done, and
OUT_DIR/meta.json says how many steps ran, what could not be seen
(notes) and the memory the CUDA context takes outside the allocator."""

import json
import os
import runpy
import sys


class _Enough(SystemExit):
    """Raised from the optimizer step hook once the steps asked for ran."""


def _run_script(script, args):
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except _Enough:
        return True
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return False


def run_cpu(out_dir, steps, profile, script, args):
    from .recorder import recording

    def stop(rec):
        if rec.steps >= steps:
            raise _Enough(0)

    name = os.path.splitext(os.path.basename(script))[0]
    with recording(None, profile, workload=name, step_hook=stop) as rec:
        _run_script(script, args)
    rec.write(os.path.join(out_dir, "trace"))
    context = rec.profile.value("cuda_context_bytes", 0) if rec.profile else 0
    source = rec.profile.source("cuda_context_bytes") if rec.profile else None
    return {"steps": rec.steps, "notes": rec.notes, "peak_live_bytes": rec.peak_live_bytes,
            "context_bytes": context, "context_source": source or "none", "file": "trace"}


def run_gpu(out_dir, steps, script, args):
    import torch

    torch.cuda.memory._record_memory_history(max_entries=10_000_000)
    done = {"steps": 0, "context_bytes": 0}
    path = os.path.join(out_dir, "snapshot.pickle")

    def dump():
        free, total = torch.cuda.mem_get_info()
        done["context_bytes"] = max(0, total - free - torch.cuda.memory_reserved())
        torch.cuda.memory._dump_snapshot(path)

    def on_step(optimizer, a, k):
        done["steps"] += 1
        if done["steps"] >= steps:
            dump()
            raise _Enough(0)

    from torch.optim import optimizer as optim_module

    optim_module.register_optimizer_step_post_hook(on_step)
    if not _run_script(script, args):
        dump()
    return {"steps": done["steps"], "notes": [], "context_bytes": done["context_bytes"],
            "context_source": "measured", "file": "snapshot.pickle"}


def main(argv):
    mode, out_dir, steps, profile, script = argv[:5]
    args = argv[5:]
    if mode == "cpu":
        meta = run_cpu(out_dir, int(steps), profile, script, args)
    else:
        meta = run_gpu(out_dir, int(steps), script, args)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
