"""What a torch.fft transform allocates on the GPU besides its output: each
case runs once to warm cuFFT's plan cache, then again under PyTorch's
allocation history, and prints the allocations the call made with their
sizes, next to its input's and output's bytes. The CPU recorder does not
make cuFFT's workspaces (a note says so); this is what they are.

    python3 bench/torch/fft_workspace_probe.py [--json FILE]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python"))
from gpumem import _safefs  # noqa: E402 (files written as gpumem writes its own)

CASES = [
    # (name, function, input shape, dtype)
    ("rfft2 32x32x64x64", lambda x: torch.fft.rfft2(x), (32, 32, 64, 64), torch.float32),
    ("rfft2 64x32x128x128", lambda x: torch.fft.rfft2(x), (64, 32, 128, 128), torch.float32),
    ("irfft2 64x32x128x65", lambda x: torch.fft.irfft2(x, s=(128, 128)), (64, 32, 128, 65), torch.complex64),
    ("fft2 64x32x128x128", lambda x: torch.fft.fft2(x), (64, 32, 128, 128), torch.complex64),
    ("rfft 256x65536", lambda x: torch.fft.rfft(x), (256, 65536), torch.float32),
    ("rfft 256x60000", lambda x: torch.fft.rfft(x), (256, 60000), torch.float32),
    ("fftn 16x64x64x64", lambda x: torch.fft.fftn(x, dim=(1, 2, 3)), (16, 64, 64, 64), torch.complex64),
    ("stft 64x16000 n510", lambda x: torch.stft(x, 510, hop_length=128, window=torch.hann_window(510, device="cuda"),
                                                return_complex=True), (64, 16000), torch.float32),
]


def allocations_of(fn, x):
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    out = fn(x)
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    made = [e["size"] for e in trace if e["action"] == "alloc"]
    freed = {e["addr"] for e in trace if e["action"] == "free_requested"}
    transient = [e["size"] for e in trace if e["action"] == "alloc" and e["addr"] in freed]
    return out, made, transient


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    a = ap.parse_args()
    print("%s, torch %s" % (torch.cuda.get_device_name(), torch.__version__))
    rows = []
    for name, fn, shape, dtype in CASES:
        x = torch.randn(shape, dtype=dtype, device="cuda")
        fn(x)  # (the plan made and cached)
        out, made, transient = allocations_of(fn, x)
        row = {"case": name, "input_bytes": x.nbytes, "output_bytes": out.nbytes, "allocations": made,
               "freed_within": transient}
        rows.append(row)
        print("%-22s input %11d  output %11d  allocations %s  freed within the call %s"
              % (name, x.nbytes, out.nbytes, made, transient))
        del x, out
    if a.json:
        _safefs.write_file(a.json, json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
