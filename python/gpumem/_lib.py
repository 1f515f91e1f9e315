"""Finding and loading libgpumem.so, and the ctypes prototypes of the C API.

The package is pure Python: everything goes through ctypes into the shared
library the C build produces. The library is looked for, in order:

1. the file named by the GPUMEM_LIBRARY environment variable (only it,
   when set: an explicit choice that cannot be used is an error, not a
   reason to pick another library);
2. libgpumem.so inside this package (what `pip install` builds and ships);
3. the build tree of a source checkout (<repo>/build/libgpumem.so, the
   package living in <repo>/python/gpumem);
4. the system's library path (ctypes.util.find_library("gpumem")).

A library is used only if it exports every entry point the package calls
and gpumem_version() says it is this package's version (VERSION). When none
qualifies, LibraryNotFoundError lists every place tried and why.
"""

import ctypes
import ctypes.util
import os
import threading

from . import errors

# The package's version; the library's gpumem_version() must be its major
# * 1000 + minor (GPUMEM_VERSION in include/gpumem.h). The build backend
# checks that it agrees with CMakeLists.txt's project version.
VERSION = "0.1.0"
_MAJOR, _MINOR = (int(x) for x in VERSION.split(".")[:2])
ABI_VERSION = _MAJOR * 1000 + _MINOR

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_lib = None
_lib_path = None

# Opaque structures are handled as buffers this large: the library's
# *_init functions write sizeof(their struct) bytes and record it in
# struct_size, so a library with grown structs stays safe to call.
_OPTS_BUF = 1024

size_t = ctypes.c_size_t
ssize_t = ctypes.c_ssize_t
vp = ctypes.c_void_p
u32 = ctypes.c_uint32
u64 = ctypes.c_uint64
cint = ctypes.c_int
cstr = ctypes.c_char_p
WRITE_FN = ctypes.CFUNCTYPE(cint, ctypes.c_char_p, size_t, vp)


class SimOptions(ctypes.Structure):
    """gpumem_sim_options_t (include/gpumem_backend.h), padded for growth."""

    _fields_ = [
        ("struct_size", u32),
        ("capacity", size_t),
        ("page_size", size_t),
        ("descending_addresses", cint),
        ("host_backed", cint),
        ("event_delay_queries", cint),
        ("virtual_memory", cint),
        ("plain_memory", cint),
        ("_reserved", ctypes.c_char * _OPTS_BUF),
    ]


class CudaOptions(ctypes.Structure):
    """gpumem_cuda_options_t (include/gpumem_backend.h), padded for growth."""

    _fields_ = [
        ("struct_size", u32),
        ("device", cint),
        ("virtual_memory", cint),
        ("peer_access_mask", u64),
        ("_reserved", ctypes.c_char * _OPTS_BUF),
    ]


class SharedBudget(ctypes.Structure):
    """gpumem_shared_budget_t (include/gpumem.h)."""

    _fields_ = [
        ("struct_size", u32),
        ("limit", u64),
        ("total", u64),
        ("mine", u64),
        ("allocators", cint),
        ("path", ctypes.c_char * 300),
    ]


