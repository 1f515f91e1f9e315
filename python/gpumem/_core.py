"""gpumem allocators from Python: the Allocator class over one gpumem_t, and
the torch.cuda-shaped module functions over the per-device allocators that
also serve PyTorch and CuPy (see src/bindings.c).

Addresses are plain ints (device pointers); streams are ints too (the
cudaStream_t value, 0 for the default stream; torch.cuda.Stream and
cupy.cuda.Stream objects are accepted and their handle used).
"""

import atexit
import ctypes
import gc
import json
import math
import operator
import os
import sys
import threading
import warnings

from . import _lib, errors


# ctypes cuts an int to its C type's width without a word (2**64 + 4096
# passed as size_t is 4096): every integer crossing into C is checked here
# against its C type's range, and a wrong type raises gpumem's error.
_SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
_PTR_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1
_U64_MAX = (1 << 64) - 1
_INT_MAX = (1 << 31) - 1
_INT_MIN = -(1 << 31)
_LONG_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_long) - 1)) - 1
_LONG_MIN = -_LONG_MAX - 1

# The simulated device's memory when capacity is not given: the command
# line's default (gpumem replay --capacity), so that a trace replayed from
# Python and from the shell meets the same device.
SIM_CAPACITY = 1 << 40

ArgumentTypeError = errors.ArgumentTypeError


def _checked_int(value, what, low=0, high=_SIZE_MAX):
    """value as an int in [low, high]; InvalidArgumentError otherwise (a
    bool, a float, a str and an int out of range alike)."""
    if isinstance(value, bool):
        raise ArgumentTypeError("gpumem: %s must be an int, not a bool" % what)
    try:
        value = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            "gpumem: %s must be an int, not %s" % (what, type(value).__name__)
        ) from None
    if not low <= value <= high:
        raise errors.InvalidArgumentError(
            "gpumem: %s %d is out of range (%d to %d)" % (what, value, low, high)
        )
    return value


def _checked_text(value, what, path=False):
    """value as the bytes C will read: a str (path=True: also bytes or an
    os.PathLike) holding no NUL, which would end the string there and
    silently make it another one."""
    if path:
        try:
            value = os.fspath(value)
        except TypeError:
            raise ArgumentTypeError(
                "gpumem: %s must be a str or a path, not %s" % (what, type(value).__name__)
            ) from None
    if isinstance(value, str):
        data = os.fsencode(value) if path else value.encode()
    elif path and isinstance(value, bytes):
        data = value
    else:
        raise ArgumentTypeError("gpumem: %s must be a str, not %s" % (what, type(value).__name__))
    if b"\0" in data:
        raise errors.InvalidArgumentError(
            "gpumem: %s contains a NUL character at %d (C would end the string there)"
            % (what, data.index(b"\0"))
        )
    return data


def _checked_size(value, what, high=_SIZE_MAX):
    """A byte count given the way sizes are given everywhere in gpumem: an
    int, or a size string ("4096", "4G", "1.5GiB"; parse_size)."""
    if isinstance(value, str):
        value = _parse_size_text(value, what)
    return _checked_int(value, what, 0, high)


def _checked_fraction(fraction):
    """A fraction as a float; InvalidArgumentError for a wrong type (the
    library refuses values outside (0, 1] itself, naming them)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ArgumentTypeError(
            "gpumem: fraction must be a number, not %s" % type(fraction).__name__
        )
    if not math.isfinite(fraction):
        raise errors.InvalidArgumentError("gpumem: fraction %r is not a finite number" % fraction)
    return float(fraction)


def _checked_conf(conf):
    """A configuration string (or None) that C will read whole: a NUL would
    end it early, silently."""
    if conf is None:
        return None
    if not isinstance(conf, str):
        raise errors.ConfigError("gpumem: conf must be a str, not %s" % type(conf).__name__)
    if "\0" in conf:
        raise errors.ConfigError(
            "gpumem: conf contains a NUL character at %d (it would end the string there)"
            % conf.index("\0")
        )
    return conf


def _stream_handle(stream):
    """The integer handle of a stream given as an int, None, or a torch /
    CuPy stream object."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return _checked_int(stream, "stream handle", 0, _PTR_MAX)
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return _checked_int(value, "stream handle", 0, _PTR_MAX)
    raise ArgumentTypeError(
        "gpumem: stream must be an int handle or a torch/CuPy stream, not %r" % (stream,)
    )


