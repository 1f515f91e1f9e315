"""The runs of a training script that `python -m gpumem.predict` records:
made by one process that imported PyTorch and the script's imports once
(_server.py), several at a time where there are cores, with a line on
standard error at least every 10 seconds while any runs, and, when a run
fails, the line of the user's own code it failed at and where its whole
output is.

    runs = Runs(script, args, steps, profile_path, jobs=2)
    metas = runs.record([(1, None), (2, None)], "cpu", root, "b")
    runs.close()
"""

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

from .. import _safefs

PROGRESS_EVERY = 10.0  # seconds between progress lines at most


class RunError(Exception):
    """A run failed; the text says where and why."""


def _at(batch_size, seq_len=None):
    return "batch %d" % batch_size + ("" if seq_len is None else " length %d" % seq_len)


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')


def user_frame(log_text, script):
    """(file:line in name, the exception's line) of the last frame of the
    user's own code in the log's last traceback: the script, or a file of
    theirs beside it, not PyTorch's, a library's or gpumem's. (None, line)
    when no frame is theirs. A progress bar may share the traceback's first
    line (tqdm ends its lines with a carriage return) and print after it."""
    lines = log_text.splitlines()
    start = max((i for i, ln in enumerate(lines) if "Traceback (most recent call last):" in ln), default=None)
    if start is None:
        return None, None
    script_dir = os.path.dirname(os.path.abspath(script))
    frame, last = None, start
    for i, ln in enumerate(lines[start:], start):
        m = _FRAME.match(ln)
        if not m:
            continue
        last = i
        path = os.path.abspath(m.group(1))
        theirs = path.startswith(script_dir + os.sep) and "site-packages" not in path and "/gpumem/" not in path
        if theirs:
            shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
            frame = "%s:%s in %s" % (shown, m.group(2), m.group(3).strip())
    # the exception: the first line at the margin after the last frame (and its source lines)
    error = next((ln.strip() for ln in lines[last + 1:] if ln.strip() and not ln[0].isspace()), None)
    return frame, error


# A configuration file named in the script's arguments may hold {B} (and
# {L}) in place of the batch size: a script that reads its batch size from
# a JSON or YAML file (HF's run_*.py take one such file as their only
# argument). Each run gets a copy with the values put in.
TEMPLATE_MAX_BYTES = 1 << 20


def templates(args):
    """{index: (prefix, path, text)} for each argument that names a readable
    regular file of at most TEMPLATE_MAX_BYTES holding {B} or {L}, as
    itself or after `--option=`."""
    found = {}
    for i, x in enumerate(args):
        option, eq, value = x.partition("=")
        prefix, path = (option + eq, value) if eq and not os.path.isfile(x) else ("", x)
        if "{B}" in x or not path or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                data = f.read(TEMPLATE_MAX_BYTES + 1)
        except OSError:
            continue
        if len(data) > TEMPLATE_MAX_BYTES:
            continue
        text = data.decode("utf-8", "replace")
        if "{B}" in text or "{L}" in text:
            found[i] = (prefix, path, text)
    return found


def _filled(text, b, length):
    text = text.replace("{B}", str(b))
    return text if length is None else text.replace("{L}", str(length))


