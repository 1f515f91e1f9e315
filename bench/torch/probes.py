"""What bench/torch/sdpa_probe.py and reduce_probe.py share: their command
line, and one step of a job of bench/torch/predict_jobs.py on the GPU with
a mode watching it."""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))


def setup(name, doc, batch):
    """Parses --profile, --batch (default batch) and the jobs; returns (args
    with .jobs filled in, torch, the device profile). Exits where there is
    no GPU."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("jobs", nargs="*")
    args = ap.parse_args()
    import torch

    import predict_jobs
    from gpumem.predict import profiles

    if not torch.cuda.is_available():
        sys.exit("%s: needs a GPU" % name)
    args.jobs = args.jobs or list(predict_jobs.JOBS)
    return args, torch, profiles.load(args.profile)


def step_under(torch, job, batch, mode):
    """One step of job at batch on the GPU under mode (a dispatch or function
    mode), then its memory given back."""
    import predict_jobs

    model, step, opt = predict_jobs.build(torch, job, batch)
    with mode:
        step(opt)
    torch.cuda.synchronize()
    del model, step, opt
    torch.cuda.empty_cache()