def _ptr_value(ptr):
    if isinstance(ptr, int) and not isinstance(ptr, bool):
        return _checked_int(ptr, "pointer", 0, _PTR_MAX)
    value = getattr(ptr, "data_ptr", None)  # a torch tensor
    if callable(value):
        return _checked_int(value(), "pointer", 0, _PTR_MAX)
    raise ArgumentTypeError("gpumem: pointer must be an int address, not %r" % (ptr,))


def flatten_stats(obj, prefix=""):
    """gpumem's stats JSON (flat torch keys plus nested extras) as one flat
    dict: {"allocated_bytes.all.current": 0, ..., "backend_calls.map": 3}."""
    out = {}
    for key, value in obj.items():
        name = prefix + key
        if isinstance(value, dict):
            out.update(flatten_stats(value, name + "."))
        else:
            out[name] = value
    return out


def _stats_json(handle):
    lib = _lib.load()
    if hasattr(lib, "gpumem_binding_stats_json"):
        text = _lib.read_text(lib.gpumem_binding_stats_json, handle)
    else:
        text = _lib.print_to_string(lib.gpumem_print_stats_json, handle)
    return json.loads(text)


# Keys of the statistics JSON that are not statistics: memory_stats()
# values are numbers, as torch.cuda.memory_stats()'s are, so these are
# reached elsewhere (Allocator.policy).
_NOT_STATS = ("policy",)


def _stats_of(handle):
    """memory_stats(): every key torch.cuda.memory_stats() has, plus
    gpumem's figures, all numbers (virtual_memory 0 or 1)."""
    out = {}
    for key, value in flatten_stats(_stats_json(handle)).items():
        if key in _NOT_STATS:
            continue
        if isinstance(value, bool):
            value = int(value)
        elif value is None:  # a figure with no meaningful value (JSON null)
            value = 0.0
        out[key] = value
    # A library built before max_split_size and the oversize counts were
    # in its JSON: torch's values for an allocator that makes no oversize
    # blocks and has no max_split_size.
    out.setdefault("max_split_size", -1)
    for name in ("oversize_allocations", "oversize_segments"):
        for metric in ("current", "peak", "allocated", "freed"):
            out.setdefault("%s.%s" % (name, metric), 0)
    return out


# Entries recorded at most: torch's default for max_entries is sys.maxsize
# (no bound), gpumem's ring is allocated whole (48 bytes an entry).
MAX_HISTORY_ENTRIES = 1 << 22


def _snapshot_of(handle, device, tag_file=None):
    """gpumem_snapshot_json of one allocator as a dict, in the shape of
    torch.cuda.memory._snapshot()."""
    name = None if tag_file is None else _checked_text(tag_file, "tag_file", path=True)
    text = _lib.read_text(
        _lib.load().gpumem_binding_snapshot_json,
        handle,
        _checked_int(device, "device", 0, _INT_MAX),
        name or None,
        cap=1 << 20,
        failed=errors.ERR_INVALID_ARGUMENT,
        what="memory_snapshot",
    )
    snap = json.loads(text)
    for seg in snap["segments"]:
        seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
    return snap


def _leaks_of(handle, since, as_json):
    """gpumem_print_leaks(_json) of one allocator: a dict, or the text."""
    text = _lib.read_text(
        _lib.load().gpumem_binding_leaks,
        handle,
        _checked_int(since, "since", 0, _U64_MAX),
        1 if as_json else 0,
        failed=errors.ERR_HOST_MEMORY,
        what="leaks",
    )
    return json.loads(text) if as_json else text


def _empty_snapshot():
    return {"segments": [], "device_traces": [], "gpumem": {}}


def _merge_snapshot(into, device, snap):
    into["segments"].extend(snap["segments"])
    traces = into["device_traces"]
    while len(traces) <= device:
        traces.append([])
    traces[device] = snap["device_traces"][device]
    into["gpumem"][device] = snap["gpumem"]


# gpumem_format_summary_flags' GPUMEM_SUMMARY_ABBREVIATED (include/gpumem.h).
_SUMMARY_ABBREVIATED = 1
_POOL_ROWS = ("      from large pool", "      from small pool")