class Runs:
    """The server process and the runs asked of it."""

    def __init__(self, script, args, steps, profile, jobs=1, timeout=1800, log_dir=None, env=None, one_gpu=True):
        self.one_gpu = one_gpu  # (False: ranks on the fake process group, --gpus)
        self.script, self.args, self.steps, self.profile = script, list(args), steps, profile
        self.templates = templates(self.args)
        self.timeout = timeout
        self.jobs = max(1, jobs)
        self.started = time.monotonic()
        self.count = 0
        self.busy_s = 0.0  # run time summed over runs
        self.import_s = None
        log = None
        if log_dir:
            path = os.path.join(log_dir, "server.log")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpumem.predict._server", script, str(self.jobs)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log if log is not None else subprocess.DEVNULL,
            text=True, bufsize=1, start_new_session=True)  # fmt: skip
        if log is not None:
            os.close(log)
        self.server_log = os.path.join(log_dir, "server.log") if log_dir else None
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._next = 0
        t0 = time.monotonic()
        line = self._read_line(time.monotonic() + 600, "importing PyTorch and %s's imports" % script)
        ready = json.loads(line) if line else {}
        if "no_torch" in ready:
            raise RunError("gpumem.predict needs PyTorch (pip install torch): %s" % ready["no_torch"])
        if not ready.get("ready"):
            raise RunError("the recording process did not start (exit status %s)%s" % (
                self.proc.poll(), "; its output is in %s" % self.server_log if self.server_log else ""))
        self.import_s = time.monotonic() - t0

    def _progress(self, what):
        sys.stderr.write("gpumem.predict: %3.0f s: %s\n" % (time.monotonic() - self.started, what))
        sys.stderr.flush()

    def _read_line(self, deadline, what):
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= deadline:
                return None
            if now - last >= PROGRESS_EVERY:
                self._progress(what)
                last = now
            if self._sel.select(timeout=min(1.0, deadline - now)):
                return self.proc.stdout.readline()
            if self.proc.poll() is not None:
                return self.proc.stdout.readline()

    def record(self, points, mode, root, prefix="b", folders=None, env=None):
        """Runs the script at each (batch, seq_len) of points in mode (cpu,
        probe or gpu), into root/<prefix><batch>[_L<len>]/ (or root/ each of
        folders), each child with env's variables set besides the
        process's; returns each run's meta (with 'path': its trace), in
        order. RunError when one fails."""
        requests = []
        for k, (b, length) in enumerate(points):
            folder = folders[k] if folders else prefix + "%d" % b + ("" if length is None else "_L%d" % length)
            try:
                out_dir = _safefs.private_dir(os.path.join(root, folder))
            except OSError as e:
                raise RunError(str(e)) from None
            argv = [_filled(x, b, length) for x in self.args]
            for i, (opt, path, text) in self.templates.items():
                # (the copy keeps the file's name, in a directory of its own beside the run's files:
                # a script may read the format from its extension)
                try:
                    copy = os.path.join(_safefs.private_dir(os.path.join(out_dir, "args%d" % i)),
                                        os.path.basename(path))
                    _safefs.write_file(copy, _filled(text, b, length))
                except OSError as e:
                    raise RunError("%s filled in for batch %d: %s" % (path, b, e)) from None
                argv[i] = opt + copy
            self._next += 1
            requests.append({"id": self._next, "mode": mode, "out_dir": out_dir, "steps": self.steps,
                             "profile": self.profile, "argv": argv, "env": env or {}, "at": _at(b, length)})  # fmt: skip
        where = "on the GPU" if mode == "gpu" else "on fake tensors"
        for r in requests:
            self.proc.stdin.write(json.dumps({k: v for k, v in r.items() if k != "at"}) + "\n")
        self.proc.stdin.flush()
        pending = {r["id"]: r for r in requests}
        t0 = time.monotonic()
        deadline = t0 + self.timeout * max(1, -(-len(requests) // self.jobs))
        rcs = {}
        while pending:
            what = "recording %s at %s (%d of %d done)" % (where, ", ".join(r["at"] for r in pending.values()),
                                                           len(requests) - len(pending), len(requests))  # fmt: skip
            line = self._read_line(deadline, what)
            if not line:
                self.kill()
                raise RunError("%s at %s ran past %g s%s" % (self.script, ", ".join(r["at"] for r in pending.values()),
                                                            self.timeout, "" if self.proc.poll() is None else
                                                            " (the recording process ended)"))  # fmt: skip
            msg = json.loads(line)
            if msg.get("id") in pending:
                rcs[msg["id"]] = msg["rc"]
                pending.pop(msg["id"])
        elapsed = time.monotonic() - t0
        self.count += len(requests)
        self.busy_s += elapsed * min(len(requests), self.jobs)
        return [self._meta(r, rcs[r["id"]]) for r in requests]

    def _meta(self, r, rc):
        out_dir, at = r["out_dir"], r["at"]
        log = os.path.join(out_dir, "log")
        meta_path = os.path.join(out_dir, "meta.json")
        if rc != 0 or not os.path.lexists(meta_path):
            try:
                text = _safefs.read_own(log, 1 << 24).decode("utf-8", "replace")
            except OSError:
                text = ""
            frame, error = user_frame(text, self.script)
            tail = text.strip().splitlines()[-6:]
            head = "%s at %s failed (exit status %d)" % (self.script, at, rc)
            if frame:
                head += " at %s: %s" % (frame, error or "")
            elif error:
                head += ": %s" % error
            hint = ""
            if self.one_gpu and "init_process_group" in text:
                hint = ("\nthe script starts a process group (torch.distributed.init_process_group): record it with "
                        "--gpus 1 (or the world sizes to predict), on PyTorch's fake process group")
            raise RunError("%s\n  %s\nthe whole output: %s%s" % (head, "\n  ".join(tail) or "(no output)", log, hint))
        try:
            meta = json.loads(_safefs.read_own(meta_path, 1 << 24).decode("utf-8"))
        except (OSError, ValueError) as e:
            raise RunError("%s at %s: cannot read what it recorded: %s" % (self.script, at, e)) from None
        if meta.get("no_batch"):
            # a DataLoader that gives no batch at this one (drop_last): no recording, and whoever asked
            # for it takes the dataset's length as the largest batch the script runs
            meta["path"] = None
            return meta
        meta["path"] = os.path.join(out_dir, "trace")  # (never a name read from a file)
        try:
            meta["output"] = _safefs.read_own(log, 1 << 24).decode("utf-8", "replace")
        except OSError:
            meta["output"] = ""
        if meta["steps"] == 0 and not meta.get("ended"):
            raise RunError("%s at %s stopped before its first optimizer step: nothing to scale" % (self.script, at))
        if meta["steps"] == 0:
            meta["notes"] = meta["notes"] + [
                "%s took no optimizer step and updated no parameter after a backward (inference): its whole run is "
                "what is scaled" % os.path.basename(self.script)]  # fmt: skip
        return meta

    def kill(self):
        """Ends the server and every run it started (one process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