# name: (restype, argtypes). Only what the package calls.
_PROTOTYPES = {
    "gpumem_version": (cint, []),
    "gpumem_strerror": (cstr, [cint]),
    "gpumem_backend_call_name": (cstr, [cint]),
    "gpumem_last_error": (cstr, []),
    "gpumem_options_init": (None, [vp]),
    "gpumem_options_parse": (cint, [vp, cstr]),
    "gpumem_parse_size": (cint, [cstr, ctypes.POINTER(size_t)]),
    "gpumem_create": (vp, [vp, vp, ctypes.POINTER(cint)]),
    "gpumem_destroy": (None, [vp]),
    "gpumem_default": (vp, [cint]),
    "gpumem_malloc": (cint, [vp, size_t, ctypes.c_size_t, ctypes.POINTER(vp)]),
    "gpumem_free": (cint, [vp, vp]),
    "gpumem_record_stream": (cint, [vp, vp, ctypes.c_size_t]),
    "gpumem_prefer_host": (cint, [vp, vp]),
    "gpumem_empty_cache": (cint, [vp]),
    "gpumem_allocation_size": (size_t, [vp, vp]),
    "gpumem_set_limit": (cint, [vp, size_t]),
    "gpumem_set_limit_fraction": (cint, [vp, ctypes.c_double]),
    "gpumem_remove_limit": (None, [vp]),
    "gpumem_get_limit": (size_t, [vp]),
    "gpumem_reset_peak_stats": (None, [vp]),
    "gpumem_reset_accumulated_stats": (None, [vp]),
    "gpumem_print_summary": (cint, [vp, WRITE_FN, vp]),
    "gpumem_print_stats_json": (cint, [vp, WRITE_FN, vp]),
    "gpumem_check": (size_t, [vp]),
    "gpumem_record_history": (cint, [vp, size_t]),
    "gpumem_set_history_tag": (None, [vp, u64]),
    "gpumem_record_trace": (cint, [vp, cstr]),
    "gpumem_record_step": (None, [vp]),
    "gpumem_leak_mark": (u64, [vp]),
    "gpumem_leak_check_now": (None, [vp, cstr]),
    "gpumem_shared_budget": (cint, [vp, ctypes.POINTER(SharedBudget)]),
    "gpumem_publish": (cint, [vp]),
    "gpumem_sim_options_init": (None, [ctypes.POINTER(SimOptions)]),
    "gpumem_sim_create": (vp, [ctypes.POINTER(SimOptions)]),
    "gpumem_sim_destroy": (None, [vp]),
    "gpumem_sim_fail": (None, [vp, cint, ctypes.c_long, ctypes.c_long, cint]),
    "gpumem_sim_fail_clear": (None, [vp]),
    "gpumem_sim_host_ptr": (vp, [vp, ctypes.c_size_t]),
    "gpumem_cuda_options_init": (None, [ctypes.POINTER(CudaOptions)]),
    "gpumem_cuda_create": (vp, [ctypes.POINTER(CudaOptions), ctypes.POINTER(cint)]),
    "gpumem_cuda_destroy": (None, [vp]),
    # src/bindings.c
    "gpumem_binding_allocator": (vp, [cint]),
    "gpumem_binding_peek": (vp, [cint]),
    "gpumem_binding_set_allocator": (cint, [cint, vp]),
    "gpumem_binding_stats_json": (size_t, [vp, ctypes.c_char_p, size_t]),
    "gpumem_binding_summary": (size_t, [vp, ctypes.c_char_p, size_t]),
    "gpumem_binding_summary_flags": (size_t, [vp, cint, ctypes.c_char_p, size_t]),
    "gpumem_binding_snapshot_json": (size_t, [vp, cint, cstr, ctypes.c_char_p, size_t]),
    "gpumem_binding_leaks": (size_t, [vp, u64, cint, ctypes.c_char_p, size_t]),
    "gpumem_torch_malloc": (vp, [ssize_t, cint, vp]),
    "gpumem_torch_free": (None, [vp, ssize_t, cint, vp]),
    "gpumem_torch_init": (None, [cint]),
    "gpumem_torch_reset": (None, []),
    "gpumem_torch_set_memory_fraction": (None, [ctypes.c_double, cint]),
    "gpumem_torch_base_alloc": (vp, [vp, ctypes.POINTER(size_t)]),
    "gpumem_torch_record_stream": (None, [vp, vp]),
    "gpumem_torch_empty_cache": (cint, [cint]),
    "gpumem_torch_last_oom": (cstr, []),
    "gpumem_torch_last_status": (cint, []),
    "gpumem_torch_set_fail_hook": (None, [vp]),
    "gpumem_torch_set_version": (None, [cint, cint]),
    "gpumem_torch_segment_size": (u64, [u64]),
    "gpumem_torch_set_oom_observer": (None, [vp]),
    "gpumem_cupy_malloc": (vp, [vp, size_t, cint]),
    "gpumem_cupy_free": (None, [vp, vp, cint]),
}

# Entry points added by src/bindings.c; a library built before it lacks
# them, which only the framework integrations need.
_OPTIONAL_PREFIXES = ("gpumem_binding_", "gpumem_torch_", "gpumem_cupy_")


def candidates():
    """(path or name, how it was found), in the order they are tried; lazy,
    since asking the system's library path runs ldconfig."""
    env = os.environ.get("GPUMEM_LIBRARY")
    if env:
        yield env, "GPUMEM_LIBRARY"
    yield os.path.join(_PKG_DIR, "libgpumem.so"), "inside the package"
    repo = os.path.dirname(os.path.dirname(_PKG_DIR))
    yield os.path.join(repo, "build", "libgpumem.so"), "source checkout build tree"
    found = ctypes.util.find_library("gpumem")
    yield (found or "libgpumem.so"), "system library path"