def _summary_of(handle, abbreviated=False):
    """The summary table; abbreviated: each metric's total row alone, as
    torch.cuda.memory_summary(abbreviated=True) prints it."""
    lib = _lib.load()
    if hasattr(lib, "gpumem_binding_summary_flags"):
        flags = _SUMMARY_ABBREVIATED if abbreviated else 0
        return _lib.read_text(lib.gpumem_binding_summary_flags, handle, flags)
    if hasattr(lib, "gpumem_binding_summary"):
        text = _lib.read_text(lib.gpumem_binding_summary, handle)
    else:
        text = _lib.print_to_string(lib.gpumem_print_summary, handle)
    if abbreviated:  # a library without the flag: drop the pool rows here
        text = "".join(
            line for line in text.splitlines(True) if not line[2:].startswith(_POOL_ROWS)
        )
    return text


class Allocator:
    """One gpumem allocator.

    device="sim" makes a simulated device (no GPU needed): capacity and
    page_size in bytes or size strings ("8G"; defaults 1 TiB, as the
    command line's --capacity, and 2 MiB), host_backed=True backs every
    byte with host memory so contents can be read and written through
    host_view(). Any other device (an int N, "cuda", "cuda:N", a
    torch.device: the forms the module functions take) makes a new
    allocator over that CUDA device (the per-device allocators that
    PyTorch and CuPy use are reached through the module functions
    instead). conf is a configuration string such as
    "policy:pytorch,limit:4G" (the grammar of GPUMEM_CONF).

    Use as a context manager, or call close(): it frees the device memory
    the allocator holds, live allocations included.
    """

    def __init__(self, device="sim", conf=None, capacity=None, page_size=None, host_backed=False):
        lib = _lib.load()
        self._lib = lib
        self._gm = None
        self._backend = None
        self._backend_kind = None
        self._owned = True
        self._lock = threading.Lock()
        opts = _lib.parse_conf(_checked_conf(conf))  # raises ConfigError before touching a device
        is_sim = isinstance(device, str) and device.strip() == "sim"
        if is_sim:
            sim = _lib.SimOptions()
            lib.gpumem_sim_options_init(ctypes.byref(sim))
            sim.capacity = _checked_size(SIM_CAPACITY if capacity is None else capacity, "capacity")
            if page_size is not None:
                sim.page_size = _checked_size(page_size, "page_size")
            sim.host_backed = 1 if host_backed else 0
            backend = lib.gpumem_sim_create(ctypes.byref(sim))
            if not backend:
                raise errors.InvalidArgumentError(
                    _lib.last_error() or "gpumem: cannot create the simulated device"
                )
            self._backend_kind = "sim"
            device = "sim"
        else:
            device = device_index(device)  # InvalidArgumentError for anything else
            if capacity is not None or page_size is not None or host_backed:
                raise errors.InvalidArgumentError(
                    "gpumem: capacity, page_size and host_backed apply to device='sim' only"
                )
            copts = _lib.CudaOptions()
            lib.gpumem_cuda_options_init(ctypes.byref(copts))
            copts.device = device
            st = ctypes.c_int(0)
            backend = lib.gpumem_cuda_create(ctypes.byref(copts), ctypes.byref(st))
            if not backend:
                _lib.check(st.value or errors.ERR_BACKEND, "gpumem_cuda_create")
            self._backend_kind = "cuda"
        self._backend = backend
        st = ctypes.c_int(0)
        gm = lib.gpumem_create(backend, opts, ctypes.byref(st))
        if not gm:
            detail = _lib.last_error()
            self._destroy_backend()
            raise errors.error_for(st.value or errors.ERR_BACKEND, detail)
        self._gm = gm
        self.device = device

    @classmethod
    def _wrap(cls, handle, device):
        """A non-owning view of an existing gpumem_t (close() does nothing)."""
        self = cls.__new__(cls)
        self._lib = _lib.load()
        self._gm = handle
        self._backend = None
        self._backend_kind = None
        self._owned = False
        self._lock = threading.Lock()
        self.device = device
        return self

    # -- lifetime --

    def _destroy_backend(self):
        if self._backend:
            if self._backend_kind == "sim":
                self._lib.gpumem_sim_destroy(self._backend)
            else:
                self._lib.gpumem_cuda_destroy(self._backend)
        self._backend = None

    def close(self):
        """Frees everything the allocator holds and the allocator itself."""
        with self._lock:
            if not self._owned or self._gm is None:
                self._gm = None
                return
            self._lib.gpumem_destroy(self._gm)
            self._gm = None
            self._destroy_backend()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may be gone
            pass

    @property
    def closed(self):
        return self._gm is None

    @property
    def handle(self):
        """The gpumem_t* as an int (for C code, or CuPy's param)."""
        return self._h()

    def _h(self):
        if self._gm is None:
            raise ValueError("gpumem: the allocator is closed")
        return self._gm

    def __repr__(self):
        state = "closed" if self._gm is None else "0x%x" % self._gm
        return "<gpumem.Allocator device=%r %s>" % (self.device, state)

    # -- allocation --

    def malloc(self, size, stream=0):
        """Allocates size bytes usable on stream; returns the device address
        (0 for size 0). Raises OutOfMemoryError with gpumem's report."""
        if isinstance(size, int) and size < 0:
            raise errors.InvalidArgumentError("gpumem: malloc size %d is negative" % size)
        size = _checked_int(size, "malloc size")
        out = ctypes.c_void_p(0)
        _lib.check(self._lib.gpumem_malloc(self._h(), size, _stream_handle(stream), ctypes.byref(out)))
        return out.value or 0

    def free(self, ptr):
        """Frees an address malloc returned (0 is a no-op). Raises
        InvalidPointerError for anything else."""
        _lib.check(self._lib.gpumem_free(self._h(), _ptr_value(ptr) or None))

    def record_stream(self, ptr, stream):
        """Marks ptr as used on stream: its memory is reused only after the
        work queued there before the free has completed."""
        _lib.check(
            self._lib.gpumem_record_stream(self._h(), _ptr_value(ptr) or None, _stream_handle(stream))
        )

    def prefer_host(self, ptr):
        """Hint (option overflow:host): the allocation at ptr is cold and
        suits host pages. Returns True when the block takes the hint: a
        block of the overflow tier, or one in an arena with whole pages of
        its own (they move to host pages now if its streams are idle, else
        at the next pressure first of all, and stay there until freed);
        False when it lies in an arena and owns no whole page there that
        may move. Raises UnsupportedError when the tier is off,
        InvalidPointerError for anything but a live allocation."""
        st = self._lib.gpumem_prefer_host(self._h(), _ptr_value(ptr) or None)
        if st == errors.ERR_UNSUPPORTED and "lies in an arena" in _lib.last_error():
            return False
        _lib.check(st)
        return True

    def allocation_size(self, ptr):
        """Size the allocation at ptr was asked for, 0 if ptr is not one."""
        return self._lib.gpumem_allocation_size(self._h(), _ptr_value(ptr) or None)

    def empty_cache(self):
        """Returns every cached, unused page or segment to the device."""
        _lib.check(self._lib.gpumem_empty_cache(self._h()))

    # -- limits --

    def set_limit(self, nbytes):
        """Caps reserved memory at nbytes (an int, or a size string like "4G")."""
        nbytes = _checked_size(nbytes, "limit")
        _lib.check(self._lib.gpumem_set_limit(self._h(), nbytes))

    def set_limit_fraction(self, fraction):
        """Caps reserved memory at fraction (0, 1] of the device's memory."""
        _lib.check(self._lib.gpumem_set_limit_fraction(self._h(), _checked_fraction(fraction)))

    def remove_limit(self):
        self._lib.gpumem_remove_limit(self._h())

    def get_limit(self):
        """The cap in bytes, 0 when none."""
        return self._lib.gpumem_get_limit(self._h())

    # -- statistics --

    def memory_stats(self):
        """Statistics as a flat dict with every key of
        torch.cuda.memory_stats() ("allocated_bytes.all.current",
        "num_ooms", "max_split_size", "oversize_segments.peak", ...), plus
        gpumem's own figures (largest_free_block, fragmentation,
        backend_calls.<kind>, ...); every value a number."""
        return _stats_of(self._h())

    def memory_summary(self, abbreviated=False):
        """The table torch.cuda.memory_summary() prints, plus gpumem's
        figures; abbreviated=True leaves out the per-pool rows, as torch's
        does."""
        return _summary_of(self._h(), abbreviated)

    @property
    def policy(self):
        """The allocation policy in use: "default" or "pytorch" (option
        policy). Not in memory_stats(), whose values are all numbers."""
        return _stats_json(self._h()).get("policy", "unknown")

    def publish(self):
        """Publishes the figures `gpumem top` shows now (they are otherwise
        published every 64 operations and when reserved memory changes).
        UnsupportedError when publication is off (option publish)."""
        _lib.check(self._lib.gpumem_publish(self._h()), "publish")

    # -- history and snapshots --

    def record_memory_history(self, max_entries=100000):
        """Records the last max_entries allocations, frees and out-of-memory
        failures (torch.cuda.memory._record_memory_history); 0 or None stops
        and forgets them."""
        n = min(_checked_int(max_entries or 0, "max_entries"), MAX_HISTORY_ENTRIES)
        _lib.check(self._lib.gpumem_record_history(self._h(), n), "record_memory_history")

    def record_trace(self, path):
        """Records every allocation, free and record_stream from now on to
        path as a gzip trace that `gpumem replay` and `gpumem fit` read
        ("%p": the process id, "%d": the device); None stops and finishes
        the file."""
        arg = None if path is None else _checked_text(path, "path", path=True)
        _lib.check(self._lib.gpumem_record_trace(self._h(), arg), "record_trace")

    def record_step(self):
        """Marks the end of a training step in the recorded trace."""
        self._lib.gpumem_record_step(self._h())

    def set_history_tag(self, tag):
        """Events recorded and allocations made from now on carry tag (an
        int; 0 none): the snapshot shows it as their frame's line, leak
        reports as their tags."""
        self._lib.gpumem_set_history_tag(self._h(), _checked_int(tag, "tag", 0, _U64_MAX))

    def memory_snapshot(self, device=0, tag_file=None):
        """Segments, blocks and recorded events as the dict
        torch.cuda.memory._snapshot() returns (pickle it for PyTorch's
        memory_viz), plus "gpumem": what that shape has no room for."""
        device = _checked_int(device, "device", 0, _INT_MAX)
        snap = _snapshot_of(self._h(), device, tag_file)
        snap["gpumem"] = {int(device): snap["gpumem"]}
        return snap

    def shared_budget(self):
        """The shared budget this allocator belongs to (option shared_limit)
        as a dict: limit, total (every allocator in it), mine, allocators,
        path. UnsupportedError without one."""
        b = _lib.SharedBudget()
        _lib.check(self._lib.gpumem_shared_budget(self._h(), ctypes.byref(b)), "shared_budget")
        return {
            "limit": b.limit,
            "total": b.total,
            "mine": b.mine,
            "allocators": b.allocators,
            "path": b.path.decode("utf-8", "replace"),
        }

    # -- leak detection --

    def leak_mark(self):
        """The number of allocations made so far (never reset): pass it to
        leaks() to see which allocations made after it are still live."""
        return self._lib.gpumem_leak_mark(self._h())

    def leaks(self, since=0):
        """The live allocations made after mark since (0: all) as a dict:
        count, bytes, requested_bytes, oldest, newest, made and "groups"
        (one requested size on one stream each, most bytes first: count,
        bytes, first and last serial, first_tag and last_tag, addresses)."""
        return _leaks_of(self._h(), since, True)

    def leak_report(self, since=0):
        """leaks() as readable text."""
        return _leaks_of(self._h(), since, False)

    def leak_check(self, action="warn", collect=True):
        """A context manager that reports the allocations made inside it
        and still live after it (see gpumem.leak_check)."""
        return LeakCheck(self, action, collect)

    def reset_peak_stats(self):
        self._lib.gpumem_reset_peak_stats(self._h())

    def reset_accumulated_stats(self):
        self._lib.gpumem_reset_accumulated_stats(self._h())

    def check(self):
        """Verifies every invariant of the allocator's structures; returns the
        number of violations (0 = consistent). The first one is described by
        last_error()."""
        return self._lib.gpumem_check(self._h())

    # -- the simulated device --

    def _sim(self):
        if self._backend_kind != "sim":
            raise errors.UnsupportedError("gpumem: this needs an Allocator(device='sim')")
        return self._backend

    def sim_fail(self, kind=-1, skip=0, count=1, status=errors.ERR_OUT_OF_MEMORY):
        """Scripted device failures: after `skip` more calls of `kind` (a
        backend call index or name such as "map", -1 for any) succeed, the
        next `count` fail (count < 0: every later one) with `status` (a
        failure status of gpumem.errors)."""
        sim = self._sim()
        kind = _call_kind(kind)
        skip = _checked_int(skip, "skip", 0, _LONG_MAX)
        count = _checked_int(count, "count", _LONG_MIN, _LONG_MAX)
        status = _checked_int(status, "status", _INT_MIN, _INT_MAX)
        if status == errors.OK or status not in errors.STATUS_NAMES:
            raise errors.InvalidArgumentError(
                "gpumem: status %d is not a failure status (%s)"
                % (status, ", ".join(str(k) for k in sorted(errors.STATUS_NAMES) if k))
            )
        self._lib.gpumem_sim_fail(sim, kind, skip, count, status)

    def sim_fail_clear(self):
        self._lib.gpumem_sim_fail_clear(self._sim())

    def host_view(self, ptr, size):
        """A writable memoryview of size bytes at device address ptr on a
        host-backed simulated device."""
        size = _checked_int(size, "size", 0, _PTR_MAX)
        host = self._lib.gpumem_sim_host_ptr(self._sim(), _ptr_value(ptr))
        if not host:
            raise errors.InvalidPointerError(
                "gpumem: 0x%x is not mapped on this device (or it is not host-backed)" % _ptr_value(ptr)
            )
        return memoryview((ctypes.c_char * size).from_address(host)).cast("B")


