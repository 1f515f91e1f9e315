"""One rank of a torchrun job (DDP, FSDP2), recorded on fake CUDA tensors.

A script written for torchrun reads RANK, WORLD_SIZE and LOCAL_RANK, calls
init_process_group (backend nccl) and wraps its model with
DistributedDataParallel or fully_shard. `python -m gpumem.predict --gpus
1,2,4,8` runs it once per rank it records, in a child process whose
environment says which rank of how many it is (child_env), with the CPU
recorder (recorder.py) and this module's session() around it:

- init_process_group and new_group get PyTorch's fake process group
  (backend "fake" on a FakeStore, torch.testing's fake_pg) whatever backend
  the script asks for: collectives run on fake tensors and move no data, so
  the rank sees its own shards, buckets and buffers, each of its real size;
- the CUDA streams the job makes are told apart, and every allocation is
  recorded on the stream current when it is made, as the caching allocator
  assigns a block to its stream (FSDP2 allocates its all-gather outputs on
  its copy-in stream and its reduce-scatter outputs on its reduce-scatter
  stream); record_stream() calls become the trace's 'r' lines;
- a DTensor's operators are recorded on the tensors inside it (the
  recorder's dispatch mode lets DTensor unwrap them), so FSDP2's sharded
  parameters, gradients and optimizer state are the rank's local shards;
- a storage resized in place (FSDP2 frees the unsharded parameters after
  forward and backward by resizing their storages to 0, and allocates them
  again at the next all-gather) is a free and an allocation, as on the GPU;
- what a fake group cannot answer is stood in for: the check that every
  rank has the same parameter shapes (an all-gather whose output a fake
  group leaves unwritten) is skipped, DDP's built-in all-reduce hook (whose
  future the fake group leaves empty) is PyTorch's Python one, device
  indices name the one fake device, FSDP2's test of whether a shard is
  still the tensor it padded (by type and address, which fake tensors lack)
  is made by storage, and the tensors DTensor makes at the global shape to
  work out an operator's output are not taken for the job's memory.

What only a real GPU shows (the memory NCCL takes outside the caching
allocator, per communicator and rank) comes from the device profile:
nccl_bytes() and the profile keys named there. command() is `python -m
gpumem.predict --gpus`: which ranks to record at each world size, their
scaling, the table (docs/predict.md, "Several GPUs")."""

import contextlib
import functools
import inspect
import itertools
import os
import shutil
import sys
import weakref

from . import recorder

__all__ = ["child_env", "wanted", "session", "rank_and_world", "nccl_bytes", "rank_classes", "command", "ENV"]

# Set to "1" in a child's environment by the command: record as one rank of
# WORLD_SIZE on the fake process group.
ENV = "GPUMEM_PREDICT_DISTRIBUTED"
MASTER_PORT = 29500  # torchrun's default; the fake store never listens on it