def _bind(lib):
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name.startswith(_OPTIONAL_PREFIXES):
                continue
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return missing


def _version_text(v):
    return "%d.%d" % (v // 1000, v % 1000)


def _try(path):
    """The library at path, bound, or None and why it cannot be used."""
    if os.sep in path and not os.path.exists(path):
        return None, "no such file"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, str(e)
    if not hasattr(lib, "gpumem_version"):
        return None, "a gpumem library older than this package (no gpumem_version); rebuild it"
    missing = _bind(lib)
    if missing:
        return None, "lacks %s" % ", ".join(missing)
    version = lib.gpumem_version()
    if version != ABI_VERSION:
        return None, "is gpumem %s, this package is %s" % (_version_text(version), VERSION)
    return lib, None


def load():
    """The loaded library (cached). Raises LibraryNotFoundError."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        env_set = bool(os.environ.get("GPUMEM_LIBRARY"))
        for path, how in candidates():
            lib, why = _try(path)
            if lib is None:
                tried.append("  %s (%s): %s" % (path, how, why))
                if how == "GPUMEM_LIBRARY":
                    break
                continue
            _lib = lib
            _lib_path = os.path.abspath(path) if os.sep in path else _loaded_path(lib, path)
            return _lib
        if env_set:
            hint = "GPUMEM_LIBRARY names a library that cannot be used: unset it or point it at one that can"
        else:
            hint = (
                "reinstall the package (pip install <gpumem checkout> builds the library into it), "
                "or build it with `make build` in the checkout and set GPUMEM_LIBRARY to build/libgpumem.so"
            )
        raise errors.LibraryNotFoundError(
            "gpumem: cannot load libgpumem.so %s; tried:\n%s\n%s."
            % (VERSION, "\n".join(tried), hint)
        )


def _loaded_path(lib, name):
    """Absolute path of a library loaded by bare name (from /proc/self/maps),
    since the torch and CuPy integrations must name the exact file."""
    try:
        addr = ctypes.cast(lib.gpumem_strerror, vp).value
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) < 6:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return parts[5]
    except (OSError, ValueError, AttributeError):
        pass
    return name


def path():
    """Absolute path of the loaded library."""
    load()
    return _lib_path


def has(name):
    return hasattr(load(), name)


def require(entry, caller, what):
    """The loaded library, after checking it exports `entry` (an older build may not)."""
    lib = load()
    if not hasattr(lib, entry):
        raise RuntimeError(
            "%s: %s lacks the %s entry points (src/bindings.c); rebuild it" % (caller, path(), what)
        )
    return lib


def last_error():
    msg = load().gpumem_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status, what=None):
    """Raises the exception for a failed status with the library's detail."""
    if status == errors.OK:
        return
    detail = last_error()
    if what and not detail:
        detail = "%s: %s" % (what, errors.STATUS_NAMES.get(status, status))
    raise errors.error_for(status, detail)


def options_buffer():
    """A gpumem_options_t filled with defaults, as an opaque buffer."""
    buf = ctypes.create_string_buffer(_OPTS_BUF)
    load().gpumem_options_init(buf)
    return buf


def parse_conf(conf, buf=None):
    """Applies a configuration string to an options buffer (new one when
    buf is None). Raises ConfigError naming the key."""
    if buf is None:
        buf = options_buffer()
    if conf:
        check(load().gpumem_options_parse(buf, conf.encode()))
    return buf


def read_text(fn, *args, cap=16384, failed=None, what=None):
    """Text of a gpumem_binding_* function fn(*args, buf, cap), which returns the
    length the text needs: called again with a larger buffer until it fits
    (the state may grow between two calls). failed: the status to raise
    (naming what) when fn returns 0, which it does only on failure."""
    while True:
        buf = ctypes.create_string_buffer(cap)
        n = fn(*args, buf, cap)
        if n == 0 and failed is not None:
            check(failed, what)
        if n < cap:
            return buf.value.decode("utf-8", "replace")
        cap = n + n // 4 + 1


def print_to_string(fn, handle):
    """Text of a gpumem_print_* call through a write callback (for
    libraries without the buffer helpers)."""
    pieces = []

    def sink(text, length, _arg):
        pieces.append(ctypes.string_at(text, length))
        return 0

    cb = WRITE_FN(sink)
    rc = fn(handle, cb, None)
    if rc:
        raise errors.GpumemError("gpumem: formatting statistics failed (%d)" % rc, rc)
    return b"".join(pieces).decode("utf-8", "replace")
