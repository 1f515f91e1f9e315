"""Exceptions raised by the gpumem package.

Every failure of the C library carries a status code and the library's
detailed, thread-local message (gpumem_last_error()): the out-of-memory
report, the configuration key that was wrong, the pointer that was never
allocated. The classes mirror the status codes so callers can catch what
they can act on.
"""

# Status codes of include/gpumem.h (gpumem_status_t).
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_INVALID_POINTER = 2
ERR_OUT_OF_MEMORY = 3
ERR_BACKEND = 4
ERR_CONFIG = 5
ERR_HOST_MEMORY = 6
ERR_UNSUPPORTED = 7
NOT_READY = 8
ERR_IO = 9


class GpumemError(RuntimeError):
    """A gpumem call failed. ``status`` is the C status code, ``detail`` the
    library's message (also the exception's text)."""

    def __init__(self, detail, status=ERR_BACKEND):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class OutOfMemoryError(GpumemError, MemoryError):
    """The device or the limit could not satisfy an allocation, after the
    cache was emptied and retried. The text is gpumem's report: what was
    asked, what is held, the largest free block, the fragmentation, the
    limit, and advice."""

    def __init__(self, detail, status=ERR_OUT_OF_MEMORY):
        super().__init__(detail, status)


class ConfigError(GpumemError, ValueError):
    """A configuration string (GPUMEM_CONF or conf=) is malformed; the text
    names the key and the valid choices."""

    def __init__(self, detail, status=ERR_CONFIG):
        super().__init__(detail, status)


class InvalidPointerError(GpumemError, ValueError):
    """A pointer that is not a live allocation of this allocator: never
    allocated, already freed, or pointing inside an allocation."""

    def __init__(self, detail, status=ERR_INVALID_POINTER):
        super().__init__(detail, status)


class InvalidArgumentError(GpumemError, ValueError):
    """A bad size, fraction or option."""

    def __init__(self, detail, status=ERR_INVALID_ARGUMENT):
        super().__init__(detail, status)


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a str where an int is wanted, a bool
    for a size): an InvalidArgumentError, and a TypeError as Python code
    expects. Out-of-range integers and strings holding a NUL are
    InvalidArgumentError (a ValueError): C would cut the one to its type's
    width and end the other at the NUL, silently."""


class UnsupportedError(GpumemError):
    """The backend lacks what the call needs (e.g. no CUDA driver or GPU)."""

    def __init__(self, detail, status=ERR_UNSUPPORTED):
        super().__init__(detail, status)


class LeakError(GpumemError):
    """Raised by gpumem.leak_check(action="raise") when allocations made
    inside the block are still live after it. ``leaks`` is the report as a
    dict (gpumem_print_leaks_json); the text is the readable report."""

    def __init__(self, detail, leaks=None):
        super().__init__(detail, ERR_INVALID_ARGUMENT)
        self.leaks = leaks


class LeakWarning(UserWarning):
    """Warned by gpumem.leak_check() (the default action) when allocations
    made inside the block are still live after it."""


class LibraryNotFoundError(GpumemError, ImportError):
    """libgpumem.so could not be found or loaded; the text lists every
    place that was tried."""

    def __init__(self, detail):
        GpumemError.__init__(self, detail, ERR_IO)


_BY_STATUS = {
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_INVALID_POINTER: InvalidPointerError,
    ERR_OUT_OF_MEMORY: OutOfMemoryError,
    ERR_CONFIG: ConfigError,
    ERR_UNSUPPORTED: UnsupportedError,
}

STATUS_NAMES = {
    OK: "success",
    ERR_INVALID_ARGUMENT: "invalid argument",
    ERR_INVALID_POINTER: "invalid pointer",
    ERR_OUT_OF_MEMORY: "out of memory",
    ERR_BACKEND: "device error",
    ERR_CONFIG: "bad configuration",
    ERR_HOST_MEMORY: "out of host memory",
    ERR_UNSUPPORTED: "unsupported",
    NOT_READY: "not ready",
    ERR_IO: "input/output error",
}


def error_for(status, detail):
    """The exception instance for a failed status and its message."""
    if not detail:
        detail = STATUS_NAMES.get(status, "gpumem status %d" % status)
    cls = _BY_STATUS.get(status, GpumemError)
    if cls is GpumemError:
        return GpumemError(detail, status)
    return cls(detail)
