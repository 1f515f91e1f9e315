"""gpumem as CuPy's device memory allocator.

    import gpumem.cupy
    gpumem.cupy.enable("limit:8G")
    x = cupy.arange(10**6)            # allocated by gpumem

enable() hands CuPy an allocator function (cupy.cuda.set_allocator). Two
flavours:

- stream_aware=True (the default): each allocation belongs to CuPy's
  current stream (cupy.cuda.get_current_stream()), as CuPy's own memory
  pool does, so memory freed by work on one stream is never handed to
  another before that work is done. Goes through ctypes per allocation.
- stream_aware=False: CuPy's CFunctionAllocator calls gpumem_cupy_malloc /
  gpumem_cupy_free (src/bindings.c) directly; every block belongs to stream
  0. Right for programs that use only CuPy's default stream.

Either way a failed allocation raises an error that is both
cupy.cuda.memory.OutOfMemoryError and gpumem.OutOfMemoryError, carrying
gpumem's report (CuPy itself would wrap the NULL pointer unchecked).

CuPy and PyTorch in one process share gpumem's per-device allocators, so
one limit and one set of statistics cover both. CuPy's pinned-memory pool
(host memory) is untouched.
"""

import ctypes
import importlib
import os
import sys
import threading

from . import _core as _alloc, _lib, errors

_lock = threading.Lock()
_state = None


def _cupy():
    try:
        return importlib.import_module("cupy")
    except ImportError as e:
        raise RuntimeError("gpumem.cupy needs CuPy: %s" % e) from e


_oom_classes = {}


def _oom_class(cupy):
    """An exception class that is both CuPy's and gpumem's OutOfMemoryError."""
    base = getattr(cupy.cuda.memory, "OutOfMemoryError", MemoryError)
    cls = _oom_classes.get(base)
    if cls is None:

        # (a CuPy without the class: gpumem's error alone)
        bases = (errors.OutOfMemoryError,) if base is MemoryError else (base, errors.OutOfMemoryError)

        class CupyOutOfMemoryError(*bases):
            def __init__(self, report, size=0, allocated=0, limit=0, whole=False):
                # CuPy's constructor formats its own message ("Out of memory
                # allocating N bytes (allocated so far: M bytes)."), which
                # code written for CuPy recognises; gpumem's report follows.
                # whole: report is the full message already (unpickling).
                if base is not MemoryError:
                    try:
                        base.__init__(self, size, allocated, limit)
                        head = self.args[0] if self.args else None
                        if not whole and isinstance(head, str):
                            report = "%s %s" % (head, report)
                    except TypeError:
                        base.__init__(self, report)
                errors.GpumemError.__init__(self, report, errors.ERR_OUT_OF_MEMORY)
                self.args = (report,)

            def __str__(self):
                return self.detail

            def __reduce__(self):
                return (type(self), (self.detail, 0, 0, 0, True))

        _oom_classes[base] = cls = CupyOutOfMemoryError
    return cls


def _raise_failure(cupy, size, status, report):
    if status == errors.ERR_OUT_OF_MEMORY:
        allocated = limit = 0
        try:
            stats = _alloc.memory_stats(cupy.cuda.Device().id)
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            limit = int(stats.get("limit_bytes", 0) or 0)
        except Exception:  # figures for the message only
            pass
        raise _oom_class(cupy)(report, size, allocated, limit)
    raise errors.error_for(status or errors.ERR_BACKEND, report)


def is_enabled():
    return _state is not None


def enable(conf=None, stream_aware=True):
    """Makes CuPy allocate device memory through gpumem.

    conf, when given, becomes GPUMEM_CONF (checked first: a bad one raises
    ConfigError naming the key). It applies when gpumem's allocator for a
    device is created, so set it before anything (CuPy or PyTorch) has
    allocated through gpumem."""
    global _state
    cupy = _cupy()
    with _lock:
        lib = _lib.require("gpumem_cupy_malloc", "gpumem.cupy.enable", "CuPy")
        effective = conf if conf is not None else os.environ.get("GPUMEM_CONF")
        _alloc.check_conf(effective)
        if conf is not None:
            os.environ["GPUMEM_CONF"] = conf
        memory = cupy.cuda.memory
        if stream_aware:
            malloc = _stream_aware_allocator(cupy, lib)
        else:
            malloc = _cfunction_allocator(cupy, lib)
        cupy.cuda.set_allocator(malloc)
        _state = {"conf": effective, "stream_aware": stream_aware, "malloc": malloc, "memory": memory}


def disable():
    """Gives CuPy its default memory pool back (memory gpumem handed out
    stays valid until freed)."""
    global _state
    cupy = _cupy()
    with _lock:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        _state = None


def _cfunction_allocator(cupy, lib):
    memory = cupy.cuda.memory
    cfa = memory.CFunctionAllocator(
        0,  # param NULL: the device's gpumem allocator (gpumem_binding_allocator)
        ctypes.cast(lib.gpumem_cupy_malloc, ctypes.c_void_p).value,
        ctypes.cast(lib.gpumem_cupy_free, ctypes.c_void_p).value,
        lib,  # keeps the library (and so the functions) alive
    )
    cfa_malloc = cfa.malloc

    def malloc(size):
        mp = cfa_malloc(size)
        if size and not mp.ptr:
            _raise_failure(
                cupy,
                size,
                lib.gpumem_torch_last_status(),
                (lib.gpumem_torch_last_oom() or b"").decode("utf-8", "replace"),
            )
        return mp

    return malloc


def _stream_aware_allocator(cupy, lib):
    memory = cupy.cuda.memory
    get_stream = cupy.cuda.get_current_stream
    gm_malloc = lib.gpumem_malloc
    gm_free = lib.gpumem_free
    tls = threading.local()  # one out-pointer per thread, reused

    def handle_for(device_id):
        # An atomic load in C after the first call; not cached here so that
        # gpumem.set_allocator() is honoured.
        h = lib.gpumem_binding_allocator(device_id)
        if not h:
            raise errors.error_for(errors.ERR_BACKEND, _lib.last_error())
        return h

    def raw_malloc(size, device_id):
        h = handle_for(device_id)
        box = getattr(tls, "box", None)
        if box is None:
            box = tls.box = ctypes.c_void_p(0)
            tls.ref = ctypes.byref(box)
        st = gm_malloc(h, size, get_stream().ptr, tls.ref)
        if st:
            _raise_failure(cupy, size, st, _lib.last_error())
        return box.value or 0

    def raw_free(ptr, device_id):
        if gm_free(handle_for(device_id), ptr):
            # Runs from a destructor: report, never raise.
            sys.stderr.write(
                "gpumem: free of 0x%x on CUDA device %d failed: %s\n" % (ptr, device_id, _lib.last_error())
            )

    return memory.PythonFunctionAllocator(raw_malloc, raw_free).malloc
