"""The device memory this process's CUDA context takes, on a GPU other
processes may be using too.

cudaMemGetInfo counts every process's memory as used: total - free -
reserved is this process's context only where nothing else runs on the GPU.
On a shared GPU (a training job beside the recording, a notebook holding a
few GiB) it would count their memory as this job's context and shrink every
answer by it, silently. NVML lists the processes on each device with the
memory each holds, without a CUDA context of its own: the processes listed
before this one first touches CUDA are the others; after, the one entry that
is new is this process, and what it holds beyond what its allocator reserved
is its context.

    before = gpu_context.others()        # before any CUDA call
    ...                                  # the job runs
    bytes, how = gpu_context.measure(before)

NVML is reached through ctypes (libnvidia-ml.so.1, which the driver
installs); where it is missing or answers nothing usable, measure() falls
back on cudaMemGetInfo and says so in `how`."""

import ctypes
import functools

_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE for a process's memory


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t as nvmlDeviceGetComputeRunningProcesses_v3 fills it
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]  # fmt: skip


@functools.lru_cache(maxsize=None)
def _nvml():
    """The initialised NVML library, once per process, or None."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    return lib


def _uuid_key(text):
    text = str(text).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _processes(lib):
    """{device uuid: {pid: bytes or None}} for every device NVML sees, or None."""
    count = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return None
    out = {}
    for i in range(count.value):
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
            return None
        uuid = ctypes.create_string_buffer(96)
        if lib.nvmlDeviceGetUUID(handle, uuid, 96) != 0:
            return None
        infos = (_ProcessInfo * 512)()
        n = ctypes.c_uint(512)
        if lib.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(n), infos) != 0:
            return None
        out[_uuid_key(uuid.value.decode())] = {
            infos[k].pid: (None if infos[k].usedGpuMemory == _NOT_AVAILABLE else int(infos[k].usedGpuMemory))
            for k in range(n.value)
        }
    return out


def others():
    """The processes on each GPU now (call before this process touches
    CUDA), or None where NVML cannot say."""
    lib = _nvml()
    return _processes(lib) if lib else None


def measure(before, device=None):
    """(bytes, how): the device memory this process holds outside its
    allocator's reserved memory, and in words how that was found."""
    import torch

    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    in_use = max(0, total - free - reserved)
    lib = _nvml() if before is not None else None
    now = _processes(lib) if lib else None
    if now is None:
        return attribute(None, None, reserved, in_use)
    key = _uuid_key(torch.cuda.get_device_properties(device).uuid)
    return attribute(before.get(key, {}), now.get(key), reserved, in_use)


def attribute(before, now, reserved, in_use):
    """measure()'s answer from NVML's process lists of this GPU before this
    process's context existed and now ({pid: bytes or None}; None: NVML
    gave none), this process's reserved bytes and cudaMemGetInfo's
    in-use bytes beyond them."""
    fallback = "measured: device memory in use outside the allocator, every process's; "
    if now is None:
        return in_use, fallback + ("NVML not available" if before is None else "NVML does not list this GPU")
    new = {pid: b for pid, b in now.items() if pid not in (before or {})}
    if len(new) != 1 or None in new.values():
        return in_use, fallback + "NVML could not tell this process from the others (%d listed)" % len(now)
    own = next(iter(new.values()))
    others_now = sum(b or 0 for pid, b in now.items() if pid not in new)
    how = "measured"
    if others_now:
        how += ", this process's own; %.3f GiB of other processes on the GPU not counted" % (others_now / 2**30)
    return max(0, own - reserved), how
