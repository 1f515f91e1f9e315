"""The process `python -m gpumem.predict` runs a training script in, once
per batch size:

    python -m gpumem.predict._child MODE OUT_DIR STEPS PROFILE SCRIPT [ARGS...]

MODE cpu: the script runs on fake CUDA tensors under the recorder
(recorder.py) and OUT_DIR/trace gets the trace. MODE probe: the same, on a
machine whose GPU is the device profile's, with each convolution also run
for real on the GPU for its workspaces (probe.py). MODE gpu: the script runs
on the GPU with PyTorch's own allocation history on, and OUT_DIR/trace gets
its events as a trace with the same step markers. Either way the script is stopped (SystemExit from
the optimizer step hook) once STEPS training steps are done (STEPS steps of
each optimizer that steps), and
OUT_DIR/meta.json says how many steps ran, whether the script ended by
itself (an inference script takes no optimizer step), what could not be seen
(notes) and the memory the CUDA context takes outside the allocator."""

import contextlib
import importlib.util
import json
import os
import re
import runpy
import sys


MAX_ENTRIES = 20_000_000  # PyTorch's history ring: events of a few steps of a large job


class _Enough(SystemExit):
    """Raised from the optimizer step hook once the steps asked for ran."""


def _run_script(script, args):
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except _Enough:
        return True
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return False


def run_cpu(out_dir, steps, profile, script, args, probes=False):
    from .recorder import NoBatch

    try:
        return _record_cpu(out_dir, steps, profile, script, args, probes)
    except NoBatch as e:
        # (no recording: the batch is past what the script runs, which the parent takes as its cap)
        return {"no_batch": str(e), "dataset_items": e.items, "steps": 0, "ended": True, "notes": []}


def _record_cpu(out_dir, steps, profile, script, args, probes):
    from .recorder import recording

    probe = _conv_probe(profile) if probes else None

    def stop(rec):
        backwards.take()
        if rec.steps >= steps * len(rec.optimizers):
            # The recording ends with the step: what dies while the script
            # unwinds dies when Python's collector runs, which varies from
            # run to run, and the recordings at each batch must align.
            rec.closed = True
            raise _Enough(0)

    name = os.path.splitext(os.path.basename(script))[0]
    # transformers loads a checkpoint's tensors in worker threads, where the recorder's modes (one
    # thread's) do not reach: they came out real, and moving them to the device failed
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
    with _backwards_counted() as backwards, \
            recording(None, profile, workload=name, step_hook=stop, probe=probe) as rec:
        with _one_rank(rec), _users_files_kept(rec.note), _gpumem_enabled_by_script(rec.note), \
                _hub_kernels_off(script, rec.note), _inference_steps(script, rec.hand_step, rec.note, backwards):
            stopped = _run_script(script, args)
    rec.write(os.path.join(out_dir, "trace"))
    context = rec.profile.value("cuda_context_bytes", 0) if rec.profile else 0
    source = rec.profile.source("cuda_context_bytes") if rec.profile else None
    if source:  # (from the profile: where it was measured, not here)
        source = "%s on the %s, device profile %s" % (source, rec.profile.gpu, rec.profile.name)
    return {"steps": rec.steps, "ended": not stopped, "notes": rec.notes, "peak_live_bytes": rec.peak_live_bytes,
            "context_bytes": context, "context_source": source or "none", "file": "trace",
            "distributed": getattr(rec, "distributed", None), "memory_fraction": rec.memory_fraction,
            "dataset_items": rec.dataset_items, "backwards_per_step": backwards.per_step}


def _one_rank(rec):
    """As one rank of a torchrun job on PyTorch's fake process group where
    the command asks for it (distributed.py), else nothing."""
    from . import distributed

    return distributed.session(rec) if distributed.wanted() else contextlib.nullcontext()


def _argument(index, name):
    """A save's destination: its argument at index (counting self) or by name."""
    return lambda args, kwargs: kwargs.get(name, args[index] if len(args) > index else None)


def _is_a_file(f):
    """Whether a destination is a file: a path, or an open file with a
    descriptor (not a buffer in memory)."""
    if isinstance(f, (str, bytes, os.PathLike)):
        return True
    try:
        f.fileno()
    except Exception:  # noqa: BLE001 (io.BytesIO raises UnsupportedOperation; others may differ)
        return False
    return True


def _described(f):
    return os.fsdecode(f) if isinstance(f, (str, bytes, os.PathLike)) else getattr(f, "name", None) or "a file object"


