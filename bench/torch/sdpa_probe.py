"""Which attention kernel scaled_dot_product_attention runs on this GPU, against
the one the CPU recorder picks from its device profile
(gpumem.predict.profiles.sdpa_backend), invocation by invocation, on the jobs
of bench/torch/predict_jobs.py.

    python3 bench/torch/sdpa_probe.py [--profile h200] [--batch 2] [JOB ...]

Each job runs one step on the GPU at --batch. Each time
torch.nn.functional.scaled_dot_product_attention runs on CUDA tensors, the
probe asks PyTorch's own choice (aten._fused_sdp_choice, for the inputs as
autocast casts them) and the profile's; one line per distinct kind of
invocation (dtype, shapes, mask, grad, GQA) gives both and how often it
came, and the last line counts those where they differ. Exit status 1 when
any does.
"""

import collections
import sys

from probes import setup, step_under

BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


class _Notes:
    def note(self, text):
        pass


def probe(torch, profile, job, batch):
    from torch.overrides import TorchFunctionMode

    from gpumem.predict import profiles
    from gpumem.predict.recorder import additive_mask, autocast_sdpa_inputs, sdpa_arguments

    sdpa = torch._C._nn.scaled_dot_product_attention
    seen = collections.Counter()

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is sdpa:
                q, k, v, mask, dropout, causal, scale, gqa = sdpa_arguments(args, kwargs)
                if q.is_cuda and q.dim() == 4:
                    # the kernel is chosen for the inputs autocast hands it
                    q, k, v, mask = autocast_sdpa_inputs(torch, q, k, v, mask)
                    choice_mask = additive_mask(torch, mask, q.dtype)
                    real = torch.ops.aten._fused_sdp_choice(
                        q, k, v, choice_mask, dropout, causal, scale=scale, enable_gqa=bool(gqa)
                    )
                    mine = profiles.sdpa_backend(torch, profile, _Notes(), q, k, v, choice_mask, bool(gqa))
                    kind = (
                        job, str(q.dtype).replace("torch.", ""), tuple(q.shape), tuple(k.shape),
                        None if mask is None else (str(mask.dtype).replace("torch.", ""), tuple(mask.shape),
                                                   mask.requires_grad),
                        torch.is_grad_enabled() and q.requires_grad, bool(causal), bool(gqa), float(dropout),
                        BACKENDS.get(int(real), str(real)), mine,
                    )  # fmt: skip
                    seen[kind] += 1
            return func(*args, **kwargs)

    step_under(torch, job, batch, Spy())
    return seen


def main():
    args, torch, profile = setup("sdpa_probe", __doc__, 2)
    differ = total = 0
    print("job | dtype | q | k | mask (dtype, shape, grad) | grad | causal | gqa | dropout | pytorch | profile | times")
    for job in args.jobs:
        try:
            seen = probe(torch, profile, job, args.batch)
        except Exception as e:  # noqa: BLE001 (a job that fails is reported, the others still run)
            print("%s | failed: %s: %s" % (job, type(e).__name__, str(e).splitlines()[0][:200]))
            continue
        for kind, n in sorted(seen.items(), key=str):
            print(" | ".join(map(str, kind + (n,))) + ("" if kind[-2] == kind[-1] else "   <- differs"))
            total += n
            differ += n if kind[-2] != kind[-1] else 0
    print("%d of %d invocations: the profile's backend differs from PyTorch's on %s"
          % (differ, total, torch.cuda.get_device_name()))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
