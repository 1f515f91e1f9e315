"""A PyTorch job's CUDA allocations, recorded on a machine with no GPU.

The job runs on fake CUDA tensors (torch's FakeTensorMode): every tensor
that would live on the GPU has its shape, dtype, strides and storage, but
no memory and no values. A dispatch mode watches every operation below
autograd and records each new CUDA storage (its nbytes: the size the CUDA
caching allocator is asked for) when an operation first returns it, and
its free when the storage dies: a finalizer on the storage runs when its
last reference goes, as the caching allocator's free does. Views share
their base's storage, autograd's saved tensors, optimizer state and
gradients keep theirs alive, so lifetimes come out as on the GPU.

Tensors on the CPU stay real: operations whose inputs are all real CPU
tensors run for real (data loading, AdamW's step counters, values read
with .item() in a constructor). CPU tensors of more than LAZY_NUMEL
elements made by factory functions (a model's weights built on the CPU
before .to("cuda")) are fake too, so that a large model costs no host
memory.

What a CPU run cannot see (values of CUDA tensors, workspaces that
cuBLAS, cuDNN and attention kernels take inside an operation) comes from
a device profile (profiles.py) or is named in the recording's notes. The
staging buffers of reductions that split rows across thread blocks follow
from shapes and the profile's multiprocessor count (reductions.py).

    rec = record_step(build_model, make_batch, step_fn, batch_size=2)
    rec.write("b2.trace")

Needs PyTorch (the CPU build will do)."""

import contextlib
import ctypes
import functools
import os
import sys
import threading
import types
import weakref

from . import profiles, reductions
from .values import UNKNOWN, KnownValues, leaves

__all__ = ["Recording", "RecorderError", "record_step", "recording", "LAZY_NUMEL"]

# CPU tensors made by factory functions with more elements than this are fake.
LAZY_NUMEL = 1 << 16
# A fake CUDA tensor copied to the CPU with grad off, of at most this many
# elements, comes back as a real CPU tensor (host copy, in the tracker).
HOST_COPY_NUMEL = 1 << 22
# A call site reading placeholders more often than this is a loop that waits
# for a value on the GPU (a stop condition): an error, not a hang.
PLACEHOLDER_READS_MAX = 5000


class RecorderError(RuntimeError):
    """The job cannot be recorded on fake CUDA tensors; the text says why."""


class NoBatch(RecorderError):
    """A DataLoader with drop_last=True over fewer items than its batch size:
    at this batch the script gets no batch at all (items: the dataset's
    length, the largest batch it runs)."""

    def __init__(self, text, items):
        super().__init__(text)
        self.items = items


def _torch():
    try:
        import torch
    except ImportError:
        raise RecorderError("gpumem.predict needs PyTorch (pip install torch: the CPU build will do)") from None
    return torch


def _role_text(role):
    """A role as the trace's ROLE field takes it: printable ASCII without
    blanks, at most 160 characters ('?' for anything else); None for none."""
    if not role:
        return None
    if type(role) is str:
        return _role_string(role)  # (the same few operator names at every allocation)
    text = "".join(c if "!" <= c <= "~" else "?" for c in str(role))[:160]
    return text or None


@functools.lru_cache(maxsize=4096)
def _role_string(role):
    text = "".join(c if "!" <= c <= "~" else "?" for c in role)[:160]
    return text or None


class AllocatorStats:
    """What torch.cuda.memory_stats() says while a script is recorded, in
    PyTorch's keys (a script that prints memory_summary() or its own peak):
    the recording's live allocations, each in the pool PyTorch puts it in
    (small: up to 1 MiB) and rounded as PyTorch rounds it (512 bytes).
    Reserved memory is what the allocator under study makes of these
    requests, known only once the recording is replayed, so reserved bytes
    and segments say the live ones, as torch.cuda.memory_reserved() does
    here; nothing is ever split, retried or out of memory."""

    POOLS = ("all", "large_pool", "small_pool")
    FIGURES = ("current", "peak", "allocated", "freed")
    SMALL = 1 << 20  # PyTorch's kSmallSize

    def __init__(self):
        self._stats = {key: self._zero() for key in ("allocated_bytes", "requested_bytes", "allocation")}

    def _zero(self):
        return {pool: dict.fromkeys(self.FIGURES, 0) for pool in self.POOLS}

    def _add(self, size, sign):
        pool = "small_pool" if size <= self.SMALL else "large_pool"
        rounded = max(512, (size + 511) // 512 * 512)
        for key, n in (("allocated_bytes", rounded), ("requested_bytes", size), ("allocation", 1)):
            for p in ("all", pool):
                c = self._stats[key][p]
                c["current"] += sign * n
                c["allocated" if sign > 0 else "freed"] += n
                c["peak"] = max(c["peak"], c["current"])

    def alloc(self, size):
        self._add(size, 1)

    def free(self, size):
        self._add(size, -1)

    def current(self, key="allocated_bytes"):
        return self._stats[key]["all"]["current"]

    def peak(self, key="allocated_bytes"):
        return self._stats[key]["all"]["peak"]

    def reset_peak(self):
        for pools in self._stats.values():
            for c in pools.values():
                c["peak"] = c["current"]

    def reset_accumulated(self):
        for pools in self._stats.values():
            for c in pools.values():
                c["allocated"] = c["freed"] = 0

    def nested(self):
        """torch._C._cuda_memoryStats's shape: {key: {pool: {figure: n}}, counter: n}."""
        copy = lambda key: {p: dict(c) for p, c in self._stats[key].items()}  # noqa: E731
        count = self._stats["allocation"]["all"]
        return {
            "allocated_bytes": copy("allocated_bytes"),
            "active_bytes": copy("allocated_bytes"),
            "requested_bytes": copy("requested_bytes"),
            "reserved_bytes": copy("allocated_bytes"),
            "inactive_split_bytes": self._zero(),
            "allocation": copy("allocation"),
            "active": copy("allocation"),
            "segment": copy("allocation"),
            "inactive_split": self._zero(),
            "oversize_allocations": dict.fromkeys(self.FIGURES, 0),
            "oversize_segments": dict.fromkeys(self.FIGURES, 0),
            "num_alloc_retries": 0,
            "num_ooms": 0,
            "num_sync_all_streams": 0,
            "num_device_alloc": count["allocated"],
            "num_device_free": count["freed"],
            "max_split_size": -1,
        }  # fmt: skip


class Recording:
    """The allocation sequence of one recorded run.

    events: ("a", id, size, stream), ("f", id), ("r", id, stream) and
    ("s", step) tuples in order; notes: what the recorder could not see or had to assume, one
    line each (carried into the trace as '# note:' comments)."""

    def __init__(self, batch_size=None, profile=None, workload="job", source=None):
        self.events = []
        self.source = source  # the '# source' line's text; None: the CPU recorder
        self.notes = []
        self.memory_fraction = None  # the script's torch.cuda.set_per_process_memory_fraction, if any
        self.dataset_items = None  # the fewest items of a DataLoader's dataset shorter than its batch
        self.batch_size = batch_size
        self.profile = profile
        self.workload = workload
        self.steps = 0
        # each optimizer that has stepped (a hand-written update counts as one): a loop
        # with several (a GAN's two) takes one step of each per iteration
        self.optimizers = set()
        self._next_id = 0
        self._live = {}  # id -> size
        self._live_bytes = 0
        self.peak_live_bytes = 0
        self.stats = AllocatorStats()  # torch.cuda.memory_stats() while recording
        self.closed = False  # what dies after the session is not a free of the job's
        self._lock = threading.Lock()
        self._patches = []  # (object, attribute, value before) set while recording
        self._generate_patched = False
        self._compiled_patched = False
        # what makes the allocations now: the operator running (set by the
        # dispatch mode), written as each allocation's role so that the
        # recordings at two batches are aligned by what made each request
        self.role = None
        self.in_optimizer = False  # inside an optimizer's step()
        self.hand_step = lambda: None  # a step ended with no optimizer (set by recording())
        self.numpy_of = None  # t.numpy() of a fake CPU tensor (set by the dispatch mode)

    # -- building -------------------------------------------------------
    def alloc(self, size, stream=0, role=None):
        with self._lock:
            i = self._next_id
            self._next_id += 1
            self.events.append(("a", i, int(size), stream, _role_text(role or self.role)))
            self._live[i] = int(size)
            self._live_bytes += int(size)
            self.peak_live_bytes = max(self.peak_live_bytes, self._live_bytes)
            self.stats.alloc(int(size))
            return i

    def free(self, i):
        with self._lock:
            size = self._live.pop(i, None)
            if size is None:
                return
            self._live_bytes -= size
            self.stats.free(size)
            self.events.append(("f", i))

    def use(self, i, stream):
        """The live allocation i is used on stream (record_stream)."""
        with self._lock:
            if i in self._live:
                self.events.append(("r", i, stream))

    def step(self):
        with self._lock:
            self.steps += 1
            self.events.append(("s", self.steps))

    def note(self, text):
        if text not in self.notes:
            self.notes.append(text)

    def patch(self, obj, attr, value):
        """Sets obj.attr for the rest of the recording (put back at its end)."""
        self._patches.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
        setattr(obj, attr, value)

    def unpatch(self):
        while self._patches:
            obj, attr, old = self._patches.pop()
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)

    # -- reading --------------------------------------------------------
    @property
    def live_bytes(self):
        """Bytes of the allocations alive now (at the end, once recorded)."""
        return self._live_bytes

    def allocations(self):
        """[(id, size, freed)] in allocation order."""
        freed = {e[1] for e in self.events if e[0] == "f"}
        return [(e[1], e[2], e[1] in freed) for e in self.events if e[0] == "a"]

    def lines(self):
        head = [
            "# gpumem-trace v1",
            "# workload %s" % self.workload,
            "# source %s" % (self.source or "gpumem.predict CPU recorder (fake CUDA tensors), torch %s, device profile %s"
                             % (_torch().__version__, self.profile.name if self.profile else "none")),
        ]
        if self.batch_size is not None:
            head.append("# batch_size %d" % self.batch_size)
        head += ["# note: %s" % n.replace("\n", " ") for n in self.notes]
        body = []
        for e in self.events:
            if e[0] == "a":
                body.append("a %d %d %d %s" % e[1:] if e[4] else "a %d %d %d" % e[1:4])
            elif e[0] == "f":
                body.append("f %d" % e[1])
            elif e[0] == "r":
                body.append("r %d %d" % (e[1], e[2]))
            else:
                body.append("# step %d" % e[1])
        return head + body

    def write(self, path):
        """Writes the trace (traces/README.md) to path, never through a link
        or over another user's file (gpumem._safefs.write_file); returns
        path."""
        from .. import _safefs

        return _safefs.write_file(path, "\n".join(self.lines()) + "\n")