def _save_targets():
    """(object, attribute, where) of each save the script may reach that
    writes to the user's files: torch.save and safetensors' save_file
    (to a path or an open file), and the checkpoints of the libraries
    whose trainers save and then delete older ones (the HF Trainer,
    Accelerate, Lightning) where the script's imports loaded them:
    importing them here would take seconds."""
    import torch

    targets = [(torch, "save", _argument(1, "f"))]
    try:
        import safetensors.torch as safetensors_torch
    except ImportError:  # (no safetensors: nothing of it to mind)
        pass
    else:
        targets.append((safetensors_torch, "save_file", _argument(1, "filename")))
    loaded = [
        ("transformers.modeling_utils", "PreTrainedModel", "save_pretrained", _argument(1, "save_directory")),
        ("transformers.trainer", "Trainer", "_save_checkpoint", lambda a, k: a[0].args.output_dir),
        ("transformers.trainer", "Trainer", "save_model", _argument(1, "output_dir")),
        ("accelerate.accelerator", "Accelerator", "save_state", _argument(1, "output_dir")),
        ("accelerate.accelerator", "Accelerator", "save_model", _argument(2, "save_directory")),
        ("lightning.fabric.plugins.io.torch_io", "TorchCheckpointIO", "save_checkpoint", _argument(2, "path")),
        ("lightning.fabric.plugins.io.torch_io", "TorchCheckpointIO", "remove_checkpoint", _argument(1, "path")),
        ("lightning_fabric.plugins.io.torch_io", "TorchCheckpointIO", "save_checkpoint", _argument(2, "path")),
        ("lightning_fabric.plugins.io.torch_io", "TorchCheckpointIO", "remove_checkpoint", _argument(1, "path")),
    ]  # fmt: skip
    for module, cls, name, where in loaded:
        owner = getattr(sys.modules.get(module), cls, None)
        if owner is not None and name in owner.__dict__:
            targets.append((owner, name, where))
    return targets


@contextlib.contextmanager
def _users_files_kept(note):
    """The script's checkpoints are not written while it is recorded: the
    command runs it several times, and each run would overwrite the
    checkpoints the user's own training left where the script saves them,
    and a trainer that keeps the last N would delete the user's older
    ones (the HF Trainer's rotation removed a checkpoint-500 that was
    there before). On fake tensors, which have no data, torch.save also
    wrote a broken file and stopped the run. A save copies to the host and
    takes no device memory. torch.save into memory (an io.BytesIO) runs as
    it is. note(text) gets one line: how many saves and removals, where
    the first would have gone."""
    saves = []

    import torch

    def not_written(original, where):
        def save(*args, **kwargs):
            to = where(args, kwargs)
            if original is torch_save and not _is_a_file(to):
                return original(*args, **kwargs)
            saves.append(_described(to))

        return save

    torch_save = torch.__dict__["save"]
    targets = _save_targets()
    patched = [(obj, name, obj.__dict__[name]) for obj, name, _ in targets]
    for (obj, name, where), (_, _, original) in zip(targets, patched):
        setattr(obj, name, not_written(original, where))
    try:
        yield
    finally:
        for obj, name, original in patched:
            setattr(obj, name, original)
        if saves:
            note("the script's checkpoints were neither written nor removed while it was recorded (%d call%s, the "
                 "first for %s), so that its files stay as they were; a save takes no device memory"
                 % (len(saves), "" if len(saves) == 1 else "s", saves[0]))  # fmt: skip


@contextlib.contextmanager
def _gpumem_enabled_by_script(note):
    """A script that installs gpumem itself (gpumem.torch.enable, as the
    README says to) is recorded as any other: the recording is of the
    requests, which the allocators' rows then replay. Its enable() is a
    no-op while it runs (on fake tensors torch has no CUDA allocator to
    replace, and a GPU recording is PyTorch's own allocation history),
    noted once with the settings it asked for."""
    try:
        import gpumem.torch as gt
    except ImportError:  # (gpumem's torch module needs torch, which the recorder has)
        yield
        return
    original, asked = gt.enable, []

    def enable(conf=None, shim=True):
        asked.append(conf)
        return {"enabled": False, "recorded by": "gpumem.predict"}

    gt.enable = enable
    try:
        yield
    finally:
        gt.enable = original
        if asked:
            conf = next((c for c in asked if c), None)
            note("the script installs gpumem itself (gpumem.torch.enable(%s)): recorded as it asks PyTorch for "
                 "memory, which each allocator's row replays; %s" % (
                     "" if conf is None else repr(conf),
                     "its settings are not applied to the gpumem rows, which stand for the default"
                     if conf else "the gpumem rows are what it gets"))  # fmt: skip


