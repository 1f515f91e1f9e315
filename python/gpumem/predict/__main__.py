"""python -m gpumem.predict: how large a batch fits, from runs at small ones.

    python -m gpumem.predict --memory 80G --batch-sizes 1,2 [--batch 64]
        [--steps 3] [--cpu] [--profile h200] [--traces DIR]
        train.py --batch-size {B} [script args]
    python -m gpumem.predict ... --seq-lens 128,256,512 --seq-len 2048
        train.py --batch-size {B} --max-length {L} [script args]
    python -m gpumem.predict --gpus 1,2,4,8 --memory 80G [--global-batch N] ...
        train.py --batch-size {B}          (a script for torchrun: distributed.py)

Runs the training script briefly at each small batch size ({B} in its
arguments becomes the batch size), each in a process of its own, until
--steps training steps are done (a step of each optimizer the script steps:
a GAN's two make one): on the GPU with PyTorch's allocation
history on when there is one (and --cpu is not given), else on fake CUDA
tensors under the CPU recorder (gpumem.predict.recorder). Then `gpumem
predict` scales the recordings to larger batches and replays them under
each allocator; the table gives, for PyTorch's allocator, expandable
segments, cudaMallocAsync and gpumem, the largest batch that fits in
--memory and the peak reserved memory at --batch, and below it what the
recordings could not see.

With --seq-lens the script also runs at each of those sequence lengths ({L}
in its arguments), at every small batch size; each batch's recordings are
predicted at --seq-len first (`gpumem predict --write-trace`), then those
traces over the batch: the table is for the job at --seq-len
(docs/predict.md, "Two dimensions").

Then the answers are checked at the batches themselves: fake tensors
cost the same at any batch, so the job is recorded on them at --batch and
at batches around each predicted largest one, and those recordings are
replayed (`gpumem fit`). They see what small batches do not show (the
staging buffers of reductions split across thread blocks at large
batches); on a GPU machine each convolution also runs for real on the
GPU, for the workspaces cuDNN picks by problem size
(gpumem.predict.probe), which needs the GPU to be the device profile's:
elsewhere the check is off unless --confirm asks for it. The table gives
the check's figures, and what scaling said beside them. The search for
the largest batch stops within 2% (exact below 50) or after
--confirm-runs recordings, and says which. Where a run at a
large batch fails, the table is the scaled prediction and a line says
what failed (the recordings are kept).

Exit status: 0 done, 1 a run or `gpumem predict` failed, 2 bad usage."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from .. import _cli, _safefs
from . import confirm

GIB = 1 << 30
_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


class PredictError(Exception):
    """What went wrong, in words; the command prints it and exits 1."""


def parse_size(text):
    """'80G', '1.5GiB', '512M', '4096B' -> bytes (K, M, G, T: powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B?)\s*", text or "", re.I)
    if not m or (not m.group(2) and not m.group(3)):
        raise ValueError("bad size %r (a number with a unit: 80G, 1.5GiB, 512M; bytes as 4096B)" % text)
    value = int(float(m.group(1)) * (1 << (10 * _UNITS[m.group(2).upper()])))
    if value <= 0:
        raise ValueError("bad size %r: must be above 0" % text)
    return value


def parse_sizes(text, option="--batch-sizes", what="batch sizes", example="1,2"):
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError("bad %s %r (two or more %s: %s)" % (option, text, what, example)) from None
    if len(sizes) < 2 or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError("bad %s %r (two or more different %s, each at least 1)" % (option, text, what))
    return sorted(sizes)


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m gpumem.predict",
        description="How large a batch fits in --memory under each allocator, from short runs of a "
        "training script at small batch sizes ({B} in its arguments).",
    )
    p.add_argument("--memory", required=True, help="the device memory to fit in (80G, 141GiB)")
    p.add_argument("--batch-sizes", default="1,2", help="the small batch sizes to run at (default 1,2)")
    p.add_argument("--batch", type=int, help="the batch size to report the peak at")
    p.add_argument("--seq-lens", help="also run at these sequence lengths ({L} in the script's arguments); "
                   "three or more where sizes grow with the square of the length")
    p.add_argument("--seq-len", type=int, help="with --seq-lens: the sequence length to predict at")
    p.add_argument("--steps", type=int, default=3,
                   help="training steps per run (default 3): a step of each optimizer the script has")
    p.add_argument("--cpu", action="store_true", help="record on fake CUDA tensors even with a GPU")
    p.add_argument("--profile", default="auto",
                   help="device profile of the GPU to predict for (a name or a JSON file from python -m "
                   "gpumem.predict.measure; default: this machine's GPU's, else h200, and the table says which)")
    p.add_argument("--jobs", type=int, default=None,
                   help="recordings run at once on fake tensors (default: the processors this process may use)")
    p.add_argument("--traces", help="keep the recordings in this directory")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take (default 1800)")
    p.add_argument("--confirm", dest="confirm", action="store_true", default=None,
                   help="check the answers on fake tensors at the batches themselves (the default on the CPU "
                   "recorder, and on a GPU that is the device profile's)")
    p.add_argument("--no-confirm", dest="confirm", action="store_false",
                   help="report the scaled prediction as it is")
    p.add_argument("--confirm-runs", type=int, default=20,
                   help="recordings the check may make (default 20)")
    p.add_argument("--gpus", help="a script for torchrun (DDP, FSDP2): record one rank of each of these world sizes "
                   "on PyTorch's fake process group and predict per GPU (1,2,4,8); {B} is the batch per GPU")
    p.add_argument("--global-batch", type=int, help="with --gpus: the fewest GPUs that fit this many samples a step")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments; {B} becomes the batch size")
    return p