# ---- CUDA tensors on a build of PyTorch without CUDA ----------------------

_GUARD_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"


_guard = []  # the guard registered for CUDA, kept alive


# The PrivateUse1 name a CUDA build with no GPU records under (see _allow_fake_cuda).
_NO_ACCELERATOR = "gpumem_no_accelerator"


def _allow_fake_cuda(torch):
    """Tensors that say device cuda need a device guard for CUDA, which a
    CPU build of PyTorch does not register (indexing, copies and .to()
    ask for one, and autograd's engine gives CUDA work a thread of its own
    only for a device type with a guard). Registers a no-op guard for
    CUDA, made through the hook PyTorch offers Python backends
    (torch._C._acc) and moved to CUDA's slot of the guard registry: the
    fake tensors never touch a device. A CUDA build has its own guard,
    which FakeTensorMode replaces with a no-op one where no GPU is
    present; but its autograd engine then stashes each CUDA device's
    stream before a backward, and asking for the first one fails with no
    GPU ("hasPrimaryContext expects a valid device index"). The engine
    looks for streams on the device type it takes for the accelerator,
    and a named PrivateUse1 backend is taken first: so with no GPU one is
    named (for the rest of the process: PyTorch cannot take it back), no
    tensor lives there, and the backward runs stream-free as on a CPU
    build."""
    if torch.cuda._is_compiled():
        torch._C._ensureCUDADeviceGuardSet()
        named = getattr(torch._C, "_get_privateuse1_backend_name", None)
        if named is not None and torch._C._cuda_getDeviceCount() == 0:
            name = named()
            if name == "privateuseone":
                torch.utils.rename_privateuse1_backend(_NO_ACCELERATOR)
                # What asks torch.accelerator hears that none is there.
                module = types.ModuleType("torch." + _NO_ACCELERATOR)
                module.is_available = lambda: False
                module.device_count = lambda: 0
                module.is_initialized = lambda: False
                module.current_device = lambda: 0
                torch._register_device_module(_NO_ACCELERATOR, module)
            elif name != _NO_ACCELERATOR:
                raise RecorderError(
                    "a PrivateUse1 backend (%s) is registered in this CUDA build with no GPU: fake CUDA "
                    "tensors cannot run a backward beside it" % name
                )
        return
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = [n for n in ("libc10.so", "libc10.dylib") if os.path.exists(os.path.join(libdir, n))]
    pu1 = 20  # c10::DeviceType::PrivateUse1
    try:
        lib = ctypes.CDLL(os.path.join(libdir, names[0]))
        registry = (ctypes.c_void_p * (pu1 + 1)).in_dll(lib, _GUARD_REGISTRY)
        if registry[1]:
            return
        if registry[pu1]:
            raise RecorderError("a PrivateUse1 backend is registered; its guard cannot be borrowed")

        class CudaGuard(torch._C._acc.DeviceGuard):
            def type_(self):
                return torch._C._autograd.DeviceType.CUDA

        guard = CudaGuard()
        torch._C._acc.register_python_privateuseone_device_guard(guard)
        registry[1], registry[pu1] = registry[pu1], None
        _guard.append(guard)
    except (IndexError, OSError, ValueError, AttributeError) as e:
        raise RecorderError(
            "gpumem.predict: cannot make fake CUDA tensors with this build of PyTorch (%s): %s"
            % (torch.__version__, e)
        ) from None


def _cuda0(device):
    """A device argument as given, with any CUDA device made cuda:0 (the
    fake tensors live on one device; "cuda" without an index is not moved
    to by .to() on a build without CUDA). A bare index is the current
    accelerator's, which is the fake GPU (a CPU build has none, and
    torch.device(0) fails there: transformers' device_map="auto" gives
    0)."""
    torch = _torch()
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", 0)
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type == "cuda":
            return torch.device("cuda", 0)
    return device