_LOADS_A_MODEL = re.compile(r"from_pretrained|pipeline\(")


def _source(script):
    """The script's text ("" where it cannot be read)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@contextlib.contextmanager
def _hub_kernels_off(script, note):
    """transformers (5.25 on, which installs the `kernels` package with it)
    swaps some layers of a model that from_pretrained loads onto a GPU for
    CUDA kernels fetched from the Hugging Face Hub. Fake tensors cannot run
    them, and fetching them needs the network: under the recorder
    from_pretrained stopped with "could not verify publisher trust status".
    While recording, USE_HUB_KERNELS=NO keeps PyTorch's own path for those
    layers, noted where the package is there and the script loads a model
    (from_pretrained or pipeline in its text: where it builds one from a
    config, no kernels are swapped in and the note would be noise)."""
    before = os.environ.get("USE_HUB_KERNELS")
    os.environ["USE_HUB_KERNELS"] = "NO"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("USE_HUB_KERNELS", None)
        else:
            os.environ["USE_HUB_KERNELS"] = before
        if "transformers" in sys.modules and importlib.util.find_spec("kernels") is not None and \
                _LOADS_A_MODEL.search(_source(script)):
            note("transformers' layer kernels from the Hugging Face Hub (the kernels package) were off while "
                 "recording (USE_HUB_KERNELS=NO): fake tensors cannot run them, so the recording holds "
                 "PyTorch's own path for those layers, not the kernels' (their own memory, if any, is not in it)")


# Words a training script has somewhere: its backward, its optimizer, a trainer
# that holds both (transformers', Lightning's .fit)
_TRAINING_WORDS = re.compile(r"backward|optim|Trainer|\.fit\(")


def _inference_script(script):
    """Whether the script reads as inference: none of the words of a
    training loop in its text. Where it trains after evaluating, its
    evaluation draws batches with no backward just as an inference loop
    does, and only its text tells them apart."""
    text = _source(script)
    return bool(text) and not _TRAINING_WORDS.search(text)


@contextlib.contextmanager
def _inference_steps(script, mark_step, note, backwards):
    """An inference script's loop over a DataLoader ends a step at each
    batch it draws after the first, with no backward run since the
    recording began (backwards: the _BackwardCount of the run): mark_step()
    then, as at an optimizer step, so that the run stops after --steps
    batches. Recorded whole, an evaluation of 5,000 samples at batch 1 took
    470 s on fake tensors, and its recordings at two batches did not align
    (as many iterations as batches). Only where the script's text has no
    training words (_inference_script); note(text) says it was so
    recorded."""
    if not _inference_script(script):
        yield
        return
    from torch.utils.data import dataloader

    drawn = [0]
    original_next = dataloader._BaseDataLoaderIter.__next__

    def next_batch(self):
        if not backwards.total:
            drawn[0] += 1
            if drawn[0] == 2:
                note("the script reads as inference (no backward, optimizer or trainer in it): a step is a batch "
                     "of its DataLoader, and the run stopped after --steps of them, as a training run stops after "
                     "its optimizer steps")
            if drawn[0] >= 2:
                mark_step()
        return original_next(self)

    dataloader._BaseDataLoaderIter.__next__ = next_batch
    try:
        yield
    finally:
        dataloader._BaseDataLoaderIter.__next__ = original_next


class _BackwardCount:
    """The backward passes the script runs (a reentrant checkpoint's inner
    ones not counted): total, and per step the count since the last
    take(). A script that accumulates gradients to a fixed global batch
    runs more of them a step at a smaller batch (64 at batch 1, 32 at 2),
    and its recordings then cannot align: the command says so, naming the
    counts."""

    def __init__(self):
        self.total = 0
        self.per_step = []
        self.depth = 0  # (backward passes running: an inner one is a checkpoint's)
        self._taken = 0

    def take(self):
        self.per_step.append(self.total - self._taken)
        self._taken = self.total


@contextlib.contextmanager
def _backwards_counted():
    """A _BackwardCount of the backward passes run within."""
    import torch

    count = _BackwardCount()
    original = torch.autograd._engine_run_backward

    def run_backward(*args, **kwargs):
        if count.depth == 0:
            count.total += 1
        count.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            count.depth -= 1

    torch.autograd._engine_run_backward = run_backward
    try:
        yield count
    finally:
        torch.autograd._engine_run_backward = original


def _conv_probe(profile_name):
    """A probe.ConvProbe on this machine's GPU, which must be the one the
    device profile describes: its workspaces go beside the profile's
    figures in one trace."""
    import torch

    from . import probe, profiles

    profile = profiles.load(profile_name)
    try:
        conv = probe.ConvProbe(torch)
    except probe.ProbeError as e:
        raise SystemExit("gpumem.predict: convolutions cannot be run on the GPU: %s" % e)
    if conv.device_name != profile.gpu:
        raise SystemExit("gpumem.predict: this machine's GPU is %s, the device profile %s describes %s: "
                         "the convolutions' workspaces would be another GPU's" % (conv.device_name, profile.name,
                                                                                  profile.gpu))  # fmt: skip
    return conv


def frames_role(frames):
    """What made an allocation, from its frames (innermost first): the
    innermost frame outside PyTorch's own files as name@file:line, and a
    hash of all of them, after "optim/" where a frame is in torch/optim (an
    optimizer's step; tools/snapshot.c makes the same from a pickle)."""
    if not frames:
        return None
    import zlib

    # (PyTorch's own files as installed: a script of the user's may lie in a directory named torch)
    shown = next((f for f in frames if "-packages/torch/" not in f.get("filename", "")), frames[0])
    inner = frames[:64]  # (as tools/snapshot.c's ROLE_FRAMES)
    key = "|".join("%s:%s:%s" % (f.get("filename"), f.get("line"), f.get("name")) for f in inner)
    optimizer = any("/torch/optim/" in (f.get("filename") or "") for f in inner)
    return "%s%s@%s:%s~%08x" % ("optim/" if optimizer else "", shown.get("name") or "?",
                                 os.path.basename(shown.get("filename") or "?"), shown.get("line", 0),
                                 zlib.crc32(key.encode("utf-8", "replace")))


def history_to_recording(entries, step_ends, workload, source):
    """PyTorch's allocation history (a snapshot's device_traces[0]) as a
    Recording: each alloc an allocation, each free_requested its free (the
    program's free; the allocator's own stream-ordered completion is what
    a replay models), a step marker after the entry at each index of
    step_ends. Frees of blocks allocated before the history began are
    left out."""
    from .recorder import Recording

    rec = Recording(workload=workload, source=source)
    ids = {}
    marks = sorted(step_ends)
    for k, e in enumerate(entries):
        while marks and k >= marks[0]:
            marks.pop(0)
            rec.step()
        if e.get("action") == "alloc":
            ids[e["addr"]] = rec.alloc(e["size"], e.get("stream", 0), frames_role(e.get("frames")))
        elif e.get("action") == "free_requested" and e["addr"] in ids:
            rec.free(ids.pop(e["addr"]))
    for _ in marks:
        rec.step()
    return rec


@contextlib.contextmanager
def _every_step_taken(skipped):
    """A GradScaler takes no optimizer step where the scaled gradients
    overflow, at steps that depend on the data (its scale starts high and
    comes down by overflowing): one batch's run would then skip a step that
    another's takes, a whole step's allocations apart, and no alignment
    bridges that. On the GPU the runs take every step, as on fake tensors
    (which never overflow): the memory of the job as it runs once the scale
    has settled. skipped[0] counts the steps a scaler would have skipped."""
    try:
        from torch.amp import grad_scaler
    except ImportError:  # (a torch without torch.amp: no scaler to mind)
        yield
        return
    original = grad_scaler.GradScaler._maybe_opt_step

    def take_step(self, optimizer, optimizer_state, *args, **kwargs):
        if sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            skipped[0] += 1
        return optimizer.step(*args, **kwargs)

    grad_scaler.GradScaler._maybe_opt_step = take_step
    try:
        yield
    finally:
        grad_scaler.GradScaler._maybe_opt_step = original


@contextlib.contextmanager
def _hand_steps(mark_step, stepped):
    """Calls mark_step() where a loop with no optimizer updated its
    parameters by hand after a backward (`p -= lr * p.grad` under no_grad),
    at the first module called with grad on after it: the next step's
    forward, where the recorder on fake tensors marks it too. The
    parameters are the leaves of the backward's graph (its AccumulateGrad
    nodes); an update is a change of their version counters. stepped[0] is
    set by an optimizer's step: that step is marked already. Costs a walk of
    each backward's graph and a look at each module call's grad mode."""
    import torch
    from torch.nn.modules import module as module_module

    state = {"depth": 0, "leaves": {}, "params": [], "versions": [], "armed": False}
    original = torch.autograd._engine_run_backward

    def run_backward(t_outputs, *args, **kwargs):
        todo = [t.grad_fn for t in t_outputs if getattr(t, "grad_fn", None) is not None]
        seen = set()
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            v = getattr(fn, "variable", None)  # (an AccumulateGrad node's leaf)
            if isinstance(v, torch.Tensor):
                state["leaves"][id(v)] = v
            todo.extend(f for f, _ in fn.next_functions)
        state["depth"] += 1
        try:
            return original(t_outputs, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if state["depth"] == 0:  # (a reentrant checkpoint's backward runs inside another)
                state["params"] = list(state["leaves"].values())
                state["versions"] = [p._version for p in state["params"]]
                state["leaves"] = {}
                state["armed"] = True
                stepped[0] = False

    def next_forward(module, inputs):
        if not state["armed"] or not torch.is_grad_enabled():
            return
        state["armed"] = False
        if not stepped[0] and any(p._version != v for p, v in zip(state["params"], state["versions"])):
            mark_step()

    torch.autograd._engine_run_backward = run_backward
    handle = module_module.register_module_forward_pre_hook(next_forward)
    try:
        yield
    finally:
        handle.remove()
        torch.autograd._engine_run_backward = original


def run_gpu(out_dir, steps, script, args):
    import torch

    from . import gpu_context

    others = gpu_context.others()  # before this process's CUDA context exists
    # (Python frames at each allocation: what made it, to align the runs at two batches by)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    done = {"steps": 0, "context_bytes": 0, "context_source": "measured", "step_ends": []}

    def entries():
        return torch.cuda.memory._snapshot()["device_traces"][0]

    def dump():
        done["context_bytes"], done["context_source"] = gpu_context.measure(others)
        done["entries"] = entries()
        torch.cuda.memory._record_memory_history(enabled=None)

    stepped = [False]

    optimizers = set()  # (as the recorder's: a step of each per iteration)

    def on_step(optimizer=None, a=None, k=None):
        backwards.take()
        stepped[0] = True
        optimizers.add(id(optimizer) if optimizer is not None else "by hand")
        done["steps"] += 1
        done["step_ends"].append(len(entries()))
        if done["steps"] >= steps * len(optimizers):
            dump()
            raise _Enough(0)

    from torch.optim import optimizer as optim_module

    optim_module.register_optimizer_step_post_hook(on_step)
    skipped = [0]
    notes = []
    with _backwards_counted() as backwards, _every_step_taken(skipped), _hand_steps(on_step, stepped), \
            _users_files_kept(notes.append), _gpumem_enabled_by_script(notes.append), \
            _inference_steps(script, on_step, lambda text: text in notes or notes.append(text), backwards):
        ended = not _run_script(script, args)
    if ended:
        dump()
    if len(done["entries"]) >= MAX_ENTRIES:
        raise SystemExit("the allocation history filled its %d entries: the recording would miss the start" % MAX_ENTRIES)
    name = os.path.splitext(os.path.basename(script))[0]
    source = "torch %s on %s, native caching allocator, allocation history" % (
        torch.__version__, torch.cuda.get_device_name())
    rec = history_to_recording(done["entries"], done["step_ends"], name, source)
    rec.write(os.path.join(out_dir, "trace"))
    if skipped[0]:
        notes.append("a GradScaler would have skipped %d of the %d optimizer steps (its gradients overflowed); "
                     "they were taken, so that the runs at each batch have the same steps" % (skipped[0], done["steps"]))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)()
    return {"steps": done["steps"], "ended": ended, "notes": notes, "context_bytes": done["context_bytes"],
            "peak_live_bytes": rec.peak_live_bytes, "context_source": done["context_source"], "file": "trace",
            "backwards_per_step": backwards.per_step,
            "device": torch.cuda.get_device_name(), "memory_fraction": fraction if fraction < 1 else None}


def main(argv):
    mode, out_dir, steps, profile, script = argv[:5]
    args = argv[5:]
    if mode in ("cpu", "probe"):
        meta = run_cpu(out_dir, int(steps), profile, script, args, probes=mode == "probe")
    elif mode == "gpu":
        meta = run_gpu(out_dir, int(steps), script, args)
    else:
        raise SystemExit("gpumem.predict._child: unknown mode %r (cpu, probe or gpu)" % mode)
    from .. import _safefs

    _safefs.write_file(os.path.join(out_dir, "meta.json"), json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
