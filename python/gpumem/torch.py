"""gpumem as PyTorch's CUDA allocator.

    import gpumem.torch
    gpumem.torch.enable("limit:40G")      # before the first CUDA tensor
    ...                                   # the program, unchanged

or, with no edit to the program at all (gpumem/_launch.py):

    python -m gpumem.torch [--conf STRING] script.py args...

enable() installs gpumem through torch.cuda.memory.CUDAPluggableAllocator
and makes the torch.cuda memory functions that PyTorch disables for
pluggable allocators report gpumem's figures again (memory_stats,
memory_summary, memory_allocated, max_memory_allocated, memory_reserved,
max_memory_reserved, reset_peak_memory_stats, reset_accumulated_memory_stats,
get/set_per_process_memory_fraction, empty_cache; mem_get_info stays the
driver's).

Out of memory. PyTorch 2.11's CUDAPluggableAllocator does not check what
its alloc function returns: a NULL becomes a tensor at address 0 and the
first kernel faults. So allocation goes through a ten-line C++ shim,
compiled against the installed torch on first use (and cached), that throws
c10::OutOfMemoryError with gpumem's report: Python sees
torch.OutOfMemoryError, and the usual recovery (catch, free, retry smaller)
works. Without a C++ compiler, gpumem_torch_malloc calls PyTorch's own
c10::detail::torchCheckFail instead, which raises a RuntimeError carrying
the same report (torch.OutOfMemoryError is a RuntimeError subclass, so
`except RuntimeError` catches both; is_oom() tells them apart).

CUDA graphs (torch.cuda.graph, make_graphed_callables,
torch.compile(mode="reduce-overhead")), torch.cuda.MemPool and cuDNN's
benchmark mode need more of torch's allocator interface than the pluggable
class forwards: enable() compiles a second library (build_graphs_shim) that
subclasses it and serves them from gpumem's graph-private pools and figures.
Where that library cannot be built, graph capture raises an error carrying
the compiler's words and cuDNN's benchmark mode is kept off (with a warning).
CUDA tensors go to other processes that run gpumem too (torch.multiprocessing;
the full allocator exports their pages as file descriptors). Memory snapshots
work through gpumem: torch.cuda.memory._record_memory_history, _snapshot,
_dump_snapshot and memory_snapshot record and report gpumem's events and
segments, with Python stack frames under the full allocator. Leaks: gpumem.leak_check() around a
block, or watch_leaks() for a whole training loop. See docs/python.md.
"""

import ctypes
import hashlib
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

from . import _core as _alloc, _lib, _safefs, errors
from .microbatch import CannotSplitError, MicroBatchStep, microbatch  # noqa: F401 (API)

_lock = threading.Lock()
_state = None  # the _Enabled record once enable() succeeded

# c10::detail::torchCheckFail(const char* func, const char* file,
# uint32_t line, const char* msg): [[noreturn]], throws c10::Error. Stable
# since PyTorch 1.8; only the no-compiler fallback needs it.
_TORCH_CHECK_FAIL = "_ZN3c106detail14torchCheckFailEPKcS2_jS2_"

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


# ---- the full allocator: graphs, pools, cuDNN benchmark ------------------------
#
# PyTorch's pluggable class covers malloc and free; what CUDA graphs, MemPool
# and cuDNN's benchmark mode ask of the allocator (graph-private pools with
# their use counts, checkPoolLiveAllocations for cudagraph trees, cacheInfo)
# it either forwards to hooks that take std::function (which only C++ can
# call) or refuses. So a second, optional library subclasses it, compiled
# against the installed torch (torch_cuda, c10_cuda and the CUDA headers),
# and routes those calls to gpumem's pools (include/gpumem.h). When it does
# not compile, enable() keeps the plain pluggable path and refuses capture
# with a message that carries the compiler's words.


_GRAPHS_FNS = (
    "gpumem_torch_malloc",
    "gpumem_torch_free",
    "gpumem_torch_last_oom",
    "gpumem_torch_last_status",
    "gpumem_binding_allocator",
    "gpumem_begin_allocate_to_pool",
    "gpumem_end_allocate_to_pool",
    "gpumem_release_pool",
    "gpumem_retain_pool",
    "gpumem_pool_info",
    "gpumem_pool_allocations",
    "gpumem_last_error",
    "gpumem_torch_largest_free",
    "gpumem_torch_init",
    "gpumem_torch_reset",
    "gpumem_torch_set_memory_fraction",
    "gpumem_torch_base_alloc",
    "gpumem_torch_record_stream",
    "gpumem_pool_checkpoint",
    "gpumem_pool_state_allocations",
    "gpumem_pool_state_free",
    "gpumem_pool_restore",
    "gpumem_torch_ipc_export",
    "gpumem_torch_ipc_open",
    "gpumem_torch_ipc_close",
    "gpumem_pool_set_use_on_oom",
    "gpumem_pool_set_no_split",
    "gpumem_pool_set_segment_source",
    "gpumem_set_last_error",
)