def _call_kind(kind):
    """A backend call kind for sim_fail: -1 (any), an index, or a name."""
    lib = _lib.load()
    names = []
    while True:
        name = lib.gpumem_backend_call_name(len(names))
        if not name:
            break
        names.append(name.decode())
    if isinstance(kind, str):
        if kind not in names:
            raise errors.InvalidArgumentError(
                "gpumem: kind %r is not a backend call (%s)" % (kind, ", ".join(names))
            )
        return names.index(kind)
    return _checked_int(kind, "kind", -1, len(names) - 1)


def last_error():
    """The C library's detail message for the last failure on this thread."""
    return _lib.last_error()


def _parse_size_text(text, what):
    data = _checked_text(text, what)
    out = ctypes.c_size_t(0)
    status = _lib.load().gpumem_parse_size(data, ctypes.byref(out))
    if status != errors.OK:
        raise errors.error_for(status, "gpumem: %s %r: %s" % (what, text, _lib.last_error()))
    return out.value


def parse_size(text):
    """Bytes in a size string: "123", "4K", "1.5G", "2GiB" (binary units);
    an int is returned as it is, once checked to fit a size_t."""
    if isinstance(text, str):
        return _parse_size_text(text, "size")
    return _checked_int(text, "size")


def check_conf(conf):
    """Raises ConfigError (naming the key) when conf is not a valid
    configuration string."""
    _lib.parse_conf(_checked_conf(conf))