def _env():
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _torch():
    """torch, or a PredictError that says how to get it (with --cpu too:
    the recorder runs the job on PyTorch's fake tensors)."""
    try:
        import torch
    except ImportError:
        raise PredictError("gpumem.predict needs PyTorch (pip install torch)") from None
    return torch


def _no_driver():
    """True where this machine has no NVIDIA driver (its NVML library,
    which every driver installs, is missing): torch can see no GPU there,
    and this process need not import torch to say so. The recording
    server imports it anyway; a second import here was two seconds of
    every prediction on a machine with no GPU."""
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return True
    return False


def _torch_version_unimported():
    """torch's version from its installed metadata, or None (not installed
    as a distribution: then torch itself is asked)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise PredictError("gpumem.predict needs PyTorch (pip install torch)")
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_available():
    if _no_driver() and _torch_version_unimported() is not None:
        return False
    return _torch().cuda.is_available()


def _local_gpu():
    """(this machine's GPU's name or None, torch's version). (This process
    makes no recording: the runs are forked from another, which never
    touches CUDA.)"""
    if _no_driver():
        version = _torch_version_unimported()
        if version is not None:
            return None, version
    torch = _torch()
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return name, torch.__version__


def _at(batch_size, seq_len=None):
    """'batch 4', or 'batch 4 length 128': a run's point, in words."""
    return "batch %d" % batch_size + ("" if seq_len is None else " length %d" % seq_len)


class RunPool:
    """The recording processes of one command (gpumem.predict.runs), made
    when first needed: one for runs on fake tensors, as many at once as
    --jobs; one for GPU runs, one at a time (each measures its own CUDA
    context by what is new on the GPU)."""

    def __init__(self, a, profile_path, root):
        self.a, self.profile_path, self.root = a, profile_path, root
        self.jobs = a.jobs or len(os.sched_getaffinity(0))
        self.runners = {}

    def get(self, how):
        from . import runs

        key = "gpu" if how == "gpu" else "fake"
        if key not in self.runners:
            self.runners[key] = runs.Runs(self.a.script, self.a.args, self.a.steps, self.profile_path,
                                          jobs=1 if key == "gpu" else self.jobs, timeout=self.a.timeout,
                                          log_dir=self.root, env=_env())  # fmt: skip
        return self.runners[key]

    def timing(self):
        """Where the time went, in words, or None before any run."""
        parts = []
        for key, r in sorted(self.runners.items()):
            if r.count:
                parts.append("%d recordings %s, %.1f s each on %d worker%s (imports %.1f s, once)" % (
                    r.count, "on the GPU" if key == "gpu" else "on fake tensors", r.busy_s / r.count,
                    r.jobs, "" if r.jobs == 1 else "s", r.import_s or 0))  # fmt: skip
        return "; ".join(parts) or None

    def close(self):
        for r in self.runners.values():
            r.close()


def record_points(pool, points, how, root, prefix):
    """Runs the script at each (batch, seq_len) of points in mode how (cpu,
    probe or gpu) into root/<prefix>...; their metas, each with 'path': its
    trace. runs.RunError when one fails."""
    return pool.get(how).record(points, how, root, prefix)