def _csrc_text(name):
    with open(os.path.join(_CSRC, name)) as f:
        return f.read()


def _graphs_source():
    """csrc/allocator.cpp with the definitions it takes from the installed
    torch's headers in front (the cache key hashes the whole text)."""
    src = _csrc_text("allocator.cpp")
    defs = "#define GPUMEM_SHIM_OOM_STATUS %d\n" % errors.ERR_OUT_OF_MEMORY
    defs += "#define GM_POOL_ALLOCATOR_ARG %s\n" % _pool_allocator_arg()
    # Methods some releases lack: overridden only where this torch declares them.
    header = _allocator_header_text()
    defs += "".join(
        "#define GM_HAVE_%s %d\n" % (m, int(("virtual bool " + m) in header or ("virtual int " + m) in header
                                           or ("virtual void " + m) in header))
        for m in ("getPoolUseCount", "checkPoolLiveAllocations", "createOrIncrefPool")
    )
    # (overridden only with the signature PyTorch 2.8+ declares)
    use_on_oom = re.search(r"virtual\s+void\s+setUseOnOOM\s*\([^)]*bool\s+use_on_oom", header) is not None
    no_split = re.search(r"virtual\s+void\s+setNoSplit\s*\(\s*c10::DeviceIndex[^,)]*,\s*MempoolId_t[^,)]*\)",
                         header) is not None
    defs += "#define GM_HAVE_setUseOnOOM %d\n#define GM_HAVE_setNoSplit %d\n" % (use_on_oom, no_split)
    # c10::Allocator::allocate was const before PyTorch 2.3.
    allocator_h = _torch_header_text(os.path.join("c10", "core", "Allocator.h"))
    const = re.search(r"virtual\s+DataPtr\s+allocate\s*\([^)]*\)\s*const", allocator_h) is not None
    defs += "#define GM_ALLOCATE_CONST %s\n" % ("const" if const else "")
    return defs + src


def _torch_header_text(relpath):
    try:
        torch = _torch()
        with open(os.path.join(os.path.dirname(torch.__file__), "include", relpath)) as f:
            return f.read()
    except OSError:
        return ""


def _allocator_header_text():
    return _torch_header_text(os.path.join("c10", "cuda", "CUDACachingAllocator.h"))


def _pool_allocator_arg():
    """The type of createOrIncrefPool's allocator parameter in the installed
    c10/cuda/CUDACachingAllocator.h (it changed across releases), so the
    override matches what this torch declares."""
    default = "std::shared_ptr<CA::CUDAAllocator>"
    text = _allocator_header_text()
    m = re.search(r"virtual\s+void\s+createOrIncrefPool\s*\(([^)]*)\)", text)
    if not m:
        return default
    params = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S).split(",")
    if len(params) < 3:
        return default
    arg = params[2].split("=")[0].strip()
    arg = re.sub(r"\s*\ballocator$", "", arg).strip()
    return arg.replace("CUDAAllocator", "CA::CUDAAllocator").replace("CA::CA::", "CA::") or default


def _cuda_includes():
    from torch.utils import cpp_extension

    out = []
    try:
        out += list(cpp_extension.include_paths("cuda"))
    except Exception:
        try:
            out += list(cpp_extension.include_paths(True))
        except Exception:
            pass
    home = getattr(cpp_extension, "CUDA_HOME", None)
    if home:
        out.append(os.path.join(home, "include"))
    # pip's nvidia-cuda-runtime wheel
    try:
        import nvidia.cuda_runtime as rt  # noqa: F401

        out.append(os.path.join(list(rt.__path__)[0], "include"))
    except Exception:
        pass
    return [p for p in out if os.path.isdir(p)]


def build_graphs_shim():
    """Compiles (or finds cached) the full allocator library for the
    installed torch: (path, None) or (None, why). GPU tests run it first so
    that a compiler error is the first thing in their log."""
    torch = _torch()
    source = _graphs_source()
    key = _shim_key(torch, source)
    out_path = os.path.join(_cache_dir(), "gpumem_torch_graphs_%s.so" % key)
    if os.path.exists(out_path):
        return out_path, None
    why = _compile_direct(
        torch, source, out_path, libs=("c10", "c10_cuda", "torch_cuda", "torch_cpu", "torch"),
        includes=_cuda_includes(),
    )
    if why is None:
        return out_path, None
    return None, why