def child_env(env, rank, world_size):
    """env (a dict) as torchrun would give rank `rank` of `world_size` on
    one node, and the marker that turns the session on."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError("rank %r of world size %r" % (rank, world_size))
    out = dict(env)
    out.update({
        ENV: "1",
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(MASTER_PORT),
        "TORCHELASTIC_RUN_ID": "gpumem-predict",
    })  # fmt: skip
    return out


def wanted(env=None):
    return (os.environ if env is None else env).get(ENV) == "1"


def rank_and_world(env=None):
    """(rank, world size, local world size) from the environment, checked."""
    env = os.environ if env is None else env
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE", world))
    except (KeyError, ValueError) as e:
        raise recorder.RecorderError("a distributed recording needs RANK and WORLD_SIZE in the environment (%s)" % e)
    if world < 1 or not 0 <= rank < world or local < 1:
        raise recorder.RecorderError("RANK %d and WORLD_SIZE %d do not make a rank" % (rank, world))
    return rank, world, local


# ---- streams ------------------------------------------------------------------


class _Streams:
    """The CUDA streams of the job: the default stream is 0, each stream the
    job makes gets the next number, and the current one is the stream a new
    allocation belongs to."""

    def __init__(self):
        self.ids = itertools.count(1)
        self.default = _Stream(self, 0)
        self.current = self.default


class _Stream:
    """torch.cuda.Stream on fake tensors: work is ordered already, so waits
    and events do nothing; what matters is which stream is current."""

    def __init__(self, streams, stream_id=None):
        self._streams = streams
        self.stream_id = next(streams.ids) if stream_id is None else stream_id
        self._before = []

    cuda_stream = property(lambda self: self.stream_id)
    device = property(lambda self: _torch().device("cuda", 0))
    device_index = 0
    device_type = 1  # c10::DeviceType::CUDA
    priority = 0

    def __enter__(self):
        self._before.append(self._streams.current)
        self._streams.current = self
        return self

    def __exit__(self, *exc):
        self._streams.current = self._before.pop()
        return False

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def query(self):
        return True

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def __repr__(self):
        return "<fake CUDA stream %d>" % self.stream_id


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.0


def _torch():
    import torch

    return torch


def _stream_patches(torch, streams):
    c = torch.cuda

    class Stream(_Stream):  # (a class: code annotates with torch.cuda.Stream | None)
        def __init__(self, device=None, priority=0, **kwargs):
            _Stream.__init__(self, streams)

    @contextlib.contextmanager
    def stream(s=None):
        if s is None:
            yield
            return
        with s:
            yield

    def set_stream(s):
        streams.current = s

    def rng_state(device=None):
        # DTensor's random operators on shards kept on the host (CPU offload)
        # move the CUDA generator's Philox offset around each one: a seed and
        # an offset, 8 bytes each, on the host, that no value of a fake tensor
        # depends on. A fake one: the fake mode would run a real one's copy to
        # the device for real, as a constant.
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        state = torch.zeros(16, dtype=torch.uint8)
        mode = next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, FakeTensorMode)), None)
        return state if mode is None else mode.from_tensor(state)

    noop = lambda *a, **k: None  # noqa: E731
    return {
        (c, "get_rng_state"): rng_state,
        (c, "set_rng_state"): noop,
        (c, "Stream"): Stream,
        (c, "Event"): _Event,
        (c, "current_stream"): lambda device=None: streams.current,
        (c, "default_stream"): lambda device=None: streams.default,
        (c, "stream"): stream,
        (c, "set_stream"): set_stream,
    }


# ---- storages: resized in place, used on other streams ----------------------------


def _storage_patches(torch, rec):
    """UntypedStorage.resize_ as the caching allocator sees it: resizing a
    CUDA storage to 0 frees its block; resizing it from 0 allocates one
    (on the current stream); resizing it from one size to another allocates
    the new block before the old one is freed."""
    real_resize = torch.UntypedStorage.resize_
    live = rec.storages  # storage key -> allocation id (recorder._tracker)
    emptied = set()  # keys of CUDA storages resized to 0 here

    def free_later(key, i):
        if live.get(key) == i:
            del live[key]
        if not rec.closed:
            rec.free(i)

    def resize(storage, nbytes):
        key = storage._cdata
        old, before = live.get(key), storage.nbytes()
        out = real_resize(storage, nbytes)
        nbytes = int(nbytes)
        if (old is None and key not in emptied) or nbytes == before:
            return out  # not a CUDA storage of the job's (a real CPU tensor's, a meta one's), or no change
        if nbytes > 0:
            new = rec.alloc(nbytes)
            live[key] = new
            emptied.discard(key)
            weakref.finalize(storage, free_later, key, new)
        elif old is not None:
            live.pop(key, None)
            emptied.add(key)
            weakref.finalize(storage, emptied.discard, key)  # (its address may be another storage's later)
        if old is not None:
            rec.free(old)
        return out

    real_data_ptr = torch.UntypedStorage.data_ptr

    def data_ptr(storage):
        # A fake storage has no address (0), so code that asks whether two
        # tensors share memory (FSDP2's re-padding of a shard it already
        # padded) takes them for different: a live CUDA storage of the job's
        # answers with its own handle, unique while it lives, and 0 once
        # resized to nothing, as the GPU's null pointer.
        if storage._cdata in live:
            return storage._cdata if storage.nbytes() > 0 else 0
        return real_data_ptr(storage)

    return {(torch.UntypedStorage, "resize_"): resize, (torch.UntypedStorage, "data_ptr"): data_ptr}


def _record_stream_patch(torch, rec):
    """Tensor.record_stream(s): the trace's 'r ID STREAM' line for the
    allocation under the tensor (the method itself: a fake stream is no
    torch.Stream for the argument parser that a function mode would see)."""

    def record_stream(t, stream):
        if t.device.type == "cuda":
            i = rec.storages.get(t.untyped_storage()._cdata)
            if i is not None:
                rec.use(i, getattr(stream, "stream_id", 0))

    return {(torch.Tensor, "record_stream"): record_stream}


# ---- the process group ----------------------------------------------------------------


def _group_patches(torch, rec, rank, world, local_world, groups, used):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    real_init, real_new_group = c10d.init_process_group, c10d.new_group

    signature = inspect.signature(real_init)

    def init_process_group(*args, **kwargs):
        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise recorder.RecorderError("init_process_group: %s" % e) from None
        r, w = given.get("rank", -1), given.get("world_size", -1)
        if w not in (-1, world) or r not in (-1, rank):
            raise recorder.RecorderError(
                "init_process_group was given rank %s of world size %s, but this recording is rank %d of %d"
                % (r, w, rank, world)
            )
        backend = given.get("backend")
        rec.note("the job's process group (backend %s) was PyTorch's fake group: collectives moved no data; "
                 "what NCCL takes outside the caching allocator comes from the device profile"
                 % (backend or "the default"))  # fmt: skip
        extra = {k: given[k] for k in ("timeout", "group_name") if given.get(k) is not None}
        real_init("fake", store=FakeStore(), rank=rank, world_size=world, **extra)
        g = c10d._get_default_group()
        groups.append(g)
        if given.get("device_id") is not None:
            # with a device, ProcessGroupNCCL makes its communicator at once
            used[g.group_name] = g.size()

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
        device_id = kwargs.pop("device_id", None)
        g = real_new_group(ranks, timeout, None, None, *args, **kwargs)
        if g is not None and g is not c10d.GroupMember.NON_GROUP_MEMBER:
            groups.append(g)
            if device_id is not None:
                used[g.group_name] = g.size()
        return g

    patches = {
        (c10d, "init_process_group"): init_process_group,
        (dist, "init_process_group"): init_process_group,
        (c10d, "new_group"): new_group,
        (dist, "new_group"): new_group,
        (torch.cuda, "device_count"): lambda: local_world,
        # FSDP2's default mesh and DeviceMesh ask which accelerator there is
        (torch._C, "_get_accelerator"): lambda: torch.device("cuda", 0),
    }
    # Every rank builds the same model: the check that says so is an
    # all-gather whose output a fake group leaves as it was.
    from torch.distributed import utils as dist_utils
    from torch.nn.parallel import distributed as ddp

    skip = lambda *a, **k: None  # noqa: E731
    patches[(dist_utils, "_verify_param_shape_across_processes")] = skip
    patches[(ddp, "_verify_param_shape_across_processes")] = skip
    init = ddp.DistributedDataParallel.__init__

    @functools.wraps(init)
    def ddp_init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        # the fake tensors live on cuda:0 whatever LOCAL_RANK says
        device_ids = None if device_ids is None else [0 for _ in device_ids]
        output_device = None if output_device is None else 0
        init(self, module, device_ids, output_device, *args, **kwargs)
        if getattr(self, "logger", None) is not None:
            self.logger = _QuietLogger(self.logger)

    patches[(ddp.DistributedDataParallel, "__init__")] = ddp_init
    patches.update(_ddp_hook_patches(torch, dist, ddp))
    return patches


class _QuietLogger:
    """DDP's logger, less its runtime statistics: they time the steps with
    CUDA events, which a build without CUDA has no timer for."""

    def __init__(self, logger):
        self._logger = logger

    def set_runtime_stats_and_log(self):
        pass

    def __getattr__(self, name):
        return getattr(self._logger, name)


class _DoneWork:
    """The Work of a collective on the fake group, whose future holds the
    tensors as NCCL's does (the fake group's own holds None, which DDP's
    communication hooks cannot take)."""

    def __init__(self, work, tensors):
        self._work, self._tensors = work, tensors

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        fut = _torch().futures.Future()
        fut.set_result(self._tensors)
        return fut

    def __getattr__(self, name):
        return getattr(self._work, name)


def _ddp_hook_patches(torch, dist, ddp):
    """DDP's reducer calls its communication hook's future for each bucket;
    its built-in all-reduce runs in C++ on the fake group's empty future and
    fails. So a job with no hook of its own gets PyTorch's Python all-reduce
    hook (default_hooks.allreduce_hook: the same in-place division and
    all-reduce, allocating nothing) at its first forward, and dist.all_reduce
    with async_op gives a future holding its tensor."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    real_all_reduce = c10d.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        return _DoneWork(work, [tensor]) if async_op else work

    cls = ddp.DistributedDataParallel
    pre_forward = cls._pre_forward

    @functools.wraps(pre_forward)
    def ddp_pre_forward(self, *inputs, **kwargs):
        if not self._comm_hooks and not getattr(self, "_gpumem_hook", False):
            self._gpumem_hook = True
            self.register_comm_hook(self.process_group, default_hooks.allreduce_hook)
        return pre_forward(self, *inputs, **kwargs)

    def refuse_builtin(self, comm_hook_type):
        raise recorder.RecorderError(
            "DistributedDataParallel's built-in communication hook %s runs in C++ on the fake process group, "
            "whose collectives return no tensors: register its Python form instead "
            "(torch.distributed.algorithms.ddp_comm_hooks)" % comm_hook_type
        )

    return {
        (c10d, "all_reduce"): all_reduce,
        (dist, "all_reduce"): all_reduce,
        (cls, "_pre_forward"): ddp_pre_forward,
        (cls, "_register_builtin_comm_hook"): refuse_builtin,
    }