class _Placement:
    """A TorchFunctionMode: .to("cuda"), .cuda() and friends land on the
    fake cuda:0; pinning and record_stream do nothing."""

    def __new__(cls, recording):
        torch = _torch()
        from torch.overrides import TorchFunctionMode

        Tensor = torch.Tensor

        class Placement(TorchFunctionMode):
            def __torch_function__(self, func, types_, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if func is torch.device and len(args) == 1 and not kwargs:
                    return _cuda0(args[0]) if isinstance(args[0], int) else func(*args)
                if func is Tensor.to:
                    args = tuple(_cuda0(a) for a in args)
                    if "device" in kwargs:
                        kwargs["device"] = _cuda0(kwargs["device"])
                elif func is Tensor.cuda:
                    self_ = args[0]
                    kwargs.pop("device", None)
                    return self_.to(torch.device("cuda", 0), **kwargs)
                elif func in (Tensor.pin_memory,):
                    return args[0]
                elif func is Tensor.is_pinned:
                    return False
                elif func is Tensor.record_stream:
                    recording.note("record_stream() calls were ignored: every allocation is on the default stream")
                    return None
                elif func is Tensor.numpy and recording.numpy_of is not None and _fake_on_cpu(args[0]):
                    return recording.numpy_of(args[0])
                elif "device" in kwargs:
                    kwargs["device"] = _cuda0(kwargs["device"])
                return func(*args, **kwargs)

        return Placement()


# ---- the recorder's dispatch mode -----------------------------------------

_MATMULS = (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
    "_addmm_activation", "_scaled_mm", "_int_mm",
)  # fmt: skip


def _user_frame():
    """'file:line' of the innermost frame outside torch and this package."""
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(_torch().__file__)
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(torch_dir) and not path.startswith(here) and "<frozen" not in path:
            return "%s:%d" % (os.path.basename(path), f.f_lineno)
        f = f.f_back
    return "?"


COMPILED_NOTE = (
    "torch.compile: the compiled code was recorded as eager PyTorch (Dynamo compiles nothing while the "
    "recorder's dispatch modes are on); Inductor's fused kernels on the GPU usually keep fewer intermediate "
    "tensors, so for the compiled parts the recording holds eager's activations and the figures are likely high"
)


def _compiled_code_runs_eager(recording):
    """Code compiled with torch.compile runs eagerly under a dispatch mode:
    Dynamo lets the frames through uncompiled. Recorded as it ran, and said
    once it runs: a compiled module (OptimizedModule) called, a function
    compiled during the recording called, a module compiled in place."""
    torch = _torch()

    def patch_optimized_module():
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        cls = getattr(eval_frame, "OptimizedModule", None)
        if cls is None or recording._compiled_patched:
            return
        recording._compiled_patched = True
        call = cls.__call__

        def noted_call(self, *args, **kwargs):
            recording.note(COMPILED_NOTE)
            return call(self, *args, **kwargs)

        recording.patch(cls, "__call__", noted_call)

    real_compile = torch.compile

    def compile(model=None, *args, **kwargs):
        if model is None:  # (as a decorator with options)
            return lambda fn: compile(fn, *args, **kwargs)
        out = real_compile(model, *args, **kwargs)
        patch_optimized_module()  # (Dynamo is loaded now)
        if isinstance(out, torch.nn.Module) or not callable(out):
            return out

        @functools.wraps(out)
        def noted(*a, **k):
            recording.note(COMPILED_NOTE)
            return out(*a, **k)

        return noted

    module_compile = getattr(torch.nn.Module, "compile", None)

    def compile_in_place(self, *args, **kwargs):
        recording.note(COMPILED_NOTE)
        return module_compile(self, *args, **kwargs)

    recording.patch(torch, "compile", compile)
    if module_compile is not None:
        recording.patch(torch.nn.Module, "compile", compile_in_place)
    patch_optimized_module()


def _transformers_sees_real_tensors(recording):
    """transformers takes a fake tensor for a sign of tracing (torch.export),
    and while tracing it keeps the attention masks it drops on a GPU
    (masking_utils: a mask of no padding is skipped, and with it a Llama's
    keys and values reach the grouped-query kernel instead of being copied
    per head). The job on the GPU has real tensors: so transformers is
    told, for the recording, that none is fake. What it then reads of their
    values is known (values.py) or a placeholder with a note."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    try:
        from transformers.utils import import_utils
    except Exception:  # noqa: BLE001 (a transformers that fails to import is the job's to report)
        return
    if hasattr(import_utils, "is_fake_tensor"):
        recording.patch(import_utils, "is_fake_tensor", lambda *a, **k: False)


def _generate_loop_by_length(recording):
    """transformers' generate() decodes until every sequence has stopped,
    a condition it reads from the GPU (unfinished_sequences.max() == 0),
    which on fake tensors is a placeholder that never says stop. Once
    transformers' generation module is loaded, the loop is made to stop
    where its length criterion (max_length, max_new_tokens) says so, as it
    does when no sequence ends early: the longest generation, whose memory
    is the most. Patched on the first placeholder read, which comes inside
    the loop; the first length check before it is not needed (the length
    is not reached after one token unless max_new_tokens is 1)."""
    gen = sys.modules.get("transformers.generation.utils")
    crit = sys.modules.get("transformers.generation.stopping_criteria")
    if gen is None or crit is None or recording._generate_patched:
        return
    mixin, max_length = getattr(gen, "GenerationMixin", None), getattr(crit, "MaxLengthCriteria", None)
    if mixin is None or max_length is None or not hasattr(mixin, "_has_unfinished_sequences"):
        return
    recording._generate_patched = True
    state = {"done": False}
    length_call = max_length.__call__

    def length_criterion(self, input_ids, scores=None, **kwargs):
        state["done"] = input_ids.shape[-1] >= self.max_length
        return length_call(self, input_ids, scores, **kwargs)

    def has_unfinished(self, this_peer_finished, synced_gpus=False, device=None, *a, **k):
        # (said once generate() runs: a training script imports the module without generating)
        recording.note(
            "generate() ran every sequence to its length limit (max_length, max_new_tokens): when a sequence "
            "ends early (EOS, stop strings) cannot be read from fake tensors, and the longest generation takes "
            "the most memory"
        )
        done, state["done"] = state["done"], False  # the next generate() starts unfinished
        return not done

    recording.patch(max_length, "__call__", length_criterion)
    recording.patch(mixin, "_has_unfinished_sequences", has_unfinished)


def _tracker(recording, fake_mode, profile, probe=None):
    torch = _torch()
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_flatten

    aten = torch.ops.aten
    prim_device = torch.ops.prim.device.default
    matmuls = {getattr(aten, n) for n in _MATMULS if hasattr(aten, n)}
    grouped_mm = aten._grouped_mm.default if hasattr(aten, "_grouped_mm") else None
    sdpa_backward = {
        getattr(aten, n)
        for n in (
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward",
        )
        if hasattr(aten, n)
    }
    factories = {aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default, aten.ones.default,
                 aten.full.default, aten.rand.default, aten.randn.default, aten.empty_like.default,
                 aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                 aten.randn_like.default, aten.rand_like.default, aten.arange.default,
                 aten.arange.start, aten.arange.start_step}  # fmt: skip
    cudnn_attention = {getattr(aten, n) for n in ("_scaled_dot_product_cudnn_attention",) if hasattr(aten, n)}
    conv = {aten.convolution.default, aten.convolution_backward.default}
    fft = {getattr(aten, name).default for name in ("_fft_r2c", "_fft_c2r", "_fft_c2c") if hasattr(aten, name)}
    c2r = aten._fft_c2r.default if hasattr(aten, "_fft_c2r") else None
    rnn_cells = {getattr(aten, name).default for name in ("_thnn_fused_lstm_cell", "_thnn_fused_gru_cell")
                 if hasattr(aten, name)}  # fmt: skip
    scans = {aten.cumsum.default, aten.cumprod.default}
    softmaxes = {aten._softmax.default, aten._log_softmax.default}
    summing = {aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.mean.dim: "mean", aten.mean.default: "mean"}
    live = {}  # storage key -> allocation id
    workspaces = set()
    values = KnownValues(torch)
    writes = {}  # operator -> the indices of the arguments it writes into

    def on_free(key, i):
        live.pop(key, None)
        values.forget(key)
        if not recording.closed:
            recording.free(i)

    def track(out):
        """Records the new CUDA storages among out; returns their keys."""
        new = set()
        for t in leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                continue
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # sparse, nested: no plain storage
            key = s._cdata
            if key in live:
                continue
            n = s.nbytes()
            if n == 0:
                continue  # the caching allocator is not asked for empty storages
            i = recording.alloc(n)
            live[key] = i
            new.add(key)
            weakref.finalize(s, on_free, key, i)
        return new

    recording.storages = live  # (for what frees or re-allocates a storage in place: distributed.py)

    def forget_written(func, args, kwargs):
        if func not in writes:
            writes[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write]  # fmt: skip
        for i, name in writes[func]:
            values.written(leaves(args[i] if i < len(args) else kwargs.get(name)))

    def is_cuda(flat):
        for a in flat:
            if isinstance(a, torch.Tensor) and a.device.type == "cuda":
                return True
            if isinstance(a, torch.device) and a.type == "cuda":
                return True
        return False

    def all_real(flat):
        for a in flat:
            if isinstance(a, FakeTensor):
                return False
            if isinstance(a, torch.device) and a.type != "cpu":
                return False
        return True

    def lazy_factory(func, args, kwargs):
        """A CPU factory call big enough to be fake rather than real."""
        if func not in factories:
            return False
        if func.__name__.endswith("_like"):
            return False  # follows its input
        size = args[0] if args and isinstance(args[0], (list, tuple)) else None
        if size is None:
            return False
        n = 1
        for d in size:
            n *= int(d)
        return n > LAZY_NUMEL

    reads = {}  # call site -> values read there as placeholders

    def on_host(t, dtype, how):
        """A fake tensor's values as a real CPU tensor of dtype: followed
        where known, else zeros, noted as placeholders (how: what read them)."""
        known = values.shadow(t)
        v = 0
        if known is None:
            v = values.of(t)
            if v is UNKNOWN:
                recording.note("values %s at %s are placeholders (0): what depends on them was not seen"
                               % (how, _user_frame()))  # fmt: skip
                v = 0
        with _disable_current_modes():
            return known.to(dtype=dtype).clone() if known is not None else torch.full(tuple(t.shape), v, dtype=dtype)

    def numpy_of(t):
        """t.numpy() of a fake tensor on the CPU, which PyTorch refuses for
        any tensor subclass (a copy to the host larger than host_copy
        makes real)."""
        host = on_host(t, t.dtype, "read from a fake tensor with .numpy()")
        with _disable_current_modes():
            return host.numpy()

    recording.numpy_of = numpy_of

    def host_copy(func, args, kwargs):
        """A fake CUDA tensor copied to the CPU (.cpu(), .to("cpu")) with
        grad off, as a real CPU tensor: its values where they are followed,
        else zeros, noted as placeholders. The GPU's memory is the same
        either way, and what the job does with it on the CPU then runs as
        PyTorch runs it, not through fake tensors at about half a
        millisecond an operator: a pipeline's postprocessing slices
        generate()'s output item by item (about 30 operators an item: 160 s
        for a recording at batch 12,000 on fake tensors). None for any
        other operator and for a tensor larger than HOST_COPY_NUMEL."""
        if func is not aten._to_copy.default or len(args) != 1 or not isinstance(args[0], FakeTensor):
            return None
        t, device = args[0], kwargs.get("device")
        if t.device.type != "cuda" or not isinstance(device, torch.device) or device.type != "cpu":
            return None
        if t.numel() > HOST_COPY_NUMEL or (t.requires_grad and torch.is_grad_enabled()):
            return None
        if set(kwargs) - {"device", "dtype", "layout", "non_blocking", "memory_format"}:
            return None
        return on_host(t, kwargs.get("dtype") or t.dtype, "copied from a fake tensor to the CPU")

    def positions(mask, what):
        """nonzero(mask) on fake tensors: as many rows as the mask has
        nonzero elements where its values are known, else one for every
        element (an upper bound, with a note)."""
        known = values.shadow(mask)
        if known is not None:
            with _disable_current_modes():
                count = int(torch.count_nonzero(known))
        else:
            v = values.of(mask)
            count = mask.numel() if v is UNKNOWN or v else 0
            if v is UNKNOWN:
                recording.note(
                    "%s at %s assumed every element true: its size is an upper bound" % (what, _user_frame())
                )
        return torch.empty((count, mask.dim()), dtype=torch.long, device=mask.device)

    def reduction_scratch(kind, x, dims, out):
        """Records the staging buffer and semaphores a CUDA reduction of x
        over dims (None: all) into out takes and gives back within the call
        (reductions.py), or notes that it could not say."""
        mps = profile.value("multiprocessor_count") if profile is not None else None
        threads = profile.value("max_threads_per_multiprocessor") if profile is not None else None
        if not mps or not threads:
            recording.note(
                "staging buffers of long reductions (taken and given back within the call) are not in the "
                "trace: the device profile has no multiprocessor_count"
            )
            return
        plan = reductions.scratch_of(kind, x, dims, out, mps, threads)
        if plan is None:
            # What is at stake: CUDA's reduction kernels stage one partial
            # result (at most 8 bytes) per output and block, with at most
            # 65535 blocks on an output (the grid's y dimension)
            outputs = max(1, out.numel() if isinstance(out, torch.Tensor) else 1)
            bound = outputs * min(max(1, x.numel() // outputs), 65535) * 8
            recording.note(
                "a %s of a %s tensor of %d elements: its staging buffers, if any (at most %d bytes, given back "
                "within the call), are not in the trace" % (kind, str(x.dtype).replace("torch.", ""), x.numel(), bound)
            )
            return
        held, rounds = plan
        role = "%s_staging" % kind
        kept = [recording.alloc(n, role=role) for n in held if n]
        for sizes in rounds:
            taken = [recording.alloc(n, role=role) for n in sizes if n]
            for i in reversed(taken):
                recording.free(i)
        for i in reversed(kept):
            recording.free(i)

    def probed(func, args, kwargs, out):
        """A convolution run for real on the GPU (probe.py): what it
        allocated and freed, in its order, recorded with the fake outputs'
        storages in place of the real ones'; the new storages' keys. None
        where the probe could not say (noted)."""
        steps = probe.steps(func, args, kwargs, out)
        if steps is None:
            recording.note("a convolution could not be run on the GPU (%s): its workspaces are not in the trace"
                           % probe.why)
            return None
        flat = tree_flatten(out)[0]
        new, ids = set(), {}
        for step in steps:
            if step[0] == "out":
                new |= track(flat[step[1]])
            elif step[0] == "a":
                ids[step[1]] = recording.alloc(step[2])
            else:
                recording.free(ids.pop(step[1]))
        return new | track(out)

    # a step written by hand (below); backwards counts those of this recording only
    hand = types.SimpleNamespace(pending=False, backwards=_engine.backwards)

    def updates_a_parameter(func, args):
        """An in-place write into a leaf tensor that requires grad, with grad
        off and outside autograd and an optimizer: `p -= lr * p.grad`."""
        if torch.is_grad_enabled() or _engine.depth or recording.in_optimizer or not args:
            return False
        t = args[0]
        if not isinstance(t, torch.Tensor) or not t.is_leaf or not t.requires_grad:
            return False
        if func not in writes:
            writes[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write]  # fmt: skip
        return any(i == 0 for i, _ in writes[func])

    class Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            if any(t is not FakeTensor and hasattr(t, "__tensor_flatten__") for t in types_):
                # A tensor subclass that wraps others (DTensor): its own
                # __torch_dispatch__ runs the operator on the tensors inside,
                # with this mode still on, which records their storages.
                return NotImplemented
            if hand.pending and torch.is_grad_enabled() and not _engine.depth:
                # A training loop with no optimizer: the parameters were
                # updated by hand after a backward, and the next pass begins
                hand.pending = False
                recording.hand_step()
            outer = recording.role
            recording.role = func.__name__
            try:
                return self._dispatch(func, args, kwargs or {})
            finally:
                recording.role = outer
                if _engine.backwards > hand.backwards and updates_a_parameter(func, args):
                    hand.pending = True
                    hand.backwards = _engine.backwards

        def _dispatch(self, func, args, kwargs):
            if _in_engine():
                # Autograd's engine syncs streams of accelerator tensors,
                # which a build without CUDA cannot: it is shown them as CPU
                # tensors, and what the backward makes on the CPU goes to
                # cuda (a backward makes nothing on the CPU of its own).
                if func is prim_device:
                    d = func(*args)
                    return torch.device("cpu") if d.type == "cuda" else d
                d = kwargs.get("device")
                if isinstance(d, torch.device) and d.type in ("cpu", "meta"):
                    kwargs = dict(kwargs, device=torch.device("cuda", 0))
            if func is aten.add.Tensor and _accumulation(torch, args, kwargs):
                # On the GPU the engine adds a second gradient into the first
                # in place (autograd's InputBuffer); it does so only for plain
                # tensors, so on fake ones it makes a new one.
                return args[0]
            if func is aten._fused_sdp_choice.default:
                return profiles.sdpa_choice(torch, profile, recording, args, kwargs)
            if func is aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
                if args[0].constant is not None:
                    return args[0].constant.item()
                known = values.of(args[0])
                if known is not UNKNOWN:
                    return known
                site = _user_frame()
                reads[site] = reads.get(site, 0) + 1
                if reads[site] > PLACEHOLDER_READS_MAX:
                    raise RecorderError(
                        "%s read a value of a fake tensor %d times: a loop that runs until a value on the GPU "
                        "says stop never ends on placeholders" % (site, PLACEHOLDER_READS_MAX)
                    )
                _generate_loop_by_length(recording)
                recording.note(
                    "a value read from a fake tensor (.item(), bool(), int()) at %s is a placeholder "
                    "(0): what depends on it was not seen" % site
                )
                return False if args[0].dtype == torch.bool else 0 if not args[0].is_floating_point() else 0.0
            if func is aten.nonzero.default and isinstance(args[0], FakeTensor):
                out = positions(args[0], "nonzero() (boolean masks)")
                track(out)
                return out
            if func.name() == "torchvision::nms" and isinstance(args[0], FakeTensor):
                # The boxes kept depend on their values: all of them, an upper bound.
                recording.note(
                    "torchvision's nms at %s kept every box: its output's size is an upper bound, and the "
                    "kernel's own buffers are not in the trace" % _user_frame()
                )
                out = torch.empty((args[0].size(0),), dtype=torch.long, device=args[0].device)
                track(out)
                return out
            if func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool and isinstance(i, FakeTensor) for i in args[1]
            ):
                indices = []
                for i in args[1]:
                    if i is None or i.dtype != torch.bool:
                        indices.append(i)
                    else:
                        indices.extend(positions(i, "indexing with a boolean mask").unbind(1))
                args = (args[0], indices)
            copied = host_copy(func, args, kwargs)
            if copied is not None:
                return copied
            flat = leaves((args, kwargs))  # (asked of below, many times)
            if all_real(flat) and not lazy_factory(func, args, kwargs):
                with _disable_current_modes():
                    return func(*args, **kwargs)
            forget_written(func, args, kwargs)
            try:
                out = looped = _grouped_mm_by_loop(torch, func, args, kwargs) if func is grouped_mm else None
                if looped is None:
                    out = func(*args, **kwargs)
            except DynamicOutputShapeException:
                raise RecorderError(
                    "%s at %s: its output's size depends on the values of tensors, which fake tensors do "
                    "not have" % (func, _user_frame())
                ) from None
            on_gpu = None  # the storages a convolution run on the GPU made (probe), or None
            if probe is not None and func in conv and is_cuda(flat):
                on_gpu = probed(func, args, kwargs, out)
            new = on_gpu if on_gpu is not None else track(_kernel_order(func, out))
            values.after(func, args, kwargs, out, new, flat)
            if (func.overloadpacket in matmuls or looped is not None) and is_cuda(flat):
                # cuBLAS takes its workspace from the caching allocator at the
                # first matmul of each thread and stream; autograd's backward
                # runs on a thread of its own.
                where = "backward" if _engine.depth else "forward"
                if where not in workspaces and profile is not None and profile.value("cublas_workspace_bytes"):
                    workspaces.add(where)
                    recording.alloc(profile.value("cublas_workspace_bytes"), role="cublas_workspace")
                # a bias added in the GEMM's epilogue goes through cuBLASLt, which
                # takes a workspace of its own the first time it runs on each thread
                lt = profile.value("cublaslt_workspace_bytes") if profile is not None else None
                if lt and where + " lt" not in workspaces and _lt_epilogue(func, args, kwargs):
                    workspaces.add(where + " lt")
                    recording.alloc(lt, role="cublaslt_workspace")
            elif func.overloadpacket in sdpa_backward and profile is not None:
                per = profile.value("sdpa_backward_scratch_bytes_per_q_element")
                if per:
                    scratch = recording.alloc(int(per * args[1].numel()))
                    recording.free(scratch)
            elif func.overloadpacket in cudnn_attention and profile is not None:
                # cuDNN's attention forward takes a small workspace of its own
                # after its outputs and gives it back (MHA.cpp)
                n = profile.value("sdpa_cudnn_forward_scratch_bytes")
                if n:
                    recording.free(recording.alloc(n))
            elif func in summing and is_cuda(flat):
                dims = args[1] if func in (aten.sum.dim_IntList, aten.mean.dim) and len(args) > 1 else None
                reduction_scratch(summing[func], args[0], dims, out)
            elif func in softmaxes and is_cuda(flat) and not args[0].is_contiguous():
                # CUDA's softmax kernels read a contiguous input: one that is not (a cross-entropy
                # of logits.t()) is copied after the output and the copy given back within the
                # call. On an H100 a bf16 log_softmax of a transposed 32768 x 32768 matrix made a
                # 2 GiB copy so, which the meta function does not: freed before the next 4 GiB
                # request, it held one more 2 GiB segment under PyTorch's allocator (+2 GiB)
                recording.free(recording.alloc(args[0].numel() * args[0].element_size()))
            elif func in scans and is_cuda(flat) and args[0].dtype != out.dtype:
                # a scan of another type than its result's (a bool mask counted into
                # int64) reads a copy of its input in the result's type (cumsum_out)
                copy = recording.alloc(args[0].numel() * out.element_size())
                recording.free(copy)
            if on_gpu is None and func is aten.convolution_backward.default and is_cuda(flat) and args[10][2]:
                # a bias's gradient is a sum over all but the channel dimension,
                # made after the backend's own work (PyTorch's convolution_backward;
                # run on the GPU, the call's own sequence has it)
                grad = args[0]
                reduction_scratch("sum", grad, [0] + list(range(2, grad.dim())), out[2])
            if func in conv and is_cuda(flat) and torch.backends.cudnn.enabled and torch.backends.cudnn.benchmark:
                # the autotuner's trials take workspaces sized by the memory free when it runs, and
                # PyTorch's allocator keeps the largest it tried: measured on a CNN at batch 1024 on an
                # H100, native +6.5% and expandable segments -7.6% against the run, gpumem -0.4%
                recording.note(
                    "cuDNN's autotuner was on (torch.backends.cudnn.benchmark): its trials take workspaces "
                    "sized by the memory free when it runs, which no recording reproduces, so the figures for "
                    "PyTorch's allocator and expandable segments may be several percent off"
                )
            if func in conv and is_cuda(flat) and on_gpu is None:
                recording.note(
                    "cuDNN convolution workspaces (taken and given back within each call, sized by "
                    "cuDNN's choice of algorithm) are not in the trace"
                )
            if func in rnn_cells and is_cuda(flat):
                # a CPU build has no cuDNN, so nn.LSTM and nn.GRU fall back to a fused cell a time step
                recording.note(
                    "an LSTM or GRU ran cell by cell here (PyTorch's fallback without cuDNN); on the GPU cuDNN "
                    "runs the whole sequence in one call, with a workspace and a reserve space for the backward "
                    "instead of each step's saved tensors, so its memory may be far from these figures (a run "
                    "on the GPU, without --cpu, records cuDNN's)"
                )
            if func in fft and is_cuda(flat):
                if func is c2r:
                    # cuFFT's complex-to-real transforms overwrite their input, so
                    # PyTorch transforms a contiguous copy, made after the output and
                    # given back within the call (an H200's irfft2 of 130 MiB made
                    # exactly that: bench/torch/fft_workspace_probe.py)
                    recording.free(recording.alloc(args[0].numel() * args[0].element_size()))
                recording.note(
                    "cuFFT's plan workspaces (torch.fft, torch.stft: taken and given back within a "
                    "transform, sized by cuFFT's plan; none for the power-of-two transforms measured, one "
                    "the size of the output for a length of 60,000) are not in the trace"
                )
            return out

    return Tracker()


def _fake_on_cpu(t):
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and t.device.type == "cpu"


def _lt_epilogue(func, args, kwargs):
    """addmm (or _addmm_activation) of a 1-D bias the length of the
    output's rows, beta 1: PyTorch hands the bias to cuBLASLt's epilogue."""
    if func.__name__ not in ("addmm.default", "_addmm_activation.default") or len(args) < 3:
        return False
    bias, mat2 = args[0], args[2]
    beta = kwargs.get("beta", args[3] if len(args) > 3 and func.__name__ == "addmm.default" else 1)
    return bias.dim() == 1 and mat2.dim() == 2 and bias.shape[0] == mat2.shape[1] and beta == 1


def _grouped_mm_by_loop(torch, func, args, kwargs):
    """torch._grouped_mm of float32 or float16 matrices, as a mixture of
    experts under autocast makes it (transformers casts the tokens to its
    float32 experts' type): CUDA computes these types group by group with
    cuBLAS GEMMs into one output (bf16 alone goes to CUTLASS), while the
    meta function that checks fake tensors accepts bf16 alone (PyTorch 2.11
    and 2.13). Its output as the CUDA kernel makes it (the last dimension's
    stride a multiple of 16 bytes), or None for other types and shapes.
    Measured on an H100 (torch 2.11): float32 and float16 grouped GEMMs
    allocate their output, and cuBLAS's workspace at the first GEMM of a
    stream. (The caller asks only for torch._grouped_mm.)"""
    if len(args) < 2:
        return None
    a, b = args[0], args[1]
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.device.type != "cuda":
        return None
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16):
        return None
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    if out_dtype not in (None, a.dtype) or (offs is None and (a.dim(), b.dim()) != (3, 3)):
        return None
    if (a.dim(), b.dim()) == (2, 2):
        size = [offs.size(0), a.size(0), b.size(1)]
    elif (a.dim(), b.dim()) == (2, 3):
        size = [a.size(0), b.size(-1)]
    elif (a.dim(), b.dim()) == (3, 2):
        size = [a.size(1), b.size(1)]
    elif (a.dim(), b.dim()) == (3, 3):
        size = [a.size(0), a.size(1), b.size(-1)]
    else:
        return None
    align = 16 // a.element_size()
    row = -(-size[-1] // align) * align
    stride = [size[1] * row, row, 1] if len(size) == 3 else [row, 1]
    return torch.empty_strided(size, stride, dtype=a.dtype, device=a.device)


# Operators whose CUDA kernels allocate their outputs in another order than
# they return them: the indices of the outputs allocated first.
_ALLOCATED_FIRST = {
    "native_dropout.default": (1,),  # the mask, then the output (dropout_cuda)
    "_scaled_dot_product_cudnn_attention.default": (6, 7),  # the RNG seed and offset
}


def _kernel_order(func, out):
    first = _ALLOCATED_FIRST.get(func.__name__)
    if first is None or not isinstance(out, tuple) or len(out) <= max(first):
        return out
    return tuple(out[i] for i in first) + tuple(o for i, o in enumerate(out) if i not in first)


def _dense(t):
    """Its elements fill its storage's span once each, in some order of
    its dimensions."""
    return reductions.dense(t.shape, t.stride())


def _accumulation(torch, args, kwargs):
    """An add the autograd engine makes to sum two gradients of one input,
    where on the GPU it adds in place: grad mode off, the first gradient
    dense and held by nothing else (its storage by no other tensor), the
    second of its shape and dtype."""
    if not _engine.depth or not _engine.applied or torch.is_grad_enabled() or kwargs:
        return False
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    old, new = args
    node = _current_node()
    if node is None or type(node).__name__ == "AccumulateGrad":
        return False
    if old.shape != new.shape or old.dtype != new.dtype or old.device.type != "cuda":
        return False
    if not _dense(old) or not hasattr(torch._C, "_storage_Use_Count"):
        return False  # (a PyTorch that cannot count holders: summed into a new tensor, as before)
    return _storage_holders(torch, old) == 1


def _storage_holders(torch, t):
    """How many tensors share t's storage. Asking for the storage from
    Python may itself hold a reference to it: the count for a tensor known
    to be its storage's only holder says how many."""
    if _engine.own_references is None:
        with _no_modes():
            single = torch.empty(1, device="meta")
            _engine.own_references = torch._C._storage_Use_Count(single.untyped_storage()._cdata) - 1
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - _engine.own_references


SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def sdpa_arguments(args, kwargs):
    """scaled_dot_product_attention's arguments, in SDPA_PARAMETERS' order,
    defaults filled in."""
    n = len(args)
    return list(args) + [kwargs.get(p, d) for p, d in zip(SDPA_PARAMETERS[n:], _SDPA_DEFAULTS[n:])]


def additive_mask(torch, mask, dtype):
    """A boolean mask (True: attend) as the additive one attention.cpp
    makes of it before choosing a kernel; other masks unchanged."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), float("-inf"), zero)


def autocast_sdpa_inputs(torch, q, k, v, mask):
    """q, k, v and mask as scaled_dot_product_attention gets them under
    CUDA autocast, which lists it among the functions run in the lower
    precision: each floating-point CUDA tensor cast to autocast's dtype (a
    Llama's q and k come out of its rotary embedding in fp32 and reach
    the kernel in bf16). Unchanged outside autocast."""
    if not torch.is_autocast_enabled("cuda"):
        return q, k, v, mask
    dtype = torch.get_autocast_dtype("cuda")

    def cast(t):
        eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64 and t.device.type == "cuda"
        return t.to(dtype) if eligible and t.dtype != dtype else t

    # autocast's C++ wrapper casts the arguments of a call right to left (the
    # order GCC evaluates a call's arguments in: a Llama's k is cast before its
    # q on the GPU), and the caching allocator sees them in that order
    mask, v, k, q = cast(mask), cast(v), cast(k), cast(q)
    return q, k, v, mask


def _sdpa_mode(recording, profile):
    """A function mode running scaled_dot_product_attention on fake CUDA
    tensors with the kernel the profile's GPU would choose.

    The choice is not an operator a dispatch mode sees: the composite
    asks a per-device stub, which a CPU build of PyTorch lacks for CUDA
    (it then runs the math backend, materializing the attention scores a
    fused kernel never makes) and a CUDA build answers from the GPU of the
    machine the recording runs on, or fails without one. So the composite
    is taken over here, as attention.cpp runs it: a boolean mask made
    additive, the backend chosen (profiles.sdpa_backend), then that
    backend's operator, whose autograd formula gives the backward."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.overrides import TorchFunctionMode

    sdpa = torch._C._nn.scaled_dot_product_attention
    aten = torch.ops.aten

    def fused(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        q, k, v, attn_mask = autocast_sdpa_inputs(torch, q, k, v, attn_mask)
        # The operators below run as autocast runs a function it has cast
        # for: with autocast off beneath it (the math backend's softmax
        # stays in q's dtype).
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)):
            return run(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def run(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        attn_mask = additive_mask(torch, attn_mask, q.dtype)
        backend = profiles.sdpa_backend(torch, profile, recording, q, k, v, attn_mask, enable_gqa)
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if backend == "flash":
            d = q.shape[-1]
            if d % 8:
                pad = [0, 8 - d % 8]
                q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
            out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :d] if d % 8 else out
        if backend == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(
                q, k, v, attn_mask, grad, dropout_p, is_causal, False, scale=scale
            )[0]
        if backend == "efficient":
            if attn_mask is not None:
                # The kernel reads the bias with rows aligned to 16 elements.
                n = attn_mask.shape[-1]
                if n % 16:
                    attn_mask = torch.nn.functional.pad(attn_mask, [0, 16 - n % 16])[..., :n]
                attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, grad, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]

    def attention(*args, **kwargs):
        bound = sdpa_arguments(args, kwargs)
        q = bound[0]
        if isinstance(q, FakeTensor) and q.device.type == "cuda" and not q.is_nested and q.dim() == 4:
            return fused(*bound)
        return sdpa(*args, **kwargs)

    class SdpaMode(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            if func is sdpa:
                return attention(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    # Autograd's engine runs a backward with no function modes, so an
    # activation checkpoint's recomputation meets the mode only through
    # the name it calls (torch.nn.functional's), patched for the session.
    recording.patch(torch.nn.functional, "scaled_dot_product_attention", attention)
    return SdpaMode()


# depth: backward calls under way; autocast: per CUDA autocast context
# entered and not left, whether it enables autocast (the backward's worker
# threads see both)
_engine = types.SimpleNamespace(depth=0, autocast=[], applied=False, own_references=None, backwards=0)


def _in_engine():
    """In autograd's backward, outside a recomputation under autocast
    (activation checkpointing), whose casts need CUDA tensors to look so.
    The autocast context is counted by its own entry and exit:
    torch.is_autocast_enabled("cuda") reads False inside autocast's own
    kernel, which is where the cast asks a tensor for its device."""
    return _engine.depth > 0 and not (_engine.autocast and _engine.autocast[-1])


def _autocast_patches(torch):
    """torch.autocast's __enter__ and __exit__, counting CUDA contexts."""
    cls = torch.amp.autocast_mode.autocast
    enter, leave = cls.__enter__, cls.__exit__

    def counted_enter(self):
        out = enter(self)
        if getattr(self, "device", None) == "cuda":
            _engine.autocast.append(bool(getattr(self, "_enabled", True)))
        return out

    def counted_exit(self, *exc):
        if getattr(self, "device", None) == "cuda" and _engine.autocast:
            _engine.autocast.pop()
        return leave(self, *exc)

    return {(cls, "__enter__"): counted_enter, (cls, "__exit__"): counted_exit}


def _graph_nodes(roots):
    """The autograd nodes reachable from roots, AccumulateGrad's left out
    (they send no gradient on)."""
    seen, todo, nodes = set(), [r for r in roots if r is not None], []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ != "AccumulateGrad":
            nodes.append(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return nodes


def _engine_wrapper(run):
    """Counts the backward passes running, and marks when a node's own
    computation is over: what the engine runs between a node's end and
    the next node's start (AccumulateGrad's aside) is its summing of the
    node's outputs into the inputs of the nodes they feed (see
    _accumulation). The marks come from hooks on each node of the graph
    for the pass; AccumulateGrad gets none, as a hook there would change
    whether it can keep the gradient it is given."""

    def started(grad_outputs):
        _engine.applied = False

    def ended(grad_inputs, grad_outputs):
        _engine.applied = True

    def run_backward(t_outputs, *args, **kwargs):
        outputs = t_outputs if isinstance(t_outputs, (list, tuple)) else [t_outputs]
        roots = [getattr(t, "grad_fn", None) for t in outputs]
        handles = []
        for node in _graph_nodes(roots):
            handles.append(node.register_prehook(started))
            handles.append(node.register_hook(ended))
        outer = _engine.applied
        _engine.applied = False
        _engine.depth += 1
        try:
            return run(t_outputs, *args, **kwargs)
        finally:
            _engine.depth -= 1
            _engine.applied = outer  # a backward inside a node's (reentrant checkpointing)
            if not _engine.depth:
                _engine.backwards += 1
            for h in handles:
                h.remove()

    return run_backward


def _current_node():
    current = getattr(_torch()._C, "_current_autograd_node", None)
    return current() if current else None


# ---- torch.cuda as a job running on fake tensors sees it -----------------


class _Inert:
    """A stand-in that takes any arguments, is its own context manager, and
    answers every method with RESULTS' value for it (None by default)."""

    RESULTS = {}

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        result = self.RESULTS.get(name)
        return lambda *a, **k: result


class _FakeStream(_Inert):
    """torch.cuda.Stream and Event stand-ins: work is ordered already, and
    no time passes on fake tensors (wait_stream, synchronize, record, ...)."""

    RESULTS = {"query": True, "elapsed_time": 0.0}
    cuda_stream = 0
    device = None


def _cuda_patches(torch, recording, profile):
    """{(object, name): replacement} making torch.cuda answer as one GPU
    of the profile's kind with the recording's memory."""
    cap = tuple(profile.capability) if profile else (9, 0)
    total = profile.total_memory if profile else 80 << 30
    name = profile.gpu if profile else "fake CUDA device"
    props = types.SimpleNamespace(
        name=name, major=cap[0], minor=cap[1], total_memory=total, multi_processor_count=132,
        is_integrated=False, is_multi_gpu_board=False, L2_cache_size=50 << 20, gcnArchName="",
    )  # fmt: skip
    stats = recording.stats

    def allocated(device=None):
        return stats.current()

    def max_allocated(device=None):
        return stats.peak()

    def reset_peak(device=None):
        stats.reset_peak()

    def nested_stats(device=None):
        return stats.nested()

    noop = lambda *a, **k: None  # noqa: E731
    stream = _FakeStream()

    def set_fraction(fraction, device=None):
        # PyTorch's own checks, then kept: the command answers for the cap it sets
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError("Invalid fraction value: %s. Allowed range: 0~1" % fraction)
        recording.memory_fraction = fraction
    c = torch.cuda
    patches = {
        (c, "is_available"): lambda: True,
        (c, "device_count"): lambda: 1,
        (c, "current_device"): lambda: 0,
        (c, "set_device"): noop,
        # NVML's readings of the device: an idle one (no work runs), with the
        # recording's memory in use
        (c, "utilization"): lambda device=None: 0,
        (c, "temperature"): lambda device=None: 0,
        (c, "power_draw"): lambda device=None: 0,
        (c, "clock_rate"): lambda device=None: 0,
        (c, "memory_usage"): lambda device=None: 0,
        (c, "device_memory_used"): lambda device=None: recording.live_bytes,
        # A script's own memory history and snapshots: the recording is the
        # history here, and the snapshot file is not written (a note says so)
        (c.memory, "_record_memory_history"): noop,
        (c.memory, "_snapshot"): lambda device=None: {"segments": [], "device_traces": [[]]},
        (c.memory, "_dump_snapshot"): lambda filename="dump_snapshot.pickle": recording.note(
            "the script's memory snapshot (torch.cuda.memory._dump_snapshot) was not written: on fake tensors "
            "there is none; the recording is this job's history"),
        (c, "memory_snapshot"): lambda *a, **k: [],
        (c, "ipc_collect"): noop,
        (torch.profiler, "profile"): _profiler_off(recording),
        (torch.utils.data.DataLoader, "__init__"): _loader_in_process(torch.utils.data.DataLoader.__init__, recording),
        (torch.autograd.profiler, "profile"): _profiler_off(recording),
        # NVTX ranges mark a profiler's timeline, not memory (a CPU build has none)
        (c.nvtx, "_nvtx"): types.SimpleNamespace(**{
            f: (lambda *a, **k: 0) for f in ("rangePushA", "rangePop", "rangeStartA", "rangeEnd", "markA",
                                             "deviceRangeStart", "deviceRangeEnd")}),
        # `with torch.cuda.device(0):` swaps the current device through these
        (c, "_exchange_device"): lambda device: 0,
        (c, "_maybe_exchange_device"): lambda device: 0,
        (c, "synchronize"): noop,
        (c, "is_initialized"): lambda: True,
        (c, "init"): noop,
        (c, "_lazy_init"): noop,
        (c, "empty_cache"): noop,
        (c, "get_device_name"): lambda device=None: name,
        (c, "get_device_capability"): lambda device=None: cap,
        (c, "get_device_properties"): lambda device=None: props,
        (c, "is_bf16_supported"): lambda *a, **k: True,
        (c, "mem_get_info"): lambda device=None: (total - recording.live_bytes, total),
        (c, "memory_allocated"): allocated,
        (c, "max_memory_allocated"): max_allocated,
        (c, "memory_reserved"): allocated,
        (c, "max_memory_reserved"): max_allocated,
        (c, "reset_peak_memory_stats"): reset_peak,
        (c, "reset_max_memory_allocated"): reset_peak,
        # memory_stats() and memory_summary() read this in torch.cuda.memory
        (c, "memory_stats_as_nested_dict"): nested_stats,
        (c.memory, "memory_stats_as_nested_dict"): nested_stats,
        (c, "reset_accumulated_memory_stats"): lambda device=None: stats.reset_accumulated(),
        (c.memory, "reset_accumulated_memory_stats"): lambda device=None: stats.reset_accumulated(),
        (c, "set_per_process_memory_fraction"): set_fraction,
        (c, "get_per_process_memory_fraction"): lambda device=None: recording.memory_fraction or 1.0,
        (c, "Stream"): _FakeStream,
        (c, "Event"): _FakeStream,
        (c, "current_stream"): lambda device=None: stream,
        (c, "default_stream"): lambda device=None: stream,
        (c, "stream"): lambda s=None: contextlib.nullcontext(),
        # Optimizers ask whether a CUDA graph is being captured (PyTorch
        # 2.11 asks the device); nothing is, on fake tensors.
        (c, "is_current_stream_capturing"): lambda: False,
        (c.graphs, "is_current_stream_capturing"): lambda: False,
        (torch.nn.Module, "_apply"): _module_apply,
        (torch.autograd, "_engine_run_backward"): _engine_wrapper(torch.autograd._engine_run_backward),
        # inference_mode as no_grad: the same requests (no graph, nothing
        # saved for a backward), where fake tensors cannot follow inference
        # mode (torch.tensor(data, device="cuda") copies below them there)
        (torch, "inference_mode"): _inference_as_no_grad,
        (torch.autograd, "inference_mode"): _inference_as_no_grad,
        **_autocast_patches(torch),
    }
    # The fake device's random state, for code that saves and restores it
    # (Lightning around every fit, the HF Trainer with each checkpoint, the
    # latter through torch.cuda.random): with CUDA never initialised,
    # PyTorch's own has no generator to read on a machine with a GPU.
    random_state = {
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)],
        "set_rng_state": noop, "set_rng_state_all": noop, "manual_seed": noop, "manual_seed_all": noop,
        "seed": noop, "seed_all": noop, "initial_seed": lambda: 0,
    }  # fmt: skip
    patches.update({(module, n): f for module in (c, c.random) for n, f in random_state.items()})
    # nn.DataParallel over the one fake GPU scatters each input to it
    # through a CUDA-only function; on one device that is a move.
    from torch.nn.parallel import comm

    def scatter(tensor, devices, chunk_sizes=None, dim=0, streams=None, out=None):
        if out is not None or devices is None or len(devices) != 1:
            raise RuntimeError("the recorder has one GPU: a scatter over %s is not recorded" % (devices,))
        return (tensor.to(torch.device("cuda", torch.cuda._utils._get_device_index(devices[0]))),)

    patches[(comm, "scatter")] = scatter
    # torch.accelerator answers for whichever device the build has: a CPU
    # machine's says none, and Accelerate (under the HF Trainer too) asks it
    # where to put each batch, which then stays on the CPU beside a model on
    # the fake GPU.
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        patches.update({
            (acc, "current_accelerator"): lambda check_available=False: torch.device("cuda"),
            (acc, "is_available"): lambda: True,
            (acc, "device_count"): lambda: 1,
            (acc, "current_device_index"): lambda: 0,
            (acc, "current_device_idx"): lambda: 0,
            (acc, "set_device_index"): noop,
            (acc, "set_device_idx"): noop,
            (acc, "synchronize"): noop,
            (acc, "current_stream"): lambda device=None: stream,
            (acc, "empty_cache"): noop,
            (acc, "memory_allocated"): allocated,
            (acc, "max_memory_allocated"): max_allocated,
            (acc, "memory_reserved"): allocated,
            (acc, "max_memory_reserved"): max_allocated,
            (acc, "reset_peak_memory_stats"): reset_peak,
            # (PyTorch's own flattening of the nested statistics below)
            (acc, "memory_stats"): lambda device=None: c.memory.memory_stats(),
            (acc, "reset_accumulated_memory_stats"): lambda device=None: stats.reset_accumulated(),
            (acc, "get_memory_info"): lambda device=None: (total - recording.live_bytes, total),
        })  # fmt: skip
    if hasattr(torch._C, "_conv_determine_backend_memory_format"):
        patches[(torch._C, "_conv_determine_backend_memory_format")] = _conv_layout(
            torch, torch._C._conv_determine_backend_memory_format
        )
    # A CUDA build of PyTorch with no GPU visible: FakeTensorMode makes the
    # device's context before the first fake CUDA tensor, which needs a GPU.
    from torch._subclasses import fake_tensor

    if hasattr(fake_tensor, "init_gpu_context"):
        patches[(fake_tensor, "init_gpu_context")] = noop
    return {k: v for k, v in patches.items() if hasattr(k[0], k[1]) or k[1] in ("is_initialized",)}


class _NoProfiler(_Inert):
    """torch.profiler.profile for the recording: profiling each of the fake
    tensors' operators took minutes for a few steps, and what the profiler
    measures (time, CUPTI's own buffers) is no allocator memory. Its
    results are empty: a table prints as nothing (start, stop, step,
    export_chrome_trace do nothing)."""

    RESULTS = {"key_averages": types.SimpleNamespace(table=lambda *a, **k: ""), "events": ()}

    def __call__(self, fn):  # as a decorator
        return fn


def _loader_in_process(init, recording):
    """DataLoader.__init__ for the recording: batches loaded in this process.
    Worker processes make CPU batches either way, and cannot take the fake
    tensors a large dataset built in the script is made of (a spawned
    worker must unpickle them: "Can't pickle local object ...FakeMode");
    nor is there a pinning thread then, which would pin for real, outside
    the dispatch modes (that needs a GPU); in this process pinning is the
    placement mode's, which leaves a batch as it is."""

    @functools.wraps(init)
    def in_process(self, *args, **kwargs):
        import inspect

        bound = inspect.signature(init).bind(self, *args, **kwargs)
        if bound.arguments.get("num_workers", 0):
            recording.note("the DataLoader's worker processes were not started while recording: its batches were "
                           "loaded in the main process (CPU tensors either way)")
            for name, value in (("num_workers", 0), ("persistent_workers", False), ("prefetch_factor", None),
                                ("multiprocessing_context", None)):
                bound.arguments[name] = value
        init(*bound.args, **bound.kwargs)
        _loader_batch_fits_dataset(self, recording)

    return in_process


def _loader_batch_fits_dataset(loader, recording):
    """A dataset shorter than the batch makes batches shorter than the batch
    size asked for, as it would on the GPU: the recording is then one at the
    dataset's length, which the notes say (a validation set may well be
    shorter than a training batch). With drop_last there is no batch at all,
    and a loop that counts its steps would never end: the recording stops
    there, naming both."""
    try:
        items = len(loader.dataset)
    except TypeError:  # an iterable dataset: its length is not known
        return
    batch = loader.batch_size
    if batch is None or items >= batch:
        return
    if loader.drop_last:
        raise NoBatch("the DataLoader's dataset has %d items, fewer than its batch size %d, and drop_last=True: "
                      "it gives no batch at all (a larger dataset, or batch sizes up to %d)" % (items, batch, items), items)
    recording.dataset_items = min(items, recording.dataset_items or items)
    recording.note("a DataLoader's dataset has %d items, fewer than the batch size %d: its batches were that "
                   "short, as they would be on the GPU (a training set that short makes the memory at any larger batch "
                   "that of %d)" % (items, batch, items))


def _profiler_off(recording):
    def profile(*args, **kwargs):
        recording.note("the script's profiler (torch.profiler.profile) was off while recording: it measures time, "
                       "not the allocator's memory, and on fake tensors it would take minutes")
        return _NoProfiler()

    return profile


def _inference_as_no_grad(mode=True):
    """torch.inference_mode(mode) for the recording: a context manager and
    decorator (with or without its parentheses) that turns gradients off,
    or for mode=False leaves them as they are."""
    torch = _torch()
    if callable(mode):  # @torch.inference_mode
        return torch.no_grad()(mode)
    return torch.no_grad() if mode else torch.set_grad_enabled(torch.is_grad_enabled())


def _suggested_layout(torch, t):
    """Tensor.suggest_memory_format(), which Python does not expose."""
    from torch import _prims_common as prims

    if hasattr(prims, "suggest_memory_format"):
        return prims.suggest_memory_format(t)
    cl = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    if t.dim() in (4, 5) and t.is_contiguous(memory_format=cl) and not t.is_contiguous():
        return cl
    return torch.contiguous_format


def _conv_layout(torch, native):
    """The layout a convolution's outputs (and its input and weight
    gradients) get on the GPU. FakeTensorMode asks PyTorch which backend
    would run the convolution, and with no GPU (or a CPU build) the answer
    is a CPU kernel, whose outputs are contiguous; on the GPU cuDNN runs
    every convolution of a channels-last input or weight (depthwise ones
    included) and gives channels-last outputs. A contiguous gradient of a
    channels-last weight costs a copy the GPU does not make: AccumulateGrad
    clones a gradient whose strides differ from its parameter's."""

    def layout(input, weight, backend):
        if input.device.type != "cuda" or torch.float64 in (input.dtype, weight.dtype):
            return native(input, weight, backend)
        if weight.dim() not in (4, 5):
            return torch.contiguous_format
        cl = torch.channels_last if weight.dim() == 4 else torch.channels_last_3d
        if cl in (_suggested_layout(torch, input), _suggested_layout(torch, weight)):
            return cl
        return torch.contiguous_format

    return layout


@contextlib.contextmanager
def _patched(patches):
    saved = []
    try:
        for (obj, attr), value in patches.items():
            saved.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)