def _install_graphs(torch, lib, state):
    """Installs the full allocator (graphs, MemPool, cuDNN benchmark);
    True, or False with state.why_no_graphs set."""
    if os.environ.get("GPUMEM_TORCH_GRAPHS", "1") == "0":
        state.why_no_graphs = "turned off (GPUMEM_TORCH_GRAPHS=0)"
        return False
    try:
        path, why = build_graphs_shim()
    except Exception as e:
        path, why = None, "%s: %s" % (type(e).__name__, e)
    if path is None:
        state.why_no_graphs = why
        return False
    try:
        _safefs.check_library(path)
        glib = ctypes.CDLL(path)
        install = glib.gpumem_graphs_install
    except (OSError, AttributeError) as e:
        state.why_no_graphs = "cannot load %s: %s" % (path, e)
        return False
    fns = (ctypes.c_void_p * len(_GRAPHS_FNS))(*[_fn_addr(lib, n) for n in _GRAPHS_FNS])
    err = ctypes.create_string_buffer(2048)
    install.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    install.restype = ctypes.c_int
    if install(ctypes.cast(fns, ctypes.c_void_p), err, len(err)) != 0:
        state.why_no_graphs = "installing it failed: " + err.value.decode(errors="replace")
        return False
    state.graphs_lib = glib
    state.graphs_path = path
    state.oom_mode = "shim"
    return True


class _Enabled:
    def __init__(self):
        self.conf = None
        self.oom_mode = None  # "shim" or "hook"
        self.shim_path = None
        self.shim_lib = None
        self.why_no_shim = None
        self.pluggable = None
        self.originals = {}
        self.graphs_lib = None  # the full allocator (graphs, pools), when built
        self.graphs_path = None
        self.why_no_graphs = None


def _torch():
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise RuntimeError("gpumem.torch needs PyTorch: %s" % e) from e


def is_enabled():
    """True once enable() has installed gpumem as PyTorch's allocator."""
    return _state is not None


def status():
    """What enable() did: enabled, conf, oom_mode ("shim": OOM raises
    torch.OutOfMemoryError; "hook": RuntimeError), shim_path, why_no_shim,
    graphs_path (gpumem's full PyTorch allocator: CUDA graphs, MemPool,
    cuDNN benchmark), why_no_graphs, library."""
    if _state is None:
        return {"enabled": False}
    return {
        "enabled": True,
        "conf": _state.conf,
        "oom_mode": _state.oom_mode,
        "shim_path": _state.shim_path,
        "why_no_shim": _state.why_no_shim,
        "graphs_path": _state.graphs_path,
        "why_no_graphs": _state.why_no_graphs,
        "library": _lib.path(),
    }


