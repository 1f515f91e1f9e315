"""Device profiles: what a run on the CPU cannot see of a GPU, one small
JSON file per GPU and PyTorch version in profiles/ (NAME.json).

    {"name": "h200-torch2.11", "gpu": "NVIDIA H200", "torch": "2.11",
     "compute_capability": [9, 0], "total_memory_bytes": ...,
     "values": {KEY: {"value": V, "source": "measured|derived|estimate",
                      "why": "..."}, ...}}

Besides the shipped ones, `python -m gpumem.predict.measure` writes the
user's own GPU's profile to user_dir() (the gpumem cache's profiles/).

"measured": taken on the GPU by gpumem.predict.measure; "derived":
worked out from PyTorch's source; "estimate": neither, until measured.
The keys the recorder uses:

- cublas_workspace_bytes: cuBLAS's workspace, taken from the caching
  allocator at the first matmul of each thread and stream and kept (the
  forward pass and autograd's backward thread take one each).
- cublaslt_workspace_bytes: cuBLASLt's own workspace; 0 when it shares
  cuBLAS's (PyTorch's default).
- sdpa_backend: the backend scaled_dot_product_attention prefers for
  half-precision inputs it can take (flash, efficient, cudnn or math).
- sdpa_backward_scratch_bytes_per_q_element: scratch the attention
  backward takes and gives back within the call, per element of q.
- sdpa_cudnn_forward_scratch_bytes: the workspace cuDNN's attention
  forward takes after its outputs and gives back within the call.
- cuda_context_bytes: device memory the CUDA context and PyTorch's
  kernels take outside the allocator: it is not in a trace, but the
  allocator has that much less to use.
- nccl_communicator_bytes_1rank, _2ranks, _nranks: device memory one
  NCCL communicator takes outside the allocator on each of its ranks, for
  groups of 1, 2 and 3 or more ranks (distributed.py; measured by
  bench/torch/nccl_profile.py).
- nccl_record_stream: whether ProcessGroupNCCL calls record_stream on the
  tensors of its collectives (else it holds them until the work is done)."""

import json
import os

__all__ = ["Profile", "load", "available", "choose", "user_dir", "DIR"]

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
SOURCES = ("measured", "derived", "estimate")
SEVERAL_GPUS = "nccl_"  # keys only jobs on several GPUs use: said where they are used (distributed.py)


class Profile:
    def __init__(self, data, path=None):
        self.path = path
        self.data = data
        self.name = data.get("name") or os.path.splitext(os.path.basename(path or "profile"))[0]
        self.gpu = data.get("gpu", "unknown GPU")
        self.torch = data.get("torch", "?")
        self.capability = tuple(data.get("compute_capability", (9, 0)))
        self.total_memory = int(data.get("total_memory_bytes", 80 << 30))
        self.values = data.get("values", {})
        for key, entry in self.values.items():
            if not isinstance(entry, dict) or "value" not in entry:
                raise ValueError("device profile %s: %s is not {\"value\": ..., \"source\": ...}" % (self.name, key))
            if entry.get("source") not in SOURCES:
                raise ValueError(
                    "device profile %s: %s has source %r (one of %s)"
                    % (self.name, key, entry.get("source"), ", ".join(SOURCES))
                )

    def value(self, key, default=None):
        entry = self.values.get(key)
        return default if entry is None or entry["value"] is None else entry["value"]

    def source(self, key):
        entry = self.values.get(key)
        return entry.get("source") if entry else None

    def notes(self, measured_elsewhere=()):
        """What the recording takes from this profile that was not measured
        (measured_elsewhere: keys the recording measures itself), by where
        each value comes from instead."""
        head = "device profile %s (%s, torch %s)" % (self.name, self.gpu, self.torch)
        rest = {s: sorted(k for k, e in self.values.items() if e.get("source") == s and k not in measured_elsewhere
                          and not k.startswith(SEVERAL_GPUS))
                for s in ("derived", "estimate")}  # fmt: skip
        if not rest["derived"] and not rest["estimate"]:
            return [head + ": all values measured"]
        parts = []
        if rest["derived"]:
            parts.append("taken from PyTorch's source, not measured: " + ", ".join(rest["derived"]))
        if rest["estimate"]:
            parts.append("estimated, not measured: " + ", ".join(rest["estimate"]))
        return [head + ": " + "; ".join(parts)]


def user_dir():
    """Where gpumem.predict.measure puts the user's own profiles:
    $GPUMEM_PROFILE_DIR, else profiles/ in the gpumem cache directory."""
    env = os.environ.get("GPUMEM_PROFILE_DIR")
    if env:
        return env
    from .. import _safefs

    return os.path.join(_safefs.cache_dir(), "profiles")


def _paths():
    """{name: path} of every profile: the user's over the shipped ones."""
    found = {}
    dirs = [DIR]
    try:
        dirs.append(user_dir())
    except OSError:
        pass
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for f in names:
            if f.endswith(".json"):
                found[f[:-5]] = os.path.join(d, f)
    return found