_MISSING = object()


def _module_apply(module, fn, recurse=True):
    """nn.Module._apply for fake tensors: a parameter moved to another
    device becomes a new Parameter (shared ones stay shared, except from
    the meta device, where PyTorch unties them); one that
    stays on its device keeps its identity, as PyTorch does. Modules are
    visited in PyTorch's order, each one's children before its own
    parameters and buffers: the order the parameters' memory is
    allocated on the GPU (a ViT's class token and position embedding,
    the root's own, come after its blocks')."""
    torch = _torch()
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    memo = {}

    def convert(t):
        with torch.no_grad():
            return fn(t)

    def post_order(m):
        if recurse:
            for child in m.children():
                yield from post_order(child)
        yield m

    for m in post_order(module):
        for key, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) in memo:
                m._parameters[key] = memo[id(p)]
                continue
            new = convert(p)
            if new is p:
                memo[id(p)] = p
                continue
            # PyTorch converts a CPU parameter in place (set_data: whoever holds it sees the
            # moved one, so tied weights stay tied), and swaps a tensor subclass such as
            # FSDP2's DTensor shards in place (swap_tensors) or any parameter where the
            # swap is asked for; a plain meta one (to_empty) has no compatible storage and
            # becomes a new Parameter in each module that holds it, so tied weights come
            # out untied, each with memory of its own (a meta-built model under DDP: 1.50e9
            # parameters on the GPU where Llama 3.2 1B ties 1.24e9; under FSDP2, 1.24e9).
            in_place = (p.device.type != "meta" or is_traceable_wrapper_subclass(new)
                        or torch.__future__.get_swap_module_params_on_conversion())  # fmt: skip
            if new.device == p.device and torch._has_compatible_shallow_copy_type(p, new):
                p.data = new
                out = p
            else:
                out = torch.nn.Parameter(new, p.requires_grad)
            if p.grad is not None:
                out.grad = convert(p.grad)
            if in_place:
                memo[id(p)] = out
            m._parameters[key] = out
        for key, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[key] = convert(b)
    return module