# ---- the per-device allocators (the ones PyTorch and CuPy use) ----------


def _current_device():
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return torch.cuda.current_device()
        except Exception:
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            return cupy.cuda.runtime.getDevice()
        except Exception:
            pass
    return 0


def device_index(device=None):
    """A CUDA device ordinal from None or "cuda" (the current device), an
    int, a "cuda:N" (or "N") string, a torch.device or a cupy Device.
    ArgumentTypeError for another type, InvalidArgumentError for a
    negative or too large ordinal or a string of another form."""
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise ArgumentTypeError("gpumem: device must be an int, a string or a device object, not a bool")
    if isinstance(device, int):
        return _checked_int(device, "device", 0, _INT_MAX)
    if isinstance(device, str):
        text = device.strip()
        if text == "cuda":
            return _current_device()
        digits = text[5:] if text.startswith("cuda:") else text
        if not (digits.isascii() and digits.isdigit()):
            raise errors.InvalidArgumentError(
                "gpumem: device %r is not \"cuda\", \"cuda:N\" or a device ordinal" % (device,)
            )
        return _checked_int(int(digits), "device", 0, _INT_MAX)
    if hasattr(type(device), "__index__"):  # numpy integers and the like
        return _checked_int(device, "device", 0, _INT_MAX)
    kind = getattr(device, "type", None)  # torch.device
    if isinstance(kind, str) and kind != "cuda":
        raise errors.InvalidArgumentError("gpumem: device %r is not a CUDA device" % (device,))
    for attr in ("index", "id"):  # torch.device, cupy.cuda.Device
        value = getattr(device, attr, None)
        if value is None and attr == "index" and kind == "cuda":
            return _current_device()
        if isinstance(value, int) and not isinstance(value, bool):
            return _checked_int(value, "device", 0, _INT_MAX)
    raise ArgumentTypeError("gpumem: cannot tell a CUDA device from %r" % (device,))


