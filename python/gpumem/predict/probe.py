"""Convolutions run for real on the GPU, at the shapes a fake run meets
them, for the memory they take inside the call.

cuDNN picks a convolution's algorithm by problem size and device, and the
call takes that algorithm's workspace from the caching allocator and gives
it back before it returns. On PyTorch's cuDNN path a problem's first
call allocates the largest workspace among the plans it may try, later
calls only the chosen plan's (Conv_v8.cpp: generate_and_filter_plans, then
the plan cache); a depthwise convolution may not reach cuDNN at all. None
of this can be read from shapes on a CPU: the workspaces of ViT-B/16's
patch embedding go from 6.4 MiB at batch 4 to 144 MiB at 64 on an H200,
and PyTorch's allocator fragments on them.

So where the recorder runs on a machine whose GPU is the one its device
profile describes, each convolution (forward and backward) it meets is
also run for real: on tensors of the same sizes, strides, storage offsets
and dtypes, with PyTorch's allocation history on around the call. What
the call allocates and frees, in its order, outputs and workspaces alike,
goes into the trace in place of the outputs alone. Each problem is run
twice when first met: the first call's sequence stands for its first
occurrence in the job, the second's for every later one. PyTorch's own
plan cache lives in this process too, so a problem that PyTorch takes for
one already planned gives a first call like a later one, as in the job.

    probe = ConvProbe(torch)                  # before the recording patches torch.cuda
    steps = probe.steps(func, args, kwargs, fake_out)
    # [("out", i) | ("a", k, size) | ("f", k)], or None (probe.why says why)

Only the memory is used: inputs hold zeros, the results are thrown away.
A call that cannot run (out of memory at that size, an error) gives None
and the recorder falls back to its outputs alone, with a note."""

import inspect

__all__ = ["ConvProbe", "ProbeError", "sequence_of"]

# Allocation history entries of one watched call: a convolution makes a
# few; far more means something else ran (an error, not a silent trace).
MAX_ENTRIES = 10_000


class ProbeError(RuntimeError):
    """The probe cannot run here; the text says why."""


def sequence_of(entries, outputs):
    """A watched call's allocation history (entries after the start
    marker: dicts with action, addr, size) as steps: ("out", i) where the
    call allocated the storage of flat output i (outputs: {data_ptr: i}),
    ("a", k, size) for its k-th allocation that it gave back within the
    call, ("f", k) where it did. None when an allocation the call kept is
    no output's (something this model does not know)."""
    steps, live, made = [], {}, 0
    for e in entries:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = made
            steps.append(["a", made, int(e.get("size", 0)), addr])
            made += 1
        elif action == "free_requested" and addr in live:
            steps.append(["f", live.pop(addr)])
    out = []
    for s in steps:
        if s[0] == "a" and s[3] in live and live[s[3]] == s[1]:
            i = outputs.get(s[3])
            if i is None:
                return None
            out.append(("out", i))
        elif s[0] == "a":
            out.append(("a", s[1], s[2]))
        else:
            out.append(("f", s[1]))
    return out