def record(script, args, batch_size, out_dir, mode, steps, profile, timeout=1800, seq_len=None, env=None):
    """One run of script at batch_size (and seq_len, for {L}) into the
    folder out_dir, in a recording process of its own (env: its
    environment, default the command's); its meta (with 'path': the
    recording), or PredictError."""
    from . import runs

    out_dir = os.path.abspath(out_dir)
    try:
        parent = _safefs.private_dir(os.path.dirname(out_dir))
        r = runs.Runs(script, args, steps, profile, jobs=1, timeout=timeout, log_dir=parent, env=env or _env())
        try:
            return r.record([(batch_size, seq_len)], mode, parent, folders=[os.path.basename(out_dir)])[0]
        finally:
            r.close()
    except (runs.RunError, OSError) as e:
        raise PredictError(str(e)) from None


def _binary(binary=None):
    binary = binary or _cli.find()
    if binary is None:
        raise PredictError(
            "the gpumem command line program is missing (tried %s): run `make build` in the checkout "
            "or reinstall the package" % ", ".join(_cli.candidates())
        )
    return binary


def run_predict(sizes, paths, memory, batch=None, binary=None):
    """`gpumem predict --sizes ... --memory NB --json`: its rows, parsed,
    what its check of the largest recording said (check_line), what the
    alignment found (aligned_line) and its `model` (the kinds of sizes)."""
    binary = _binary(binary)
    cmd = [binary, "predict", "--batch-sizes", ",".join(str(s) for s in sizes)] + list(paths)
    cmd += ["--memory", "%dB" % memory, "--json"]
    if batch is not None:
        cmd += ["--batch", str(batch)]
    return _predict_output(binary, cmd)


def write_at(batch, lengths, paths, seq_len, out, binary=None):
    """`gpumem predict --sizes L1,L2,... --batch seq_len --write-trace out`:
    the recordings at batch over the lengths, written at seq_len. Returns
    what its check of the longest recording said (check_line), or None."""
    binary = _binary(binary)
    cmd = [binary, "predict", "--batch-sizes", ",".join(str(s) for s in lengths)] + list(paths)
    cmd += ["--batch", str(seq_len), "--write-trace", out, "--json"]
    return _predict_output(binary, cmd, "check at batch %d: length" % batch, "shorter")[1]


def _predict_output(binary, cmd, check_prefix="check: batch", smaller="smaller"):
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = done.stderr.decode("utf-8", "replace").strip()
    if done.returncode != 0:
        if "unknown command" in err:
            raise PredictError("%s has no `predict` command (an older build: run `make build`)" % binary)
        raise PredictError("`gpumem predict` failed (exit status %d): %s" % (done.returncode, err))
    text = done.stdout.decode("utf-8", "replace")
    model = (json.loads(text).get("model") if text.strip() else None) or {}
    return parse_rows(text), check_line(text, check_prefix, smaller), aligned_line(text), model


def aligned_line(text):
    """What aligning the recordings found beyond matching requests, in one
    line (docs/predict.md, "Alignment"), or None."""
    al = json.loads(text).get("aligned") if text.strip() else None
    if not al or not (al.get("inserted") or al.get("dropped")):
        return None
    parts = []
    if al.get("inserted"):
        sized = al.get("inserted_sized_by_others") or 0
        optimizer = al.get("inserted_optimizer") or 0
        rest = al["inserted"] - sized - optimizer
        how = []
        if sized:
            how.append("%d sized through the smaller batches that make them too" % sized)
        if optimizer:
            how.append("%d of an optimizer's step a smaller batch skipped, at their size" % optimizer)
        if rest:
            how.append("%s taken in proportion to the batch, an upper bound where they grow at most linearly"
                       % ("the rest" if sized or optimizer else "each"))
        parts.append("%d allocations only larger batches make (%s at the largest): %s"
                     % (al["inserted"], _gib(al.get("inserted_bytes_at_largest")), "; ".join(how)))
    if al.get("dropped"):
        parts.append("%d made only at a smaller batch (%s) left out" % (al["dropped"], _gib(al.get("dropped_bytes"))))
    roles = ["%s (%d, %s)" % (r["role"] or "no role", r["count"], _gib(r["bytes"])) for r in al.get("unmatched_roles", [])]
    line = "the recordings were aligned by what made each allocation: " + "; ".join(parts)
    if roles:
        line += "; most of it: " + ", ".join(roles)
    return line


def parse_rows(text):
    """`gpumem predict --json` output (one object, docs/predict.md) ->
    its `allocators` rows, each with `allocator`, `largest_batch` (as
    `max_batch` too) and `peak_reserved_bytes`."""
    text = text.strip()
    if not text:
        return []
    doc = json.loads(text)
    rows = doc.get("allocators") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError("gpumem predict --json gave no 'allocators' list")
    out = []
    for r in rows:
        row = dict(r)
        row["max_batch"] = r.get("largest_batch")
        out.append(row)
    return out