# ---- code that runs inside the backward but is not the backward's -----------------------


def _outside_engine(fn):
    """fn run as the recorder sees code outside autograd's engine: FSDP2's
    hooks make tensors and compare devices in Python during the backward,
    where the recorder shows the engine's stream bookkeeping CUDA tensors
    as CPU ones (recorder._in_engine)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        depth = recorder._engine.depth
        recorder._engine.depth = 0
        try:
            return fn(*args, **kwargs)
        finally:
            recorder._engine.depth = depth

    return run


_FSDP_HOOKS = {
    "_fsdp_param_group.FSDPParamGroup": ("pre_forward", "post_forward", "pre_backward", "post_backward",
                                         "unshard", "wait_for_unshard", "reshard", "finalize_backward"),
    "_fsdp_state.FSDPState": ("_root_pre_forward", "_pre_forward", "_post_forward", "_pre_backward",
                              "_root_post_backward_final_callback"),
}  # fmt: skip


def _fsdp_patches():
    import importlib

    patches = {}
    for where, names in _FSDP_HOOKS.items():
        module, cls = where.rsplit(".", 1)
        try:
            owner = getattr(importlib.import_module("torch.distributed.fsdp._fully_shard." + module), cls)
        except (ImportError, AttributeError):
            continue  # a PyTorch without FSDP2
        for name in names:
            if name in owner.__dict__:
                patches[(owner, name)] = _outside_engine(owner.__dict__[name])
    patches.update(_same_shard_patch())
    return patches


def _same_shard_patch():
    """FSDPParam.reset_sharded_param (at lazy init) pads a shard again
    unless it is still the tensor FSDP2 padded, which it tells by the type
    torch.Tensor and the storage's address: a fake tensor has another type
    and no address, so each shard shorter than the padded size (the last
    ranks' of an uneven split) would be copied into a new one, which the GPU
    does not do. For a fake shard on the storage FSDP2 padded, what the
    method does on the GPU: keep it."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return {}
    cls = _fsdp_param.FSDPParam
    real = cls.__dict__.get("reset_sharded_param")
    if real is None:
        return {}

    @functools.wraps(real)
    def reset(self):
        info = self._module_info
        new_param = getattr(info.module, info.param_name)
        local = getattr(new_param, "_local_tensor", None)
        data = getattr(self, "_sharded_param_data", None)
        same = (isinstance(data, FakeTensor) and isinstance(local, FakeTensor) and data.untyped_storage().nbytes() > 0
                and data.untyped_storage()._cdata == local.untyped_storage()._cdata)  # fmt: skip
        if not same or (self.pin_memory and not local.is_pinned()):
            return real(self)
        self.sharded_param = new_param
        self._sharding_spec = self.sharded_param._spec

    return {(cls, "reset_sharded_param"): reset}


def _unrecorded(rec):
    """A context in which new allocations are not the job's: DTensor works
    out an operator's output shape by running it on fake tensors of the
    global shape, which the GPU never allocates."""

    @contextlib.contextmanager
    def off():
        ids = itertools.count(-1, -1)
        saved = rec.__dict__.get("alloc")
        rec.alloc = lambda size, stream=0: next(ids)  # (frees of these ids are of nothing live: ignored)
        try:
            yield
        finally:
            if saved is None:
                del rec.alloc
            else:
                rec.alloc = saved

    return off


def _dtensor_patches(rec):
    try:
        from torch.distributed.tensor import _sharding_prop
    except ImportError:
        return {}
    cls = _sharding_prop.ShardingPropagator
    name = "_propagate_tensor_meta_non_cached"
    if name not in cls.__dict__:
        return {}
    real = cls.__dict__[name]
    off = _unrecorded(rec)

    @functools.wraps(real)
    def propagate(self, *args, **kwargs):
        with off():
            return real(self, *args, **kwargs)

    patches = {(cls, name): propagate}
    # A random operator on a DTensor runs through a higher-order operator that
    # moves the CUDA generator's offset around the operator (rng_prims), which
    # the recorder's dispatch mode cannot take; the generator's state is on the
    # host, and the values are fake: the operator runs as it is.
    from torch.distributed.tensor import _dispatch

    if hasattr(_dispatch, "run_dtensor_rng_op"):
        patches[(_dispatch, "run_dtensor_rng_op")] = lambda start, end, op, *args, **kwargs: op(*args, **kwargs)
    return patches


def _shard_patches(shards):
    """FSDPParam.__init__, noting each parameter's size along the dimension
    it is sharded on and how many ranks share it: which ranks hold shards
    of other sizes follows (rank_classes)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        return {}
    cls = _fsdp_param.FSDPParam
    init = cls.__init__

    @functools.wraps(init)
    def noted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        n = getattr(self.mesh_info, "shard_mesh_size", 1)
        shards.append((int(self._orig_size[self.fsdp_placement.dim]), int(n)))

    return {(cls, "__init__"): noted}


def _collectives_seen(torch, rec, streams, used):
    """A dispatch mode noting the process group of every collective (c10d's
    operators, from Python or from C++ as DDP's reducer calls them): NCCL
    makes a communicator for a group at its first collective. Where the
    device profile says ProcessGroupNCCL calls record_stream on its
    collectives' tensors (nccl_record_stream), each one's allocation is used
    on the group's NCCL stream ('r' lines)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch.distributed as dist
    from torch.utils._pytree import tree_flatten

    record_streams = bool(rec.profile is not None and rec.profile.value("nccl_record_stream"))
    nccl_streams = {}  # group name -> its NCCL stream

    def used_on(group, args):
        s = nccl_streams.setdefault(group, _Stream(streams))
        for t in tree_flatten(args)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                i = rec.storages.get(t.untyped_storage()._cdata)
                if i is not None:
                    rec.use(i, s.stream_id)

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            if any(t is not FakeTensor and hasattr(t, "__tensor_flatten__") for t in types_):
                return NotImplemented  # (as the recorder's: a DTensor's operators come back unwrapped)
            if func.namespace in ("c10d", "_c10d_functional"):
                for a in list(args) + list((kwargs or {}).values()):
                    if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                        g = dist.ProcessGroup.unbox(a)
                        used[g.group_name] = g.size()
                        if record_streams:
                            used_on(g.group_name, (args, kwargs))
                    elif isinstance(a, str) and func.namespace == "_c10d_functional":
                        with contextlib.suppress(Exception):  # functional collectives name their group
                            g = dist.distributed_c10d._resolve_process_group(a)
                            used[g.group_name] = g.size()
            return func(*args, **(kwargs or {}))

    return Collectives()


# ---- the session -------------------------------------------------------------------------


@contextlib.contextmanager
def session(rec, env=None):
    """Inside a recorder.recording(): the job runs as one rank of a torchrun
    job on the fake process group (module docstring). rec.distributed says
    afterwards which rank of how many it was and the process groups it
    made."""
    torch = _torch()
    import torch.distributed as dist

    if not dist.is_available():
        raise recorder.RecorderError("this build of PyTorch has no torch.distributed")
    rank, world, local_world = rank_and_world(env)
    streams = _Streams()
    groups = []
    used = {}  # group name -> size, of the groups NCCL would make a communicator for
    patches = {}
    patches.update(_stream_patches(torch, streams))
    patches.update(_storage_patches(torch, rec))
    patches.update(_record_stream_patch(torch, rec))
    patches.update(_group_patches(torch, rec, rank, world, local_world, groups, used))
    patches.update(_fsdp_patches())
    patches.update(_dtensor_patches(rec))
    real_alloc = rec.alloc

    def alloc(size, stream=None, role=None):
        return real_alloc(size, streams.current.stream_id if stream is None else stream, role)

    rec.alloc = alloc
    shards = []  # (size along the shard dimension, ranks it is sharded over) per FSDP2 parameter
    patches.update(_shard_patches(shards))
    rec.distributed = {"rank": rank, "world_size": world}
    try:
        with recorder._patched(patches), _collectives_seen(torch, rec, streams, used):
            yield rec
    finally:
        rec.distributed["groups"] = [g.size() for g in groups]
        rec.distributed["communicators"] = sorted(used.values())
        rec.distributed["shards"] = sorted(set(shards))  # (which ranks differ needs each pair once)
        rec.distributed["streams"] = next(streams.ids) - 1
        if "alloc" in rec.__dict__:
            del rec.alloc
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# ---- what the fake group cannot show: NCCL's own memory --------------------------------

# The device profile's keys for the device memory one NCCL communicator takes
# outside the caching allocator on each of its ranks, by the group's size.
NCCL_KEYS = ((1, "nccl_communicator_bytes_1rank"), (2, "nccl_communicator_bytes_2ranks"),
             (3, "nccl_communicator_bytes_nranks"))  # fmt: skip
WORDS = {"measured": "measured", "derived": "derived", "estimate": "assumed"}


def nccl_key(size):
    """The profile key for a communicator of `size` ranks (the last one
    covers every larger group: inside one node NCCL's rings and trees keep
    two connections a rank whatever the number of ranks)."""
    return [k for n, k in NCCL_KEYS if size >= n][-1]


def nccl_bytes(profile, communicators):
    """NCCL's device memory on one rank for the communicators (their sizes)
    the job's collectives used: (total bytes counted, [(what, bytes or
    None, source)]) where source says whether the figure is measured,
    derived or assumed and names its profile key, or that the profile has
    none (not counted)."""
    total, lines = 0, []
    by_key = {}
    for size in communicators:
        by_key.setdefault(nccl_key(size), []).append(size)
    for key, sizes in sorted(by_key.items(), key=lambda kv: min(kv[1])):
        what = "NCCL, %d communicator%s of %s rank%s" % (
            len(sizes), "" if len(sizes) == 1 else "s", "/".join(str(n) for n in sorted(set(sizes))),
            "" if sizes == [1] else "s")  # fmt: skip
        value = profile.value(key) if profile is not None else None
        if value is None:
            lines.append((what, None, "not in the device profile (%s): not counted" % key))
            continue
        source = WORDS.get(profile.source(key), profile.source(key))
        total += int(value) * len(sizes)
        lines.append((what, int(value) * len(sizes), "%s (%s)" % (source, key)))
    return total, lines


def nccl_notes(profile, results):
    """What each NCCL figure the table used rests on: a line per profile key."""
    keys = sorted({nccl_key(n) for res in results for n in res["communicators"]})
    out = []
    for key in keys:
        entry = (profile.values.get(key) if profile is not None else None) or {}
        if entry.get("value") is None:
            out.append("%s is not in the device profile: NCCL's memory for those groups is not counted (measure "
                       "it with bench/torch/nccl_profile.py)" % key)  # fmt: skip
        else:
            out.append("%s, %s: %s" % (key, WORDS.get(entry.get("source"), entry.get("source")), entry.get("why", "")))
    return out


# ---- which ranks to record ------------------------------------------------------------------


def _rows(size, n, i):
    """The rows of a dimension of `size` that shard i of n holds (torch.chunk:
    chunks of ceil(size/n), the last ones short or empty)."""
    chunk = -(-size // n)
    return max(0, min(chunk, size - i * chunk))


def rank_classes(world, shards):
    """The ranks of a world that hold shards of the same sizes, as lists in
    rank order: [[0..world-1]] when every shard is alike (DDP, sizes that
    divide). shards: (size along the shard dimension, ranks sharing it)
    per parameter; a rank's shard is rank % ranks (FSDP2's 1-D mesh, and
    the shard dimension of a 2-D one)."""
    classes = {}
    for r in range(world):
        classes.setdefault(tuple(_rows(size, n, r % n) for size, n in shards), []).append(r)
    return sorted(classes.values())


def _events(path):
    """A recording's events (every line but comments, step markers kept)."""
    with open(path) as f:
        return [line for line in f if not line.startswith("#") or line.startswith("# step")]


def _ranges(ranks):
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else "%d-%d" % (start, r))
            start = None
    return ", ".join(out)


# ---- the command: python -m gpumem.predict --gpus ... ---------------------------------------------


def parse_gpus(text):
    """'1,2,4,8' -> [1, 2, 4, 8]."""
    try:
        out = sorted({int(x) for x in text.split(",")})
    except (AttributeError, ValueError):
        raise ValueError("bad --gpus %r (world sizes, comma-separated: 1,2,4,8)" % text) from None
    if not out or out[0] < 1 or out[-1] > 1024:
        raise ValueError("bad --gpus %r (each world size 1 to 1024)" % text)
    return out


class _Rank:
    """One recorded rank (its class of alike ranks) at one world size."""

    def __init__(self, rank, metas):
        self.rank, self.metas, self.alike = rank, metas, [rank]


def command(a, parser, cmd, memory, sizes):
    """python -m gpumem.predict --gpus N,... (a: the parsed options, cmd: the
    command's module, for its recording and scaling): records each world
    size's ranks on the fake group, scales each to the batch and the memory,
    and prints the table. Returns the exit status."""
    if a.gpus is None:
        parser.error("--global-batch needs --gpus (the world sizes to choose among)")
    try:
        worlds = parse_gpus(a.gpus)
    except ValueError as e:
        parser.error(str(e))
    if a.global_batch is not None and a.global_batch < 1:
        parser.error("--global-batch must be at least 1")
    if a.seq_lens is not None:
        parser.error("--gpus does not take --seq-lens: predict each world size over the batch at one length")
    notes, checks = [], []
    if a.cpu:
        checks.append("--cpu: --gpus always records on fake CUDA tensors")
    from .. import _safefs
    from . import confirm, profiles, runs

    runner = None
    try:
        try:
            profile, profile_line = profiles.choose(a.profile, *cmd._local_gpu())
        except ValueError as e:
            parser.error(str(e))
        if profile_line:
            checks.append(profile_line)
        keep = a.traces is not None
        try:
            root = _safefs.private_dir(a.traces) if keep else _safefs.fresh_private_dir("gpumem-predict-")
        except OSError as e:
            raise cmd.PredictError("--traces: %s" % e if keep else str(e)) from None
        # one recording process for every rank and world size: each child gets its rank's variables
        runner = runs.Runs(a.script, a.args, a.steps, profile.path, jobs=a.jobs or len(os.sched_getaffinity(0)),
                           timeout=a.timeout, log_dir=root, env=cmd._env(), one_gpu=False)  # fmt: skip
        confirm_on = True if a.confirm is None else a.confirm
        results = []
        try:
            for world in worlds:
                results.append(_predict_world(a, cmd, confirm, profile, memory, sizes, world, root, notes, checks,
                                              confirm_on, runner))  # fmt: skip
        except cmd.PredictError as e:
            keep = True
            raise cmd.PredictError("%s\nthe recordings are in %s" % (e, root)) from None
        finally:
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
        sys.stdout.write(table(a.script, sizes, memory, profile, results, notes, checks, a.batch, a.global_batch))
        if keep:
            sys.stdout.write("recordings: %s\n" % root)
        return 0
    except (cmd.PredictError, runs.RunError) as e:
        sys.stderr.write("gpumem.predict: %s\n" % e)
        return 1
    finally:
        if runner is not None:
            runner.close()


def _predict_world(a, cmd, confirm, profile, memory, sizes, world, root, notes, checks, confirm_on, runner):
    """Records and predicts one world size: a dict for the table."""

    def record(rank, batches, folders=None):
        sys.stderr.write("gpumem.predict: running %s as rank %d of %d at batch %s per GPU (fake process group)\n"
                         % (a.script, rank, world, ", ".join(str(b) for b in batches)))  # fmt: skip
        from .. import _safefs
        from . import runs

        try:
            parent = _safefs.private_dir(os.path.join(_safefs.private_dir(os.path.join(root, "gpus%d" % world)),
                                                      "rank%d" % rank))  # fmt: skip
            metas = runner.record([(b, None) for b in batches], "cpu", parent,
                                  folders=folders or ["b%d" % b for b in batches],
                                  env=child_env({}, rank, world))  # fmt: skip
        except (runs.RunError, OSError) as e:
            raise cmd.PredictError(str(e)) from None
        for meta in metas:
            if not meta.get("distributed"):
                raise cmd.PredictError("%s ran as rank %d of %d without the fake process group"
                                       % (a.script, rank, world))  # fmt: skip
            for n in meta["notes"]:
                if n not in notes:
                    notes.append(n)
        return metas

    first = _Rank(0, record(0, sizes))
    info = first.metas[0]["distributed"]
    classes = rank_classes(world, info.get("shards") or [])
    wanted = sorted({c[0] for c in classes} | {world - 1})
    recorded = [first] + [_Rank(r, record(r, sizes)) for r in wanted if r != 0]
    # ranks whose recordings are the same, event for event, at every batch, are one
    distinct = []
    for r in recorded:
        same = next((d for d in distinct if all(_events(x["path"]) == _events(y["path"])
                                                for x, y in zip(d.metas, r.metas))), None)  # fmt: skip
        if same is None:
            distinct.append(r)
        else:
            same.alike.append(r.rank)
    # a rank not recorded goes with the first rank of its shard class (recorded)
    by_rank = {r: d for d in distinct for r in d.alike}
    for c in classes:
        by_rank[c[0]].alike.extend(r for r in c if r not in by_rank)
    for d in distinct:
        d.alike.sort()
    context = max(m["context_bytes"] for m in first.metas)
    nccl, nccl_lines = nccl_bytes(profile, info.get("communicators") or [])
    budget = memory - context - nccl
    # a script that caps PyTorch itself (set_per_process_memory_fraction) caps what the caching allocator
    # reserves at that share of the whole device, as PyTorch counts it: the context and NCCL lie outside it
    fractions = [m["memory_fraction"] for m in first.metas if m.get("memory_fraction")]
    fraction = min(fractions) if fractions else None
    if fraction is not None:
        budget = min(budget, int(fraction * memory))
    if budget <= 0:
        raise cmd.PredictError("at %d GPUs the CUDA context and NCCL take %s, all of --memory (%s)"
                               % (world, cmd._gib(context + nccl), cmd._gib(memory)))  # fmt: skip
    batch = a.batch if a.batch is not None else (-(-a.global_batch // world) if a.global_batch else None)
    per_rank = []
    for d in distinct:
        rows, check, aligned, model = cmd.run_predict(sizes, [m["path"] for m in d.metas], budget, batch)
        if model.get("faster_than_batch") and len(sizes) == 2:
            # (one GPU records a third batch itself; here each world size's ranks would need it: said)
            checks.append("%d GPUs, rank %d: %d allocations grew faster than the batch from %d to %d (nearer its "
                          "square than a line), taken as lines, far too low at a large batch: give three batch "
                          "sizes (--batch-sizes %d,%d,%d)" % (world, d.rank, model["faster_than_batch"], sizes[0],
                                                              sizes[1], sizes[0], sizes[1], 2 * sizes[1]))
        if aligned:
            checks.append("%d GPUs, rank %d: %s" % (world, d.rank, aligned))
        if check:
            checks.append("%d GPUs, rank %d: %s" % (world, d.rank, check))
        if confirm_on:

            def record_at(b, d=d):
                return record(d.rank, [b], ["at_b%d" % b])[0]["path"]

            def record_many(bs, d=d):
                return {b: m["path"] for b, m in zip(bs, record(d.rank, bs, ["at_b%d" % b for b in bs]))}

            try:
                checker = confirm.Checker(record_at, budget, cmd._binary(), a.confirm_runs, record_many=record_many)
                line = cmd.check_at_batches(rows, checker, batch, "with the CPU recorder")
                checks.append("%d GPUs, rank %d: %s" % (world, d.rank, line))
            except (cmd.PredictError, RuntimeError) as e:
                checks.append("%d GPUs, rank %d: the check at the batches themselves failed, so the figures are "
                              "the scaled prediction: %s" % (world, d.rank, str(e).splitlines()[0]))  # fmt: skip
        per_rank.append((d, rows))
    return {"world": world, "ranks": distinct, "per_rank": per_rank, "context": context,
            "communicators": info.get("communicators") or [],
            "context_source": first.metas[0]["context_source"], "nccl": nccl, "nccl_lines": nccl_lines,
            "budget": budget, "batch": batch, "streams": info.get("streams", 0), "fraction": fraction}


def _worst(per_rank):
    """{allocator: (row, rank)}: each allocator's row from the rank with the
    smallest largest batch (then the largest peak)."""
    out = {}
    for d, rows in per_rank:
        for r in rows:
            name = r.get("allocator")
            mb = r.get("max_batch")
            key = (mb if mb is not None else float("inf"), -(r.get("peak_reserved_bytes") or 0))
            if name not in out or key < out[name][2]:
                out[name] = (r, d.rank, key)
    return {k: v[:2] for k, v in out.items()}


def _cell(r):
    mb = r.get("max_batch")
    if mb is None:
        return "-"
    if "max_batch_below" in r:
        below = r["max_batch_below"]
        return "%d+" % mb if below is None else "%d-%d" % (mb, below - 1)
    return str(mb)


def table(script, sizes, memory, profile, results, notes, checks, batch=None, global_batch=None):
    """The report of --gpus, as text."""
    gib = lambda n: "-" if n is None else "%.3f GiB" % (n / 2**30)  # noqa: E731
    worlds = [r["world"] for r in results]
    lines = [
        "%s on %s GPU%s: each rank recorded at batch %s per GPU on fake CUDA tensors, PyTorch's fake process group "
        "standing in for the other ranks (no GPU used)" % (
            script, ", ".join(str(w) for w in worlds), "" if worlds == [1] else "s",
            ", ".join(str(s) for s in sizes)),
        "device memory %s per GPU; outside the caching allocator on each rank: the CUDA context %s (%s)"
        % (gib(memory), gib(results[0]["context"]), results[0]["context_source"]),
    ]  # fmt: skip
    if checks:
        lines += [c for c in checks]
    for res in results:
        w = res["world"]
        lines.append("")
        alike = "; ".join(("rank %d" % d.rank if len(d.alike) == 1 else "ranks %s alike (rank %d recorded)"
                           % (_ranges(d.alike), d.rank)) for d in res["ranks"])  # fmt: skip
        lines.append("%d GPU%s: %s" % (w, "" if w == 1 else "s", alike))
        for what, n, source in res["nccl_lines"]:
            lines.append("  %s: %s, %s" % (what, gib(n) if n is not None else "-", source))
        if res.get("fraction") is not None:
            lines.append("  the script caps PyTorch at %s of the device (torch.cuda.set_per_process_memory_fraction): "
                         "the table answers for %s" % (("%.4f" % res["fraction"]).rstrip("0").rstrip("."),
                                                        gib(res["budget"])))  # fmt: skip
        else:
            lines.append("  left to the allocator: %s" % gib(res["budget"]))
        at = res["batch"]
        head = "peak reserved at batch %d" % at if at else "peak reserved"
        cols = "  %-20s %-18s %-27s %-18s" % ("allocator", "largest batch/GPU", head, "with context+NCCL")
        if global_batch:
            need = -(-global_batch // w)
            cols += " global batch %d (%d/GPU)" % (global_batch, need)
        cols = cols.rstrip()
        lines.append(cols)
        lines.append("  " + "-" * (len(cols) - 2))
        for name, (r, rank) in _worst(res["per_rank"]).items():
            peak = r.get("peak_reserved_bytes")
            who = "" if len(res["ranks"]) == 1 else " (rank %d)" % rank
            row = "  %-20s %-18s %-27s %-18s" % (name, _cell(r) + who, gib(peak),
                                                 gib(peak + res["context"] + res["nccl"]) if peak else "-")  # fmt: skip
            if global_batch:
                mb = r.get("max_batch")
                row += " " + ("fits" if mb is not None and mb >= -(-global_batch // w) else "does not fit")
            lines.append(row.rstrip())
    if global_batch:
        lines.append("")
        lines.append("fewest GPUs for a global batch of %d (ceil(%d / GPUs) per GPU):" % (global_batch, global_batch))
        names = []
        for res in results:
            for name in _worst(res["per_rank"]):
                if name not in names:
                    names.append(name)
        for name in names:
            fit = [res["world"] for res in results
                   if (_worst(res["per_rank"]).get(name, ({}, 0))[0].get("max_batch") or 0)
                   >= -(-global_batch // res["world"])]  # fmt: skip
            lines.append("  %-20s %s" % (name, "%d GPU%s" % (fit[0], "" if fit[0] == 1 else "s") if fit else
                                         "none of %s GPUs" % ", ".join(str(w) for w in worlds)))  # fmt: skip
    notes = nccl_notes(profile, results) + notes
    if notes:
        lines += ["", "What the recordings could not see, or assumed:"]
        lines += ["  - %s" % n for n in notes]
    return "\n".join(lines) + "\n"