def is_oom(exc):
    """True for an out-of-memory error from gpumem under PyTorch, whichever
    way it was raised (torch.OutOfMemoryError, or the no-compiler
    fallback's RuntimeError carrying gpumem's report)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(exc)
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        text.startswith("CUDA out of memory.") or "gpumem: out of memory" in text
    )


# ---- the shim ---------------------------------------------------------------


def _cache_dir():
    # a directory of this user's alone: another user's library there would run as this user
    return _safefs.cache_dir()


def _shim_source():
    return "#define GPUMEM_SHIM_OOM_STATUS %d\n" % errors.ERR_OUT_OF_MEMORY + _csrc_text("shim.cpp")


def _shim_key(torch, source):
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    h = hashlib.sha256()
    for part in (source, torch.__version__, str(abi), sys.platform):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile_direct(torch, source, out_path, libs=("c10",), includes=()):
    """Compiles C++ source into the shared library out_path with the system
    C++ compiler against torch's headers (and includes) and torch's libs
    (the shim needs libc10 only). Returns None, or why it failed."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        return "no C++ compiler (set CXX, or install g++)"
    from torch.utils import cpp_extension

    try:
        paths = cpp_extension.include_paths()
    except TypeError:  # signatures changed across versions
        paths = cpp_extension.include_paths(False)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    workdir = tempfile.mkdtemp(prefix="gpumem-shim-", dir=os.path.dirname(out_path))
    try:
        src = os.path.join(workdir, "source.cpp")
        with open(src, "w") as f:
            f.write(source)
        tmp_out = os.path.join(workdir, "out.so")
        last = None
        for std in ("-std=c++20", "-std=c++17"):
            cmd = [cxx, "-shared", "-fPIC", "-O2", std, "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi]
            cmd += ["-I" + p for p in list(paths) + list(includes)]
            cmd += [src, "-o", tmp_out, "-L" + torch_lib] + ["-l" + lib for lib in libs]
            cmd += ["-Wl,-rpath," + torch_lib]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode == 0:
                os.replace(tmp_out, out_path)  # atomic: concurrent ranks may race
                return None
            last = "%s failed:\n%s" % (" ".join(cmd[:6]), proc.stdout[-2000:])
        return last
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _compile_load_inline(torch, source, name, build_dir):
    """torch.utils.cpp_extension.load_inline (needs ninja). Returns the .so
    path, or raises."""
    from torch.utils import cpp_extension

    kwargs = dict(
        name=name,
        cpp_sources=[source],
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )
    if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
        kwargs["no_implicit_headers"] = True  # only c10/util/Exception.h: seconds, not a minute
    cpp_extension.load_inline(**kwargs)
    path = os.path.join(build_dir, name + ".so")
    if not os.path.exists(path):
        raise RuntimeError("load_inline produced no %s" % path)
    return path


def _build_shim(torch):
    """The path of a compiled shim for this torch (cached), or (None, why)."""
    source = _shim_source()
    key = _shim_key(torch, source)
    cache = _cache_dir()
    out_path = os.path.join(cache, "gpumem_torch_shim_%s.so" % key)
    if os.path.exists(out_path):
        return out_path, None
    reasons = []
    why = _compile_direct(torch, source, out_path)
    if why is None:
        return out_path, None
    reasons.append("direct compile: " + why)
    try:
        from torch.utils import cpp_extension

        if cpp_extension.is_ninja_available():
            build_dir = os.path.join(cache, "load_inline_" + key)
            os.makedirs(build_dir, exist_ok=True)
            return _compile_load_inline(torch, source, "gpumem_torch_shim_" + key, build_dir), None
        reasons.append("load_inline: ninja is not installed")
    except Exception as e:  # a compiler error, a missing header...
        reasons.append("load_inline: %s" % e)
    return None, "; ".join(reasons)


def _fn_addr(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


# ---- statistics in torch's shapes ---------------------------------------------


def _nested_stats(device):
    """torch._C._cuda_memoryStats's nested dict, from gpumem's statistics."""
    flat = _alloc.memory_stats(device)
    out = {}
    for key, value in flat.items():
        if isinstance(value, str):
            continue  # "policy": memory_stats values are numbers
        if value is None:
            value = 0.0
        elif isinstance(value, bool):
            value = int(value)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    # Keys torch's own memory_summary reads that gpumem has no notion of:
    # it never makes oversize segments.
    zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    out.setdefault("oversize_allocations", dict(zero))
    out.setdefault("oversize_segments", dict(zero))
    out.setdefault("num_oom_rejections", 0)
    out.setdefault("max_split_size", -1)
    return out


def _patch(owner, name, new, originals):
    if not hasattr(owner, name):
        return
    originals[(owner, name)] = getattr(owner, name)
    setattr(owner, name, new)


def _install_patches(torch, originals, graphs=False, why_no_graphs=None, frames_path=None):
    C = torch._C

    def memory_stats_c(device=None, *unused):
        return _nested_stats(device)

    def reset_peak_c(device=None, *unused):
        _alloc.reset_peak_memory_stats(device)

    def reset_accumulated_c(device=None, *unused):
        _alloc.reset_accumulated_memory_stats(device)

    def get_fraction_c(device=None, *unused):
        return _alloc.get_per_process_memory_fraction(device)

    def set_fraction_c(fraction, device=None, *unused):
        # gpumem has no "fraction 0": torch's 0 means "allow nothing".
        _alloc.set_per_process_memory_fraction(fraction, device)

    def empty_cache_c(*unused):
        _alloc.empty_cache(None)

    # The C entry points torch.cuda's memory functions call: patching them
    # fixes every caller, including code that imported a function by name
    # before enable() ran.
    _patch(C, "_cuda_memoryStats", memory_stats_c, originals)
    _patch(C, "_cuda_resetPeakMemoryStats", reset_peak_c, originals)
    _patch(C, "_cuda_resetAccumulatedMemoryStats", reset_accumulated_c, originals)
    _patch(C, "_cuda_getMemoryFraction", get_fraction_c, originals)
    _patch(C, "_cuda_setMemoryFraction", set_fraction_c, originals)
    _patch(C, "_cuda_emptyCache", empty_cache_c, originals)

    def memory_summary(device=None, abbreviated=False):
        """gpumem's memory summary (torch's table plus gpumem's figures)."""
        return _alloc.memory_summary(_torch_device(torch, device), abbreviated)

    for mod in (torch.cuda, torch.cuda.memory):
        _patch(mod, "memory_summary", memory_summary, originals)

    # History and snapshots: gpumem records the events and writes the dict
    # memory_viz opens (torch.cuda.memory._dump_snapshot pickles what
    # _snapshot returns). Stack frames come from the full allocator, which
    # gathers each allocation's Python traceback while history records
    # with stacks; without it (the pluggable fallback calls the allocator
    # from C++ with no frames to hand) blocks have none.
    stacks_lib = _frames_library(frames_path)

    def record_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                       device=None, *unused, **unused_kw):
        on = enabled not in (None, False)
        _alloc.record_memory_history(max_entries if on else 0, _torch_device(torch, device))
        if stacks_lib is not None:
            frames = on and context not in (None, False) and stacks in ("all", "python")
            stacks_lib.gpumem_graphs_stacks((2 if stacks == "all" else 1) if frames else 0)

    def record_history_c(enabled=None, *args, **kwargs):
        # (enabled, context, stacks, max_entries, ...) in torch 2.x
        context = kwargs.get("context", args[0] if len(args) > 0 else "all")
        stacks = kwargs.get("stacks", args[1] if len(args) > 1 else "all")
        max_entries = kwargs.get("max_entries", args[2] if len(args) > 2 else sys.maxsize)
        record_history(enabled, context, stacks, max_entries=max_entries)

    def snapshot(*unused, **unused_kw):
        snap = _alloc.memory_snapshot(None)
        if stacks_lib is not None:
            _attach_frames(stacks_lib, snap)
        return snap

    _patch(C, "_cuda_record_memory_history", record_history_c, originals)
    _patch(C, "_cuda_memorySnapshot", snapshot, originals)
    _patch(torch.cuda.memory, "_record_memory_history", record_history, originals)
    _patch(torch.cuda.memory, "_snapshot", snapshot, originals)

    if graphs:
        return  # the full allocator serves graphs, pools and cacheInfo itself
    _keep_cudnn_benchmark_off(torch, originals)

    # Without the full allocator (it did not compile), graphs cannot get
    # their private pools: the pluggable class forwards the pool hooks as
    # std::function, which C cannot call. A capture would record frees and
    # events that break on replay: refuse, saying why.
    graphs_mod = getattr(torch.cuda, "graphs", None)
    graph_cls = getattr(graphs_mod, "CUDAGraph", None)
    if graph_cls is not None and hasattr(graph_cls, "capture_begin"):
        why = why_no_graphs

        def capture_begin(self, *args, **kwargs):
            raise RuntimeError(
                "gpumem: CUDA graph capture needs gpumem's full PyTorch allocator, a C++ library "
                "compiled against the installed torch at enable(), which could not be built "
                "(%s). Install a C++ compiler and the CUDA headers (or fix the error above) and "
                "restart, or run without gpumem.torch.enable() in processes that capture graphs "
                "(torch.cuda.graph, torch.compile(mode='reduce-overhead'))." % (why or "unknown")
            )

        _patch(graph_cls, "capture_begin", capture_begin, originals)


def _frames_library(path):
    """The full allocator's library for its stack-frame entry points, loaded
    as a PyDLL (the GIL stays held while it symbolizes Python frames), or
    None without it."""
    if not path:
        return None
    try:
        _safefs.check_library(path)
        dll = ctypes.PyDLL(path)
        dll.gpumem_graphs_stacks.argtypes = [ctypes.c_int]
        dll.gpumem_graphs_stacks.restype = None
        dll.gpumem_graphs_frames.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_char_p,
                                             ctypes.c_size_t]
        dll.gpumem_graphs_frames.restype = ctypes.c_size_t
        return dll
    except (OSError, AttributeError):
        return None