def check_line(text, prefix="check: batch", smaller="smaller"):
    """With three recordings or more, the largest is predicted from the
    others (docs/predict.md): one line saying how well, or None."""
    c = json.loads(text).get("check") if text.strip() else None
    if not c:
        return None
    line = "%s %s predicted from the %s ones: %s of %s allocations to the byte" % (
        prefix, c.get("batch"), smaller, c.get("exact"), c.get("allocations"))
    rec, pred = c.get("recorded_peak_live_bytes"), c.get("predicted_peak_live_bytes")
    if rec and pred is not None:
        line += "; peak live %s predicted, %s recorded" % (_gib(pred), _gib(rec))
    return line


def _gib(n):
    return "-" if n is None else "%.3f GiB" % (n / GIB)


_NUMBER = re.compile(r"\d[\d,]*")


def fold_notes(notes):
    """Notes that say the same thing of different sizes (a reduction's
    staging buffers, one note for each tensor) as one line each: the
    numbers that differ as a range, how many, and where the notes bound
    their bytes ("at most N bytes"), the sum of those bounds, or their
    largest where each is given back within its call."""
    groups = {}
    for n in notes:
        groups.setdefault(_NUMBER.sub("#", n), []).append(n)
    out = []
    for key, same in groups.items():
        if len(same) == 1:
            out.append(same[0])
            continue
        values = [[int(x.replace(",", "")) for x in _NUMBER.findall(n)] for n in same]
        parts = key.split("#")
        text = parts[0]
        for k, rest in enumerate(parts[1:]):
            column = sorted({v[k] for v in values if k < len(v)})
            form = "{}" if text.endswith(":") else "{:,}"  # (a line number, file.py:123, as it is)
            text += (form.format(column[0]) if len(column) == 1 else
                     (form + " to " + form).format(column[0], column[-1])) + rest  # fmt: skip
        text += " (%d of them" % len(same)
        m = re.search(r"at most # bytes", key)
        if m:
            k = key[: m.start()].count("#")
            bounds = [v[k] for v in values if k < len(v)]
            if "given back within the call" in key:
                # one call's buffers are gone before the next call's come:
                # no two are live at once, and the largest is what is at stake
                text += "; at most %s above the trace at any moment" % _gib(max(bounds))
            else:
                text += "; at most %s together" % _gib(sum(bounds))
        out.append(text + ")")
    return out


MISALIGNED = "the recordings differ"  # gpumem predict's words for recordings that do not align


def _misalignment(text):
    """gpumem predict's sentence naming the first event that differs."""
    line = text.splitlines()[0] if text else ""
    line = line[line.index(MISALIGNED):] if MISALIGNED in line else line
    return line.split(": the recordings must be", 1)[0]


def check_by_default(mode, device, profile):
    """(whether the answers are checked at the batches when --confirm and
    --no-confirm are not given, the line saying why not or None): on the
    CPU recorder always; on a GPU where it is the device profile's, as the
    check's convolutions run on it and its workspaces go beside the
    profile's figures."""
    if mode == "cpu" or device == profile.gpu:
        return True, None
    return False, ("not checked at the batches themselves: this GPU is %s, the device profile %s describes %s "
                   "(--profile; --confirm checks anyway)" % (device, profile.name, profile.gpu))


def start_rows(sizes, paths, memory, binary=None):
    """Rows to start the check's searches from where the recordings do not
    align: for each allocator, the batch where a line through the two
    recordings' peak reserved reaches memory (at least the larger batch)."""
    binary = _binary(binary)
    (b1, r1), (b2, r2) = [(b, confirm.fit_rows(binary, p, memory)) for b, p in zip(sizes, paths)]
    rows = []
    for allocator, row in r2.items():
        p1, p2 = r1.get(allocator, {}).get("peak_reserved_bytes"), row.get("peak_reserved_bytes")
        start = b2
        if p1 is not None and p2 is not None and p2 > p1:
            start = max(b2, b2 + int((memory - p2) * (b2 - b1) / (p2 - p1)))
        rows.append({"allocator": allocator, "max_batch": start, "peak_reserved_bytes": None, "start_only": True})
    return rows


def accumulation_hint(metas, sizes):
    """Where the runs at the small batches took different numbers of
    backward passes a step (gradient accumulation to a fixed global batch:
    64 micro-batches a step at batch 1, 32 at 2), a line saying so and how
    to predict such a script; else None. Their recordings cannot align,
    and each run at a small batch is a long one."""
    per_step = []
    for m in metas:
        counts = [c for c in m.get("backwards_per_step") or [] if c]
        if not counts:
            return None
        per_step.append(max(counts))
    if len(set(per_step)) < 2:
        return None
    return ("the script runs %s backward passes a step at batch %s: it accumulates gradients to a fixed global "
            "batch, so its steps differ from batch to batch; with one backward a step while predicting (its "
            "accumulation steps at 1, or the global batch given as {B} too) the recordings align"
            % (" and ".join(str(c) for c in per_step), " and ".join(str(b) for b in sizes)))  # fmt: skip