# ---- sessions ---------------------------------------------------------------


@contextlib.contextmanager
def recording(batch_size=None, device_profile="h200", workload="job", step_hook=None, probe=None):
    """Runs the with-block on fake CUDA tensors, recording into the
    Recording it yields. Each optimizer step ends a training step ('# step
    N'); step_hook(recording) is called after each. probe: a
    probe.ConvProbe (made before the recording starts) that runs each
    convolution for real on the GPU for its workspaces, or None."""
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    profile = profiles.load(device_profile) if isinstance(device_profile, str) else device_profile
    rec = Recording(batch_size=batch_size, profile=profile, workload=workload)
    if profile is not None:
        # (with a probe, the GPU says what convolutions take)
        for text in profile.notes(measured_elsewhere={"cudnn_conv_workspace"} if probe is not None else ()):
            rec.note(text)
    _allow_fake_cuda(torch)
    _transformers_sees_real_tensors(rec)
    _compiled_code_runs_eager(rec)

    def on_step(optimizer, args, kwargs):
        rec.in_optimizer = False
        rec.optimizers.add(id(optimizer))
        rec.step()
        if step_hook is not None:
            step_hook(rec)

    def before_step(optimizer, args, kwargs):
        rec.in_optimizer = True

    def hand_step():
        rec.optimizers.add("by hand")
        rec.step()
        if step_hook is not None:
            step_hook(rec)

    rec.hand_step = hand_step

    class FakeMode(FakeTensorMode):
        # torch.cuda.is_available() says True from here on; the fake mode
        # must still never compute on a real device (it would, moving a
        # real CPU tensor to cuda by running the copy).
        avoid_device_init = True

    fake_mode = FakeMode(allow_non_fake_inputs=True)
    from torch.optim import optimizer as optim_module

    handle = optim_module.register_optimizer_step_post_hook(on_step)
    pre_handle = optim_module.register_optimizer_step_pre_hook(before_step)
    # Optimizers take their foreach implementation for CUDA parameters of
    # the types they know; the fake ones are counted among them.
    from torch._subclasses.fake_tensor import FakeTensor

    native = optim_module._foreach_supported_types
    added = FakeTensor not in native
    if added:
        native.append(FakeTensor)
    try:
        # The backward runs on this thread: autograd's engine sizes its
        # per-device threads once, and may have done so before a CUDA
        # guard was registered.
        with _patched(_cuda_patches(torch, rec, profile)), _Placement(rec), \
                torch.autograd.set_multithreading_enabled(False):
            with fake_mode, _tracker(rec, fake_mode, profile, probe), _sdpa_mode(rec, profile):
                yield rec
    finally:
        if probe is not None:
            _probe_notes(rec, probe)
        rec.closed = True
        rec.unpatch()
        handle.remove()
        pre_handle.remove()
        if added:
            native.remove(FakeTensor)