def available():
    """The names of the profiles: the package's and the user's."""
    return sorted(_paths())


def load(name_or_path):
    """A Profile by name ("h200" finds the newest h200-*.json), or from a
    path to a JSON file; None for None or "none". ValueError, in one line,
    for a name no profile has or a file that is not one."""
    if name_or_path is None or name_or_path == "none":
        return None
    if os.path.sep in name_or_path or name_or_path.endswith(".json"):
        path = name_or_path
    else:
        paths = _paths()
        names = sorted(paths)
        match = [n for n in names if n == name_or_path] or [n for n in names if n.startswith(name_or_path + "-")]
        if not match:
            raise ValueError(
                "no device profile %r (there are: %s; a path to a JSON file; or measure this machine's GPU with "
                "python -m gpumem.predict.measure)" % (name_or_path, ", ".join(names) or "none")
            )
        path = paths[match[-1]]
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError("device profile %s: %s" % (path, e.strerror or e)) from None
    except ValueError as e:
        raise ValueError("device profile %s: not JSON: %s" % (path, e)) from None
    if not isinstance(data, dict):
        raise ValueError("device profile %s: not a JSON object" % path)
    return Profile(data, path)


def _card(name):
    """'NVIDIA H100 80GB HBM3' -> 'h100 80gb hbm3': a GPU's name to compare."""
    name = name.strip().lower()
    return name[len("nvidia "):] if name.startswith("nvidia ") else name


def choose(requested, gpu=None, torch_version=None):
    """(Profile, line or None) for --profile: a name or path as load()
    takes it; "auto" (the default): the profile of this machine's GPU
    (gpu: its name, None when there is none), the one of the same torch
    version first, else the newest H200 one. The line says what the
    profile stands for where it is not this machine's GPU and torch."""
    mm = ".".join((torch_version or "").split("+")[0].split(".")[:2])
    if requested != "auto":
        prof = load(requested)
    else:
        prof = None
        if gpu:
            mine = [load(n) for n in available()]
            mine = [p for p in mine if _card(p.gpu) == _card(gpu)]
            mine.sort(key=lambda p: (p.torch == mm, p.name))
            prof = mine[-1] if mine else None
        if prof is None:
            prof = load("h200")
    if prof is None:
        return None, None
    differs = []
    if gpu is None:
        differs.append("this machine has no GPU")
    elif _card(prof.gpu) != _card(gpu):
        differs.append("this machine's GPU is %s" % gpu)
    if mm and prof.torch != mm:
        differs.append("its torch is %s" % mm)
    if not differs:
        return prof, None
    line = "device profile %s stands for an %s with torch %s (%s): for another card, --profile NAME or a file from " \
           "python -m gpumem.predict.measure run on it" % (prof.name, prof.gpu, prof.torch, "; ".join(differs))
    return prof, line


# PyTorch's SDPBackend numbering (torch.nn.attention.SDPBackend).
_BACKENDS = {"math": 0, "flash": 1, "efficient": 2, "cudnn": 3}


def sdpa_backend(torch, profile, recording, q, k, v, mask=None, enable_gqa=False):
    """The backend scaled_dot_product_attention runs for these inputs on
    the profile's GPU: its preferred backend where that backend's main
    constraints hold (half precision for flash and cudnn, no mask for
    flash, equal head dimensions a multiple of 8 up to 256, key and value
    heads fewer than the query's only with enable_gqa and only for flash
    and cudnn, no mask that requires grad), else the others in PyTorch's
    order (flash, efficient, math); backends the job turned off
    (torch.backends.cuda.enable_*_sdp) are skipped."""
    enabled = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": True,
    }
    half = q.dtype in (torch.float16, torch.bfloat16)
    dense = q.dim() == k.dim() == v.dim() == 4
    dims_ok = q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    same_heads = dense and q.shape[1] == k.shape[1] == v.shape[1]
    gqa = dense and enable_gqa and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
    mask_ok = mask is None or not mask.requires_grad  # a learned bias (T5's) runs the math backend
    fits = {
        "flash": half and mask is None and dims_ok and (same_heads or gqa),
        "cudnn": half and dims_ok and (same_heads or gqa) and mask_ok,
        "efficient": dims_ok and same_heads and mask_ok,
        "math": True,
    }
    preferred = profile.value("sdpa_backend", "flash") if profile is not None else "flash"
    order = [preferred] + [b for b in ("flash", "efficient", "math") if b != preferred]
    for b in order:
        if fits.get(b) and enabled.get(b):
            if b == "math" and dense:
                recording.note("scaled_dot_product_attention ran its math backend (no fused kernel takes these inputs)")
            return b
    return "math"


def sdpa_choice(torch, profile, recording, args, kwargs):
    """aten._fused_sdp_choice for fake CUDA tensors (what compiled code
    asks): sdpa_backend's answer in PyTorch's SDPBackend numbering."""
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    gqa = kwargs.get("enable_gqa", False)  # keyword-only in its schema
    return _BACKENDS[sdpa_backend(torch, profile, recording, q, k, v, mask, gqa)]