def _attach_frames(dll, snap):
    """Puts the Python frames the full allocator gathered into a snapshot:
    on every live block, and on the alloc event of each block still live
    (the frames belong to the allocation, not to the address)."""
    blocks = [b for seg in snap.get("segments", []) for b in seg.get("blocks", [])
              if b.get("state") == "active_allocated"]
    live_events = []
    for trace in snap.get("device_traces", []):
        last = {}
        for ev in trace:
            action = ev.get("action")
            if action == "alloc":
                last[ev.get("addr")] = ev
            elif action in ("free_requested", "free_completed"):
                last.pop(ev.get("addr"), None)
        live_events.extend(last.values())
    addrs = sorted({b["address"] for b in blocks} | {ev["addr"] for ev in live_events})
    if not addrs:
        return
    ptrs = (ctypes.c_void_p * len(addrs))(*addrs)
    need = dll.gpumem_graphs_frames(ptrs, len(addrs), None, 0)
    buf = ctypes.create_string_buffer(need)
    dll.gpumem_graphs_frames(ptrs, len(addrs), buf, need)
    frames = {}
    for addr, line in zip(addrs, buf.value.decode("utf-8", "replace").split("\n")):
        if line:
            frames[addr] = [dict(zip(("filename", "line", "name"), f.split("\x1f", 2))) for f in line.split("\x1e")]
    for f in frames.values():
        for fr in f:
            fr["line"] = int(fr.get("line") or 0)
    for b in blocks:
        if b["address"] in frames:
            b["frames"] = frames[b["address"]] + list(b.get("frames") or [])
    for ev in live_events:
        if ev["addr"] in frames:
            ev["frames"] = frames[ev["addr"]] + list(ev.get("frames") or [])