_views = {}


def allocator(device=None):
    """The Allocator (a non-owning view) serving device for PyTorch, CuPy
    and these functions: gpumem_default(device), configured from GPUMEM_CONF,
    created on first use."""
    lib = _lib.load()
    idx = device_index(device)
    handle = lib.gpumem_binding_allocator(idx)
    if not handle:
        raise errors.error_for(errors.ERR_BACKEND, _lib.last_error())
    view = _views.get(idx)
    if view is None or view._gm != handle:
        view = _views[idx] = Allocator._wrap(handle, idx)
    return view


def set_allocator(device, alloc):
    """Serves device from alloc (an Allocator; None for the default) for
    PyTorch, CuPy and these functions. Only while nothing is allocated on
    the device through them."""
    lib = _lib.load()
    idx = device_index(device)
    if alloc is not None and not isinstance(alloc, Allocator):
        raise ArgumentTypeError(
            "gpumem: alloc must be a gpumem.Allocator or None, not %s" % type(alloc).__name__
        )
    handle = None if alloc is None else alloc.handle
    _lib.check(lib.gpumem_binding_set_allocator(idx, handle))
    _views.pop(idx, None)
    if alloc is not None:
        _views[idx] = alloc


def _peek(device):
    """The serving allocator's handle, or None when the device has not been
    used (statistics are then all zero: nothing is created for asking)."""
    return _lib.load().gpumem_binding_peek(device_index(device)) or None