def _probe_notes(rec, probe):
    met = len(getattr(probe, "_seen", ()))
    if getattr(probe, "device_name", None) and met:
        # (a job without convolutions gets no note: nothing was run)
        rec.note("convolutions were run on the GPU (%s) for their workspaces: %d problem%s"
                 % (probe.device_name, met, "" if met == 1 else "s"))  # fmt: skip
    for func, i, real, fake in probe.mismatched[:3]:
        rec.note("%s output %d has strides %s on the GPU, %s in the recording" % (func, i, real, fake))


def _to_cuda(torch, batch):
    if isinstance(batch, torch.Tensor):
        return batch.to("cuda")
    if isinstance(batch, dict):
        return type(batch)({k: _to_cuda(torch, v) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_cuda(torch, v) for v in batch)
    return batch


def _loss_of(out):
    loss = getattr(out, "loss", out)
    if isinstance(out, dict) and "loss" in out:
        loss = out["loss"]
    return loss


def record_step(build_model, make_batch, step_fn=None, batch_size=1, steps=3, device_profile="h200",
                optimizer=None, path=None, workload=None, probe=None):
    """Records `steps` training steps of a model on fake CUDA tensors.

    build_model(): the model (built on any device; it is moved to cuda).
    make_batch(batch_size): a batch (tensors, or dicts/lists of them),
      moved to cuda.
    step_fn(model, batch): the loss (a scalar tensor, or an object with
      .loss); default: model(**batch) for a dict, model(batch) otherwise.
    optimizer(params): the optimizer (default: torch.optim.AdamW).

    Each step runs step_fn, backward, optimizer.step() and
    optimizer.zero_grad(set_to_none=True). A model whose constructor
    reads tensor values (.item()) is built for real on the CPU, then
    moved (a note says so). Writes the trace to path when given; returns
    the Recording. probe: as recording()'s."""
    torch = _torch()
    if batch_size < 1 or steps < 1:
        raise ValueError("record_step: batch_size and steps must be at least 1 (got %r, %r)" % (batch_size, steps))
    make_opt = optimizer or (lambda params: torch.optim.AdamW(params))
    if step_fn is None:

        def step_fn(model, batch):
            return model(**batch) if isinstance(batch, dict) else model(batch)

    name = workload or getattr(build_model, "__name__", "job")
    owned = []
    try:
        with recording(batch_size, device_profile, workload=name, probe=probe) as rec:
            from torch._subclasses.fake_tensor import DataDependentOutputException

            try:
                model = _build_strict(build_model)
            except DataDependentOutputException:
                with torch._subclasses.fake_tensor.unset_fake_temporarily(), _no_modes():
                    model = build_model()
                rec.note("the model was built for real on the CPU: its constructor reads tensor values")
            owned = _tensors_of(model)
            model = model.to("cuda")
            opt = make_opt([p for p in model.parameters() if p.requires_grad])
            for _ in range(steps):
                batch = _to_cuda(torch, make_batch(batch_size))
                loss = _loss_of(step_fn(model, batch))
                loss.backward()
                del loss, batch
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        _put_back(owned)  # a model the caller built keeps its own tensors
    if path is not None:
        rec.write(path)
    return rec


def _tensors_of(model):
    """Each module's parameters and buffers, as they are now."""
    return [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _put_back(owned):
    for m, params, buffers in owned:
        m._parameters.update(params)
        m._buffers.update(buffers)


def _build_strict(build_model):
    """build_model() where reading a fake tensor's value raises rather
    than giving a placeholder, so that the caller can build for real."""
    torch = _torch()
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def strict_item(self):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(self, FakeTensor) and self.constant is None:
            raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        return old_item(self)

    old_item = torch.Tensor.item
    torch.Tensor.item = strict_item
    try:
        return build_model()
    finally:
        torch.Tensor.item = old_item


@contextlib.contextmanager
def _no_modes():
    from torch.utils._python_dispatch import _disable_current_modes

    torch = _torch()
    with _disable_current_modes(), torch.overrides._disable_user_modes() if hasattr(
        torch.overrides, "_disable_user_modes"
    ) else contextlib.nullcontext():
        yield