_BENCHMARK_WARNING = (
    "gpumem: torch.backends.cudnn.benchmark=True is kept off: cuDNN's benchmark mode asks the "
    "allocator for cacheInfo (its largest free block), which PyTorch's pluggable allocator interface "
    "does not carry, so the first convolution would fail. cuDNN picks algorithms by its heuristics "
    "instead."
)


def _keep_cudnn_benchmark_off(torch, originals):
    """cuDNN's benchmark mode calls CUDAAllocator::cacheInfo, which
    CUDAPluggableAllocator implements as an error: with it on, every
    convolution fails. Keep it off (warning once) so programs that turn it
    on run unchanged, only without the autotuning."""
    C = torch._C
    setter = getattr(C, "_set_cudnn_benchmark", None)
    if setter is None:
        return
    warned = []

    def set_benchmark(flag, *rest):
        if flag:
            if not warned:
                warned.append(True)
                warnings.warn(_BENCHMARK_WARNING, RuntimeWarning, stacklevel=3)
            flag = False
        return setter(flag, *rest)

    # torch.backends.cudnn.flags() calls the C function by name ...
    _patch(C, "_set_cudnn_benchmark", set_benchmark, originals)
    # ... and `torch.backends.cudnn.benchmark = True` goes through a
    # descriptor that captured the function when torch was imported.
    cudnn = getattr(torch.backends, "cudnn", None)
    prop = type(cudnn).__dict__.get("benchmark") if cudnn is not None else None
    if prop is not None and getattr(prop, "setter", None) is setter:
        originals[(prop, "setter")] = setter
        prop.setter = set_benchmark
    getter = getattr(C, "_get_cudnn_benchmark", None)
    if getter is not None and getter():
        set_benchmark(True)  # turned on before enable(): off, with the warning


# ---- out-of-memory observers ---------------------------------------------------
#
# torch._C._cuda_attach_out_of_memory_observer(fn): fn(device, alloc_size,
# allowed, device_free) once per failure, before the error is raised (people
# dump a snapshot there). Under a pluggable allocator PyTorch has nowhere to
# keep them, so gpumem keeps them here and its library calls them through
# one C callback (gpumem_torch_set_oom_observer), whichever way the error is
# then raised.

_OOM_OBSERVER_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
_oom_observers = []
_oom_callback = None  # the ctypes callback, kept alive while installed


def _call_oom_observers(device, alloc_size, allowed, device_free):
    for obs in list(_oom_observers):
        try:
            obs(device, alloc_size, allowed, device_free)
        except Exception as e:  # as PyTorch does: an observer's failure is printed, not raised
            sys.stderr.write("gpumem: an out-of-memory observer raised %s: %s\n" % (type(e).__name__, e))


def _install_oom_observers(torch, lib, originals):
    global _oom_callback
    if _oom_callback is None:
        _oom_callback = _OOM_OBSERVER_FN(_call_oom_observers)
    lib.gpumem_torch_set_oom_observer(ctypes.cast(_oom_callback, ctypes.c_void_p))

    def attach_out_of_memory_observer(observer):
        if not callable(observer):
            raise TypeError("_cuda_attach_out_of_memory_observer: the observer must be callable")
        _oom_observers.append(observer)

    _patch(torch._C, "_cuda_attach_out_of_memory_observer", attach_out_of_memory_observer, originals)


def _torch_version(torch):
    m = re.match(r"(\d+)\.(\d+)", getattr(torch, "__version__", ""))
    return (int(m.group(1)), int(m.group(2))) if m else (2, 11)


def _torch_device(torch, device):
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    if isinstance(device, int):
        return device
    return torch.cuda._utils._get_device_index(device, optional=True)


# ---- enable -------------------------------------------------------------------