class ConvProbe:
    """Runs convolutions for real and remembers each problem's two
    sequences (first call, later calls). run: a replacement for the GPU
    (tests): run(func, args, kwargs, fake_out) -> (first, later)."""

    def __init__(self, torch, run=None):
        self.torch = torch
        self.why = None
        self.mismatched = []  # outputs whose real layout differs from the fake one's
        self._seen = {}  # problem -> [first, later, times met], or the text of why it could not run
        self._run = run
        if run is None:
            if not torch.cuda.is_available():
                raise ProbeError("no GPU is visible")
            # (the recording replaces these torch.cuda functions; the probe needs the real ones)
            torch.cuda.init()
            self._sync = torch.cuda.synchronize
            self._history = torch.cuda.memory._record_memory_history
            self._snapshot = torch.cuda.memory._snapshot
            impl = getattr(torch.cuda.memory, "_record_memory_history_impl", None)
            params = inspect.signature(impl).parameters if impl is not None else {}
            self._clear = {"clear_history": True} if "clear_history" in params else {}
            self._device = torch.cuda.current_device()
            self.device_name = torch.cuda.get_device_name(self._device)
            self._run = self._on_gpu

    # -- what the recorder asks ---------------------------------------------
    def steps(self, func, args, kwargs, fake_out):
        """The call's steps as the job makes them at this occurrence, or
        None (self.why says why)."""
        key = self._problem(func, args, kwargs)
        seen = self._seen.get(key)
        if seen is None:
            try:
                first, later = self._run(func, args, kwargs, fake_out)
                seen = [first, later, 0] if first is not None and later is not None else \
                    "an allocation the call kept is none of its outputs"
            except Exception as e:  # noqa: BLE001 (any failure falls back to the outputs alone, named)
                seen = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self._seen[key] = seen  # (a problem that failed is not run again)
        if isinstance(seen, str):
            self.why = seen
            return None
        seen[2] += 1
        return seen[0] if seen[2] == 1 else seen[1]

    def _problem(self, func, args, kwargs):
        torch = self.torch
        from torch.utils._pytree import tree_flatten

        parts = [str(func)]
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                parts.append((tuple(a.shape), tuple(a.stride()), a.storage_offset(), str(a.dtype)))
            else:
                parts.append(repr(a))
        b = torch.backends.cudnn
        parts.append((b.enabled, b.benchmark, b.deterministic, b.allow_tf32))
        return tuple(parts)

    # -- the GPU ----------------------------------------------------------------
    def _real(self, t):
        """A real CUDA tensor laid out as the fake t: its storage's size,
        offset, sizes and strides (cuDNN's plans depend on alignment)."""
        torch = self.torch
        storage = torch.zeros(t.untyped_storage().nbytes(), dtype=torch.uint8, device="cuda").untyped_storage()
        real = torch.empty((0,), dtype=t.dtype, device="cuda")
        real.set_(storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        return real

    def _watched(self, func, args, kwargs, fake_flat):
        torch = self.torch
        from torch.utils._pytree import tree_flatten

        self._sync()
        self._history(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES, **self._clear)
        marker = torch.empty(1, dtype=torch.uint8, device="cuda")
        try:
            out = func(*args, **kwargs)
            self._sync()
            traces = self._snapshot()["device_traces"][self._device]
        finally:
            self._history(enabled=None)
        start = max((i for i, e in enumerate(traces) if e.get("action") == "alloc"
                     and e.get("addr") == marker.data_ptr()), default=None)  # fmt: skip
        del marker
        if start is None or len(traces) >= MAX_ENTRIES:
            raise ProbeError("the allocation history did not hold the call")
        outputs = {}
        for i, (real, fake) in enumerate(zip(tree_flatten(out)[0], fake_flat)):
            if not isinstance(real, torch.Tensor) or not real.is_cuda or not real.untyped_storage().nbytes():
                continue
            if not isinstance(fake, torch.Tensor) or fake.untyped_storage().nbytes() != real.untyped_storage().nbytes():
                raise ProbeError("output %d has %d bytes on the GPU, %s in the recording" % (
                    i, real.untyped_storage().nbytes(),
                    fake.untyped_storage().nbytes() if isinstance(fake, torch.Tensor) else "none"))
            differ = (str(func), i, tuple(real.stride()), tuple(fake.stride()))
            if differ[2] != differ[3] and differ not in self.mismatched:  # (each problem is watched twice)
                self.mismatched.append(differ)
            outputs[real.untyped_storage().data_ptr()] = i
        return sequence_of(traces[start + 1:], outputs)

    def _on_gpu(self, func, args, kwargs, fake_out):
        torch = self.torch
        from torch.utils._pytree import tree_flatten, tree_map

        from .recorder import _no_modes

        with _no_modes(), torch.no_grad():
            real = tree_map(lambda a: self._real(a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
            fake_flat = tree_flatten(fake_out)[0]
            first = self._watched(func, real[0], real[1], fake_flat)
            later = self._watched(func, real[0], real[1], fake_flat)
            del real
        return first, later