def check_at_batches(rows, checker, batch=None, how="with the CPU recorder"):
    """Puts the checker's figures in rows in place of the scaled ones
    (kept as scaled_*): the peak at batch, and each allocator's largest
    batch searched from the scaled one. Returns a line saying what was
    recorded and what scaling had said where it differs."""
    differ = []
    # The scaled answers are near the truth where the recordings align: a
    # recording at each answer and one batch past it settles most searches,
    # and these are made at once, as many together as there are workers.
    first = [batch] if batch is not None else []
    for r in rows:
        if r.get("max_batch"):
            first += [r["max_batch"], r["max_batch"] + 1]
    try:
        checker.prefetch(first)
        if getattr(checker, "capped_at", None) is not None:
            # (the batches stop at the dataset's length: that length first, which settles the searches it fits)
            checker.prefetch([checker.capped_at])
    except confirm.SearchBudget:
        pass
    # Where the scaled answers were far off (small runs that mislead: cuDNN's autotuner trying
    # workspaces at batch 1 and 2 that it does not try at 5000), the recordings just made give each
    # allocator a line through batches near its answer; the next round, again at once, is where
    # that line reaches the memory, and each search starts there.
    starts = {}
    for r in rows:
        if r.get("max_batch"):
            est = checker.secant(r["allocator"])
            if est is not None:
                starts[r["allocator"]] = est
    try:
        checker.prefetch(sorted({b for est in starts.values() for b in (est, est + 1)}))
    except confirm.SearchBudget:
        pass
    # Then rounds at once while searches stay open and there are workers to share: each open
    # search gives as many batches as its share of the workers (at most 3: a bracket cut in four),
    # where one recording after another would cut it in two.
    workers = getattr(checker, "workers", 1)
    while workers > 1 and checker.left():
        open_ = [r["allocator"] for r in rows if r.get("max_batch") and not checker.settled(r["allocator"])]
        k = max(1, min(3, workers // max(1, len(open_))))
        lists = [checker.split(who, k) for who in open_]
        todo = []
        for i in range(k):  # (each search's first batch before any search's second, as the budget may cut)
            for points in lists:
                if i < len(points) and points[i] not in todo:
                    todo.append(points[i])
        todo = todo[:checker.left()]
        if not todo:
            break
        checker.prefetch(sorted(todo))
    if batch is not None:
        try:
            peaks = checker.peaks(batch)
        except confirm.SearchBudget:
            peaks = {}
        for r in rows:
            if r.get("allocator") in peaks:
                r["scaled_peak_reserved_bytes"] = r.get("peak_reserved_bytes")
                r["peak_reserved_bytes"] = peaks[r["allocator"]]
    short = []
    for r in rows:
        start = r.get("max_batch")
        if not start:
            continue
        cap = getattr(checker, "capped_at", None)
        begin = starts.get(r["allocator"], start)
        try:
            lo, hi = confirm.largest(lambda b, who=r["allocator"]: checker.fits(b, who),
                                     begin if cap is None else min(begin, cap), known=checker.known(r["allocator"]))
        except confirm.SearchBudget as e:
            if e.lo is None:
                short.append("%s (no batch checked)" % r["allocator"])
                continue
            short.append("%s (%d fits%s)" % (r["allocator"], e.lo, "" if e.hi is None else ", %d does not" % e.hi))
            lo = e.lo
            r["max_batch_below"] = e.hi  # (the table shows the bracket: the search did not close it)
        r["scaled_max_batch"] = start
        r["max_batch"] = r["largest_batch"] = lo
        if cap is not None and lo == cap:
            r["dataset_items"] = cap  # (no larger batch: the dataset's length)
        if lo != start and not r.get("start_only"):
            differ.append("%s largest %d" % (r["allocator"], start))
    for r in rows:
        old, new = r.get("scaled_peak_reserved_bytes"), r.get("peak_reserved_bytes")
        if old and new and abs(new - old) > 0.005 * old:
            differ.append("%s peak %s" % (r["allocator"], _gib(old)))
    line = "checked %s at batch %s (%d recordings replayed)" % (
        how, ", ".join(str(b) for b in sorted(checker.rows)) or "-", len(checker.rows))
    if differ:
        line += "; scaled from the small runs: " + ", ".join(differ)
    if short:
        line += "; the search ran out of recordings (--confirm-runs) for " + ", ".join(short)
    if getattr(checker, "capped_at", None) is not None:
        line += ("; the script's DataLoader has %d items, so no batch it runs is larger%s: where that many fit, the "
                 "largest batch is the dataset's length (marked \"dataset\")"
                 % (checker.capped_at, " (with drop_last=True a larger one gives no batch at all)"
                    if getattr(checker, "no_batch_past", False) else ""))
    return line


def table(script, sizes, mode, memory, context, context_source, rows, notes, batch=None, check=None,
          seq_lens=None, seq_len=None, fraction=None, budget=None):
    """The command's report, as text."""
    where = "on the GPU" if mode == "gpu" else "on fake CUDA tensors (no GPU used)"
    recorded = "batch %s" % ", ".join(str(s) for s in sizes)
    if seq_lens:
        recorded += " x length %s, predicted at length %d" % (", ".join(str(s) for s in seq_lens), seq_len)
    lines = [
        "%s: recorded at %s %s" % (script, recorded, where),
        "device memory %s; the CUDA context takes %s (%s), leaving %s to the allocator"
        % (_gib(memory), _gib(context), context_source, _gib(memory - context)),
        "",
        "%-22s %-14s %s" % ("allocator", "largest batch", "peak reserved at batch %s" % batch if batch else "peak reserved"),
        "-" * 64,
    ]
    if fraction is not None:
        lines[2:2] = ["the script caps PyTorch at %s of the device (torch.cuda.set_per_process_memory_fraction)%s: "
                      "the table answers for %s" % (("%.4f" % fraction).rstrip("0").rstrip("."),
                                                    "" if budget < memory - context else ", more than the context leaves",
                                                    _gib(budget))]  # fmt: skip
    if check:
        lines[-3:-3] = [check]
    for r in rows:
        mb, cell = r.get("max_batch"), "-"
        if mb is not None:
            cell = str(mb)
        if mb is not None and r.get("dataset_items") == mb:
            cell = "%d (dataset)" % mb
        elif mb is not None and "max_batch_below" in r:  # a search cut short: what it knows
            below = r["max_batch_below"]
            cell = "%d+" % mb if below is None else "%d-%d" % (mb, below - 1)
        lines.append("%-22s %-14s %s" % (r.get("allocator", "?"), cell, _gib(r.get("peak_reserved_bytes"))))
    if any("is an upper bound" in n for n in notes):
        # (said above the table too: such a bound can be far above the job, and the table reads as its figures)
        lines.insert(2, "upper bounds: sizes that depend on tensor values the recording could not see were "
                        "taken at their largest (notes below), so the peaks are at most these and the largest "
                        "batches at least these")
    if notes:
        lines += ["", "What the recordings could not see, or assumed:"]
        lines += ["  - %s" % n for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None):
    started = time.monotonic()
    p = _parser()
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        memory = parse_size(a.memory)
        sizes = parse_sizes(a.batch_sizes)
    except ValueError as e:
        p.error(str(e))
    from . import runs

    filled = runs.templates(a.args)  # (configuration files that hold {B}: runs.py)
    if not any("{B}" in x for x in a.args) and not any("{B}" in t for _, _, t in filled.values()):
        p.error("the script's arguments need {B} where the batch size goes (e.g. --batch-size {B}), or a "
                "configuration file named in them (a copy of the script's own, JSON or YAML) does")
    seq_lens = None
    if a.seq_lens is not None or a.seq_len is not None:
        if a.seq_lens is None or a.seq_len is None:
            p.error("--seq-lens and --seq-len go together: the lengths to run at and the one to predict at")
        try:
            seq_lens = parse_sizes(a.seq_lens, "--seq-lens", "sequence lengths", "128,256,512")
        except ValueError as e:
            p.error(str(e))
        if a.seq_len < 1:
            p.error("--seq-len must be at least 1")
        if not any("{L}" in x for x in a.args) and not any("{L}" in t for _, _, t in filled.values()):
            p.error("with --seq-lens the script's arguments need {L} where the sequence length goes "
                    "(e.g. --max-length {L})")
    elif any("{L}" in x for x in a.args) or any("{L}" in t for _, _, t in filled.values()):
        p.error("the script's arguments have {L} but no --seq-lens gives the lengths to run at")
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if a.confirm_runs < 1:
        p.error("--confirm-runs must be at least 1")
    if not os.path.isfile(a.script):
        p.error("no script %s" % a.script)
    if a.gpus is not None or a.global_batch is not None:
        from . import distributed  # (several GPUs: docs/predict.md, "Several GPUs")

        return distributed.command(a, p, sys.modules[__name__], memory, sizes)
    try:
        mode = "gpu" if not a.cpu and _gpu_available() else "cpu"
        from . import profiles, runs

        gpu_name, torch_version = _local_gpu()
        try:
            profile, profile_line = profiles.choose(a.profile, gpu_name, torch_version)
        except ValueError as e:
            p.error(str(e))
        keep = a.traces is not None
        try:
            root = _safefs.private_dir(a.traces) if keep else _safefs.fresh_private_dir("gpumem-predict-")
        except OSError as e:
            raise PredictError("--traces: %s" % e if keep else str(e)) from None
        pool = RunPool(a, profile.path, root)

        def record_points_(points, how, prefix):
            try:
                return record_points(pool, points, how, root, prefix)
            except runs.RunError as e:
                raise PredictError(str(e)) from None

        def record_sizes(how, prefix):
            ms = record_points_([(b, length) for b in sizes for length in seq_lens or [None]], how, prefix)
            for m in ms:
                if m.get("no_batch"):
                    raise PredictError("%s at the batch sizes it is recorded at: %s" % (a.script, m["no_batch"]))
            return ms

        notes = []

        def add_notes(ms):
            for m in ms:
                for n in m["notes"]:
                    if n not in notes:
                        notes.append(n)

        metas = record_sizes(mode, "b")
        add_notes(metas)
        context = max(m["context_bytes"] for m in metas)
        if context >= memory:
            raise PredictError("the CUDA context alone (%s) takes all of --memory (%s)" % (_gib(context), _gib(memory)))
        # what the allocator may hold: the device less the context, or less where the
        # script caps PyTorch itself (a fraction of the whole device, as PyTorch counts it)
        fractions = [m["memory_fraction"] for m in metas if m.get("memory_fraction")]
        fraction = min(fractions) if fractions else None
        budget = memory - context if fraction is None else min(memory - context, int(fraction * memory))
        checks = [profile_line] if profile_line else []
        confirm_on = a.confirm
        if confirm_on is None:
            confirm_on, why_not = check_by_default(mode, metas[0].get("device"), profile)
            if why_not:
                checks.append(why_not)

        def scale(ms, prefix, sizes=sizes):
            paths = [m["path"] for m in ms]
            if seq_lens:
                # each batch's recordings over the lengths, written at --seq-len; then those over the batch
                n = len(seq_lens)
                written = []
                for i, b in enumerate(sizes):
                    out = os.path.join(root, "%s%d_L%d.trace" % (prefix, b, a.seq_len))
                    c = write_at(b, seq_lens, paths[i * n:(i + 1) * n], a.seq_len, out)
                    if c:
                        checks.append(c)
                    written.append(out)
                paths = written
            rows, check, aligned, model = run_predict(sizes, paths, budget, a.batch)
            for line in (check, aligned):
                if line and line not in checks:
                    checks.append(line)
            # (with its rows, how many sizes grew nearer the batch's square than a line)
            return rows, model.get("faster_than_batch", 0)

        direct = False  # every figure from recordings at the batches themselves
        try:
            scaled_from, scaled_mode = metas, mode
            try:
                rows, faster = scale(metas, "b")
            except PredictError as e:
                if mode != "gpu" or MISALIGNED not in str(e):
                    raise
                # A kernel that picks its algorithm by size (embedding's backward sorts its indices
                # past 3072 of them, cub's sorts take scratch) makes the GPU runs' requests differ
                # between batch sizes. On fake tensors the same operators make the same requests at
                # every batch: scale from those, and say so.
                fake = scaled_mode = "probe" if metas[0].get("device") == profile.gpu else "cpu"
                keep = True
                checks.append("the GPU runs' recordings do not align, so the scaling is from fake tensors "
                              "(%s) at the same batches: %s" % (
                                  "each convolution run on the GPU" if fake == "probe" else "the CPU recorder",
                                  _misalignment(str(e))))  # fmt: skip
                scaled_from = record_sizes(fake, "fake_b")
                add_notes(scaled_from)
                rows, faster = scale(scaled_from, "fake_b")
            if faster and len(sizes) == 2 and not seq_lens:
                # A size nearer the batch's square than a line (a batch-by-batch matrix: a contrastive
                # loss's logits) is a line through two recordings, far too low at a large batch: a third
                # recording fits it exactly, at the cost of one run.
                extra = 2 * sizes[-1]
                grew = "%d allocations grew faster than the batch from %d to %d (nearer its square than a line)" % (
                    faster, sizes[0], sizes[1])
                prefix = "b" if scaled_from is metas else "fake_b"
                try:
                    more = record_points_([(extra, None)], scaled_mode, prefix)
                    rows3, _ = scale(scaled_from + more, prefix, sizes + [extra])
                except PredictError as e:
                    checks.append("%s, and the recording at %d that would size them failed, so they are taken as "
                                  "lines, far too low at a large batch: %s" % (grew, extra, str(e).splitlines()[0]))
                else:
                    add_notes(more)
                    checks.append("%s, so the job was recorded at %d too and sized through all three" % (grew, extra))
                    sizes.append(extra)
                    scaled_from = scaled_from + more
                    if prefix == "b":
                        metas = scaled_from
                    rows = rows3
        except PredictError as e:
            keep = True
            hint = accumulation_hint(scaled_from, sizes)  # (why they may not align, where that is known)
            if MISALIGNED not in str(e) or not confirm_on or seq_lens:
                raise PredictError("%s\nthe recordings are in %s%s" % (e, root, "\n" + hint if hint else "")) from None
            # Control flow that depends on the batch (a loop over the images of a batch): no model
            # of the sizes, but on fake tensors a large batch costs what a small one does, so the
            # figures come from recordings at the batches themselves, the search started from a
            # line through the two largest small recordings' peaks.
            direct = True
            checks.append("the recordings at batch %s do not align, so every figure is from recordings at "
                          "the batches themselves: %s" % (", ".join(str(b) for b in sizes),
                                                          _misalignment(str(e))))  # fmt: skip
            if hint:
                checks.append(hint)
            rows = start_rows(sizes[-2:], [m["path"] for m in scaled_from[-2:]], budget)
        if confirm_on:
            check_mode = "probe" if mode == "gpu" else "cpu"

            def record_at(b):
                return record_many([b])[b]

            def record_many(batches):
                # (on a GPU machine the convolutions run there too, for their workspaces)
                ms = record_points_([(b, a.seq_len if seq_lens else None) for b in batches], check_mode, "at_b")
                add_notes(ms)
                for m in ms:
                    if m.get("dataset_items"):
                        checker.dataset(m["dataset_items"], bool(m.get("no_batch")))
                return {b: m["path"] for b, m in zip(batches, ms)}

            scaled = [dict(r) for r in rows]
            try:
                how = "on fake tensors, each convolution run on the GPU," if mode == "gpu" else "with the CPU recorder"
                checker = confirm.Checker(record_at, budget, _binary(), a.confirm_runs, record_many=record_many,
                                          workers=pool.jobs)  # fmt: skip
                checks.append(check_at_batches(rows, checker, a.batch, how))
            except (PredictError, RuntimeError) as e:
                if direct:
                    raise PredictError("the check at the batches themselves failed: %s\nthe recordings are in %s"
                                       % (str(e).splitlines()[0], root)) from None
                # the scaled answer stands, and the table says the check did not
                rows[:] = scaled
                keep = True
                checks.append("the check at the batches themselves failed, so the table is the scaled "
                              "prediction: %s" % str(e).splitlines()[0])
        sys.stdout.write(table(a.script, sizes, mode, memory, context, metas[0]["context_source"], rows,
                               fold_notes(notes), a.batch, "\n".join(checks) or None, seq_lens, a.seq_len,
                               fraction, budget))  # fmt: skip
        if keep:
            sys.stdout.write("recordings: %s\n" % root)
        spent = pool.timing()
        sys.stdout.write("time: %.0f s in all%s\n" % (time.monotonic() - started, ": " + spent if spent else ""))
        unanswered = [r["allocator"] for r in rows if r.get("max_batch") is None or
                      ("max_batch_below" in r and r["max_batch_below"] is None)]  # fmt: skip
        if unanswered and memory:
            sys.stderr.write(
                "gpumem.predict: no largest batch for %s: the check ran out of recordings before it found a batch "
                "that does not fit. Try --confirm-runs %d (more recordings), --batch-sizes %s (recordings at "
                "larger batches), or --no-confirm (the scaled answer as it is)\n"
                % (", ".join(unanswered), 2 * a.confirm_runs, ",".join(str(2 * b) for b in sizes)))  # fmt: skip
            return 3
        return 0
    except PredictError as e:
        if "root" in locals() and root in str(e):
            keep = True  # the message names a file in it (a failed run's log)
        sys.stderr.write("gpumem.predict: %s\n" % e)
        return 1
    finally:
        if "pool" in locals():
            pool.close()
        if "root" in locals() and not keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
