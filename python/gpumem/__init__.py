"""gpumem: a caching GPU memory allocator, from Python.

Pure Python over ctypes: the C library (libgpumem.so) does the work. See
docs/python.md.

    import gpumem
    with gpumem.Allocator("sim", capacity=1 << 30) as a:   # no GPU needed
        p = a.malloc(1 << 20)
        print(a.memory_stats()["allocated_bytes.all.current"])
        a.free(p)

    import gpumem.torch
    gpumem.torch.enable("limit:40G")   # before the first CUDA tensor

The module functions (memory_stats, memory_allocated, empty_cache,
set_per_process_memory_fraction, ...) mirror torch.cuda's and act on the
per-device allocators that PyTorch and CuPy use once enabled.
"""

from . import errors
from ._lib import VERSION as __version__
from ._lib import load as load_library
from ._lib import path as library_path
from ._core import (
    SIM_CAPACITY,
    Allocator,
    LeakCheck,
    StepLeakWatcher,
    allocator,
    check_conf,
    device_index,
    empty_cache,
    get_per_process_memory_fraction,
    last_error,
    leak_check,
    leak_mark,
    leaks,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_summary,
    parse_size,
    record_memory_history,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_allocator,
    set_per_process_memory_fraction,
)
from .errors import (
    ArgumentTypeError,
    ConfigError,
    GpumemError,
    InvalidArgumentError,
    InvalidPointerError,
    LeakError,
    LeakWarning,
    LibraryNotFoundError,
    OutOfMemoryError,
    UnsupportedError,
)


__all__ = [
    "Allocator",
    "ArgumentTypeError",
    "ConfigError",
    "GpumemError",
    "InvalidArgumentError",
    "InvalidPointerError",
    "LeakCheck",
    "LeakError",
    "LeakWarning",
    "LibraryNotFoundError",
    "OutOfMemoryError",
    "SIM_CAPACITY",
    "StepLeakWatcher",
    "UnsupportedError",
    "allocator",
    "check_conf",
    "device_index",
    "empty_cache",
    "errors",
    "get_per_process_memory_fraction",
    "last_error",
    "leak_check",
    "leak_mark",
    "leaks",
    "library_path",
    "load_library",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_summary",
    "parse_size",
    "record_memory_history",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_allocator",
    "set_per_process_memory_fraction",
]