def enable(conf=None, shim=True):
    """Installs gpumem as PyTorch's CUDA allocator.

    conf, when given, becomes GPUMEM_CONF (e.g. "limit:40G" or
    "policy:pytorch"); it is checked first and a bad one raises ConfigError
    naming the key. Must run before PyTorch initializes CUDA (the first CUDA
    tensor, or torch.cuda.init()); after that it raises RuntimeError.
    Calling it again with the same conf (or none) does nothing.

    Out of memory raises torch.OutOfMemoryError whose message opens as
    PyTorch's own does ("CUDA out of memory. Tried to allocate ..."), then
    gpumem's report. shim=False skips compiling the C++ and uses the
    fallback: an out-of-memory then raises RuntimeError with the same
    message (text-matching tools recognise it; `except
    torch.OutOfMemoryError` does not catch it).
    """
    global _state
    torch = _torch()
    with _lock:
        if _state is not None:
            if conf is not None and conf != _state.conf:
                raise RuntimeError(
                    "gpumem.torch.enable: already enabled with conf %r; the allocator cannot be "
                    "reconfigured once installed (use gpumem.set_per_process_memory_fraction or "
                    "Allocator.set_limit for limits)" % (_state.conf,)
                )
            return status()
        if not hasattr(torch._C, "_cuda_customAllocator"):
            raise RuntimeError("gpumem.torch.enable: this PyTorch build has no CUDA support")
        if torch.cuda.is_initialized():
            raise RuntimeError(
                "gpumem.torch.enable() was called too late: PyTorch has already initialized CUDA "
                "and its native allocator. Enable it before the first CUDA tensor (at the top of the "
                "program, before torch.cuda.init(), .cuda(), .to('cuda') or model loading)."
            )
        lib = _lib.require("gpumem_torch_malloc", "gpumem.torch.enable", "torch")
        effective = conf if conf is not None else os.environ.get("GPUMEM_CONF")
        _alloc.check_conf(effective)  # ConfigError now, not at the first allocation
        state = _Enabled()
        state.conf = effective

        if conf is not None:
            os.environ["GPUMEM_CONF"] = conf
        lib.gpumem_torch_set_version(*_torch_version(torch))  # the wording of its OOM message
        _install_oom_observers(torch, lib, state.originals)
        if shim and _install_graphs(torch, lib, state):
            _install_patches(torch, state.originals, graphs=True, frames_path=state.graphs_path)
            _state = state
            return status()

        so_path, malloc_name, free_name = _lib.path(), "gpumem_torch_malloc", "gpumem_torch_free"
        if shim:
            shim_path, why = _build_shim(torch)
            shim_lib = None
            if shim_path:
                try:
                    _safefs.check_library(shim_path)
                    shim_lib = ctypes.CDLL(shim_path)
                    bind = shim_lib.gpumem_shim_bind
                except (OSError, AttributeError) as e:  # a stale or foreign cached file
                    shim_lib = None
                    why = "cannot load %s: %s" % (shim_path, e)
            if shim_lib is not None:
                bind.argtypes = [ctypes.c_void_p] * 4
                bind.restype = None
                bind(
                    _fn_addr(lib, "gpumem_torch_malloc"),
                    _fn_addr(lib, "gpumem_torch_free"),
                    _fn_addr(lib, "gpumem_torch_last_oom"),
                    _fn_addr(lib, "gpumem_torch_last_status"),
                )
                state.shim_lib = shim_lib
                state.shim_path = shim_path
                state.oom_mode = "shim"
                so_path, malloc_name, free_name = shim_path, "gpumem_shim_malloc", "gpumem_shim_free"
            else:
                state.why_no_shim = why
        else:
            state.why_no_shim = "disabled (shim=False)"
        if state.oom_mode is None:
            hook = _torch_check_fail_addr(torch)
            if hook is None:
                raise RuntimeError(
                    "gpumem.torch.enable: cannot make out-of-memory raise in Python: the C++ shim "
                    "could not be built (%s) and libc10 has no %s. Without either, an allocation "
                    "failure would hand PyTorch a NULL pointer. Install a C++ compiler (g++) and "
                    "retry." % (state.why_no_shim, _TORCH_CHECK_FAIL)
                )
            lib.gpumem_torch_set_fail_hook(hook)
            state.oom_mode = "hook"
            if shim:
                warnings.warn(
                    "gpumem: the C++ shim could not be built (%s); out-of-memory will raise "
                    "RuntimeError carrying gpumem's report instead of torch.OutOfMemoryError "
                    "(gpumem.torch.is_oom(e) recognizes both)" % state.why_no_shim,
                    RuntimeWarning,
                    stacklevel=2,
                )

        if conf is not None:
            os.environ["GPUMEM_CONF"] = conf
        try:
            pluggable = torch.cuda.memory.CUDAPluggableAllocator(so_path, malloc_name, free_name)
            raw = pluggable.allocator()
            hooks = (
                ("set_init_fn", "gpumem_torch_init"),
                ("set_reset_fn", "gpumem_torch_reset"),
                ("set_memory_fraction_fn", "gpumem_torch_set_memory_fraction"),
                ("set_base_alloc_fn", "gpumem_torch_base_alloc"),
                ("set_record_stream_fn", "gpumem_torch_record_stream"),
            )
            for setter, fn in hooks:
                if hasattr(raw, setter):
                    getattr(raw, setter)(_fn_addr(lib, fn))
            torch.cuda.memory.change_current_allocator(pluggable)
        except Exception as e:
            if state.oom_mode == "hook":
                lib.gpumem_torch_set_fail_hook(None)
            raise RuntimeError(
                "gpumem.torch.enable: PyTorch refused to change its CUDA allocator (%s). It must "
                "be called before the first CUDA tensor is created." % e
            ) from e
        state.pluggable = pluggable  # torch keeps its own reference too
        _install_patches(torch, state.originals, why_no_graphs=state.why_no_graphs)
        _state = state
        _record_steps_from_conf()
        return status()


