"""The process that makes `python -m gpumem.predict`'s recordings: it
imports PyTorch, the recorder and the training script's own imports once,
then forks one child per recording, so that each recording costs the run
of the script and not the imports again (torch and transformers take
seconds to import, as long as a small job's recording).

    python -m gpumem.predict._server SCRIPT JOBS

Reads requests from stdin, one JSON object a line:
    {"id": K, "mode": "cpu|probe|gpu", "out_dir": D, "steps": N,
     "profile": P, "argv": [...], "env": {NAME: VALUE, ...}}
runs at most JOBS children at once, and writes one line to stdout for each
when it ends: {"id": K, "rc": EXIT_STATUS}. The child runs
gpumem.predict._child in place, its output going to D/log (a new file: D
is a directory of the user's alone, made by the command). This process
never touches CUDA, so a child may (a GPU run): a CUDA context does not
survive a fork, so none must exist before it. It leads a process group of
its own, its children in it: the command ends them all at once when a run
passes its time."""

import ast
import json
import os
import selectors
import sys


def _preimport(script):
    """Imports what the script imports at its top level, best effort: a
    module that fails to import here fails again in the child, which says
    so in its log."""
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for node in tree.body:
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # the names too: a library that loads its modules when a name is
            # first asked for (transformers) has loaded nothing before that
            wanted = [(node.module, a.name) for a in node.names if a.name != "*"]
        else:
            continue
        for module, name in wanted:
            try:
                m = __import__(module, fromlist=["_"] if name else [])
                if name:
                    getattr(m, name)
            except BaseException:  # noqa: BLE001 (any failure is the child's to report)
                pass
    sys.path.pop(0)


def _preimport_recording():
    """Imports here, once, what each recording would otherwise import on its
    first use in every child: FakeTensorMode's first construction imports
    torch._dynamo (over a second), and the recorder asks transformers'
    import_utils about fake tensors wherever transformers is installed (half
    a second). Neither touches CUDA. Without these a small job's recording
    took 3.4 s rather than 0.2. A failure here is the child's to report."""
    import importlib.util

    try:
        import torch._dynamo.config  # noqa: F401
    except Exception:  # noqa: BLE001
        pass
    if importlib.util.find_spec("transformers") is not None:
        try:
            from transformers.utils import import_utils  # noqa: F401
        except Exception:  # noqa: BLE001 (a transformers that fails to import is the job's to report)
            pass


def _run_child(request, script, protocol):
    """In the forked child: runs the recording; never returns."""
    code = 1
    try:
        os.close(protocol.fileno())  # (the server's line to the command: not the child's)
        out_dir = request["out_dir"]
        log = os.path.join(out_dir, "log")
        try:
            os.unlink(log)  # an earlier run's (the directory is the user's alone)
        except FileNotFoundError:
            pass
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.environ.update(request.get("env") or {})
        from gpumem.predict import _child as child

        argv = [request["mode"], out_dir, str(request["steps"]), request["profile"], script] + request["argv"]
        code = child.main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            sys.stderr.write("%s\n" % e.code)
    except BaseException:  # noqa: BLE001 (the log holds it; the parent reads it)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def main(argv):
    script, jobs = argv[0], max(1, int(argv[1]))
    # The lines to the command go to a file of their own; what the script's
    # imports print goes to the log, where it cannot be taken for one.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)

    def say(message):
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        import torch  # noqa: F401 (imported once here, for every child)
    except ImportError as e:
        # (the command, on a machine with no GPU, has not imported torch itself)
        say({"ready": False, "no_torch": str(e)})
        return 1

    from gpumem.predict import _child, recorder  # noqa: F401

    _preimport_recording()
    _preimport(script)
    say({"ready": True})
    waiting, running = [], {}
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)
    stdin_open = True
    while stdin_open or waiting or running:
        while waiting and len(running) < jobs:
            request = waiting.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(request, script, protocol)
            running[pid] = request["id"]
        if stdin_open and (not running or sel.select(timeout=0.05)):
            line = sys.stdin.readline()
            if not line:
                stdin_open = False
            elif line.strip():
                waiting.append(json.loads(line))
            continue
        if running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if not stdin_open:
                    pid, status = os.waitpid(-1, 0)
                else:
                    continue
            ident = running.pop(pid, None)
            if ident is not None:
                say({"id": ident, "rc": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