def memory_stats(device=None):
    """torch.cuda.memory_stats() for gpumem: a flat dict of statistics."""
    return _stats_of(_peek(device))


def record_memory_history(max_entries=100000, device=None):
    """Records the last max_entries events of device's allocator (the one
    PyTorch and CuPy use; created if needed); 0 or None stops."""
    allocator(device).record_memory_history(max_entries)


class LeakCheck:
    """What gpumem.leak_check() returns: a context manager. On exit it
    collects Python's cyclic garbage (collect=True: tensors only a cycle
    holds are not leaks), then looks for allocations made inside the block
    that are still live. ``leaks`` is the report (a dict, count 0 when
    clean), ``report`` its text. action: "warn" (LeakWarning), "raise"
    (LeakError, unless the block raised), or None (only record)."""

    def __init__(self, alloc, action="warn", collect=True):
        if action not in ("warn", "raise", None):
            raise errors.InvalidArgumentError(
                'gpumem: action must be "warn", "raise" or None, not %r' % (action,)
            )
        self.allocator = alloc
        self.action = action
        self.collect = collect
        self.mark = None
        self.leaks = None
        self.report = None

    def __enter__(self):
        if self.collect:
            gc.collect()
        self.mark = self.allocator.leak_mark()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.collect:
            gc.collect()
        self.leaks = self.allocator.leaks(self.mark)
        self.report = self.allocator.leak_report(self.mark)
        if not self.leaks["count"] or self.action is None:
            return False
        if self.action == "raise" and exc_type is None:
            raise errors.LeakError(self.report, self.leaks)
        if self.action == "warn":
            warnings.warn(self.report, errors.LeakWarning, stacklevel=2)
        return False