def watch_leaks(patience=3, action="warn", device=None):
    """Watches a training loop for leaks with no change to it: after every
    optimizer step (torch.optim's global step hook) a StepLeakWatcher looks
    at what the steps before kept alive, and reports (LeakWarning by
    default; action="raise" raises LeakError, None only records in
    .reports) when patience steps in a row each kept allocations alive past
    the next step, the groups they left with their allocation numbers and
    tags. Returns the watcher; its remove() stops the watching. gpumem must
    serve PyTorch (enable()) for it to see the allocations."""
    _torch()
    # torch.optim does not export its optimizer module as an attribute
    from torch.optim.optimizer import register_optimizer_step_post_hook

    watcher = _alloc.StepLeakWatcher(_alloc.allocator(device), patience, action)
    watcher._hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: watcher.step())
    return watcher


def prefer_host(tensors, device=None):
    """Hint for the overflow tier (GPUMEM_CONF=overflow:host): these
    tensors are cold (optimizer state, master weights: touched once a step)
    and suit host pages. tensors: a tensor, or any iterable of tensors (an
    optimizer's state values, a module's parameters()); what is not a CUDA
    tensor gpumem allocated is passed over. A tensor whose block is in the
    tier, or the whole pages inside its block in an arena, move to host
    pages now if its streams are idle (else first at the next pressure) and
    stay there until freed, at the same address; a block that owns no whole
    page of its own cannot move. Returns the number of
    tensors that took the hint. Raises UnsupportedError when the tier is
    off."""
    torch = _torch()
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    alloc = _alloc.allocator(device)
    taken, seen = 0, set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            continue
        # the allocation's start: a view's storage, not its own offset
        ptr = t.untyped_storage().data_ptr()
        if not ptr or ptr in seen or not alloc.allocation_size(ptr):
            continue
        seen.add(ptr)
        taken += alloc.prefer_host(ptr)
    return taken


def record(path, device=None, steps=True):
    """Records this process's allocations, frees and record_streams on
    device from now on to path (a gzip trace; "%p": the process id, "%d":
    the device), with a "# step N" line after every optimizer step
    (torch.optim's global step hook) when steps is true. Start it before the
    job allocates (weights included), as GPUMEM_CONF=record:PATH does from
    the start. Returns a handle whose stop() finishes the file; replay it
    with `gpumem replay` or `gpumem fit --memory 80G PATH`."""
    _torch()
    alloc = _alloc.allocator(device)
    alloc.record_trace(path)
    hook = None
    if steps:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: alloc.record_step())
    return _Recording(alloc, hook)


class _Recording:
    def __init__(self, alloc, hook):
        self._alloc = alloc
        self._hook = hook

    def stop(self):
        """Stops recording and finishes the file."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._alloc.record_trace(None)


def _record_steps_from_conf():
    """GPUMEM_CONF=record:PATH records from the start; the step markers
    come from the optimizer hook, installed by enable()."""
    conf = os.environ.get("GPUMEM_CONF", "")
    if "record:" not in conf:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    alloc = _alloc.allocator(None)
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: alloc.record_step())


def _torch_check_fail_addr(torch):
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libc10.so", "libc10.dylib"):
        path = os.path.join(torch_lib, name)
        if not os.path.exists(path):
            continue
        try:
            c10 = ctypes.CDLL(path)
            return _fn_addr(c10, _TORCH_CHECK_FAIL)
        except (OSError, AttributeError):
            return None
    return None


# The module functions, under the names torch.cuda uses, for code that
# prefers gpumem.torch.memory_allocated() to torch.cuda's.
memory_stats = _alloc.memory_stats
memory_summary = _alloc.memory_summary
memory_allocated = _alloc.memory_allocated
max_memory_allocated = _alloc.max_memory_allocated
memory_reserved = _alloc.memory_reserved
max_memory_reserved = _alloc.max_memory_reserved
reset_peak_memory_stats = _alloc.reset_peak_memory_stats
empty_cache = _alloc.empty_cache
set_per_process_memory_fraction = _alloc.set_per_process_memory_fraction
mem_get_info = _alloc.mem_get_info
memory_snapshot = _alloc.memory_snapshot
record_memory_history = _alloc.record_memory_history


if __name__ == "__main__":
    # `python -m gpumem.torch script.py`: this file is running as __main__,
    # a copy apart from the gpumem.torch module the script imports; the
    # launcher enables that one (see gpumem/_launch.py).
    from gpumem._launch import main as _launch_main

    sys.exit(_launch_main())