class StepLeakWatcher:
    """Finds a loop that keeps something every step, without marks in the
    user's code: call step() at the end of each step (gpumem.torch.
    watch_leaks() calls it after every optimizer step). A step is suspect
    when allocations it made are still live after a later step ended;
    patience suspect steps in a row (the steps before the current one) make
    a report: the groups those steps left, warned (LeakWarning), raised
    (LeakError) or only kept in ``reports``. What a loop makes once and keeps
    (weights, optimizer state made in the first step) is one suspect step,
    not patience of them; gradients freed when the next step zeroes them are
    not live by then. After a report the count starts again."""

    def __init__(self, alloc, patience=3, action="warn"):
        patience = _checked_int(patience, "patience", 1, _INT_MAX)
        if action not in ("warn", "raise", None):
            raise errors.InvalidArgumentError(
                'gpumem: action must be "warn", "raise" or None, not %r' % (action,)
            )
        self.allocator = alloc
        self.patience = int(patience)
        self.action = action
        self.steps = 0
        self.reports = []
        self._marks = [alloc.leak_mark()]  # the mark at each step's end, oldest first
        self._hook = None  # what calls step(), when something does (gpumem.torch)

    def remove(self):
        """Stops the calls to step() that gpumem.torch.watch_leaks installed."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def step(self):
        """Ends a step; returns the report (a dict) when one is made."""
        self.steps += 1
        self._marks.append(self.allocator.leak_mark())
        del self._marks[: -(self.patience + 2)]
        if len(self._marks) < self.patience + 2:
            return None
        # the completed steps before the current one: (marks[i], marks[i + 1]]
        window = self._marks[:-1]
        live = [self.allocator.leaks(m)["count"] for m in window]
        if not all(live[i] > live[i + 1] for i in range(len(live) - 1)):
            return None
        report = self.allocator.leaks(window[0])
        report["steps"] = self.steps
        text = self.allocator.leak_report(window[0])
        self.reports.append(report)
        self._marks = self._marks[-1:]
        msg = "the last %d steps (to step %d) each kept allocations alive past the next step:\n%s" % (
            self.patience,
            self.steps,
            text,
        )
        if self.action == "raise":
            raise errors.LeakError(msg, report)
        if self.action == "warn":
            warnings.warn(msg, errors.LeakWarning, stacklevel=3)
        return report


def leak_check(device=None, action="warn", collect=True):
    """with gpumem.leak_check(): step() -- reports the allocations of
    device's allocator (the one PyTorch and CuPy use) made inside the block
    and still live after it: a training step that keeps a tensor each time
    shows one group whose count is the number of steps. See LeakCheck."""
    return LeakCheck(allocator(device), action, collect)


def _leak_check_at_exit():
    """Option leak_check: the per-device allocators report what they still
    hold while Python's module globals still hold their tensors (C's exit
    handlers run after finalization has freed them)."""
    try:
        lib = _lib.load()
    except Exception:
        return
    for d in range(_MAX_DEVICES):
        handle = lib.gpumem_binding_peek(d)
        if handle:
            lib.gpumem_leak_check_now(handle, b"at exit")


atexit.register(_leak_check_at_exit)


def leak_mark(device=None):
    """Allocator.leak_mark() of device's allocator."""
    return allocator(device).leak_mark()


def leaks(since=0, device=None):
    """Allocator.leaks() of device's allocator."""
    return allocator(device).leaks(since)


# Devices a snapshot of "every device" looks at (gpumem's own bound).
_MAX_DEVICES = 64


def memory_snapshot(device=None):
    """torch.cuda.memory._snapshot() for gpumem: the segments, blocks and
    recorded events of the allocators PyTorch and CuPy use (device None:
    every device that has one), plus "gpumem": {device: what PyTorch's
    shape has no room for}."""
    out = _empty_snapshot()
    devices = range(_MAX_DEVICES) if device is None else [device_index(device)]
    for d in devices:
        handle = _lib.load().gpumem_binding_peek(d)
        if handle:
            _merge_snapshot(out, d, _snapshot_of(handle, d))
    return out


def memory_summary(device=None, abbreviated=False):
    """torch.cuda.memory_summary() for gpumem: torch's table plus gpumem's
    figures; abbreviated=True leaves out the per-pool ("from large pool",
    "from small pool") rows, as torch's does."""
    return _summary_of(_peek(device), abbreviated)


def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device=None):
    handle = _peek(device)
    if handle:
        _lib.load().gpumem_reset_peak_stats(handle)


def reset_accumulated_memory_stats(device=None):
    handle = _peek(device)
    if handle:
        _lib.load().gpumem_reset_accumulated_stats(handle)


def empty_cache(device=None):
    """Returns cached memory to the driver: every device used so far when
    device is None (as torch.cuda.empty_cache does), else that one."""
    lib = _lib.load()
    idx = -1 if device is None else device_index(device)
    _lib.check(lib.gpumem_torch_empty_cache(idx))


def set_per_process_memory_fraction(fraction, device=None):
    """Caps device's reserved memory at fraction of its total memory."""
    if not isinstance(fraction, (float, int)) or isinstance(fraction, bool):
        raise ArgumentTypeError("gpumem: fraction must be a float, not %s" % type(fraction).__name__)
    if not 0 <= fraction <= 1:  # NaN included
        raise errors.InvalidArgumentError("gpumem: fraction %r is outside 0 to 1" % (fraction,))
    allocator(device).set_limit_fraction(_checked_fraction(fraction))


def get_per_process_memory_fraction(device=None):
    """The cap as a fraction of the device's memory (1.0 when none)."""
    stats = memory_stats(device)
    limit, total = stats.get("limit_bytes", 0), stats.get("device_total", 0)
    if not limit or not total:
        return 1.0
    return min(1.0, limit / total)


def mem_get_info(device=None):
    """(free, total) bytes of the device, as the driver reports them."""
    stats = allocator(device).memory_stats()
    return stats.get("device_free", 0), stats.get("device_total", 0)
