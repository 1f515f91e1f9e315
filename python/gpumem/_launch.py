"""Running an unedited program under gpumem.

    python -m gpumem.torch [--conf STRING] [--verbose] script.py [args...]
    python -m gpumem.torch [--conf STRING] [--verbose] -m module [args...]
    torchrun --nproc-per-node N -m gpumem.torch script.py [args...]

enables gpumem as PyTorch's CUDA allocator (gpumem.torch.enable(conf);
without --conf, GPUMEM_CONF applies), then runs the script as __main__ with
sys.argv and sys.path[0] as `python script.py args` would set them (-m: as
`python -m module args`). Under torchrun each rank runs this command, so
each enables gpumem in its own process.

`python -m gpumem.torch` executes gpumem/torch.py as __main__: a second
copy of that file, apart from the gpumem.torch module the program imports.
Its __main__ block only calls main() here, which imports the real
gpumem.torch and enables that one, so the program and the launcher see one
allocator and one enabled state.

`gpumem run [--conf S] -- COMMAND` (the command line) reaches the same code
through gpumem/_bootstrap/sitecustomize.py, which calls
enable_when_torch_imported() in every Python process of COMMAND.

--verbose (or GPUMEM_TORCH_VERBOSE=1) prints on stderr a line once gpumem is
enabled and one per device with its peak memory when the process exits.
"""

import atexit
import os
import runpy
import sys

_USAGE = """\
usage: python -m gpumem.torch [--conf STRING] [--verbose] script.py [args...]
       python -m gpumem.torch [--conf STRING] [--verbose] -m module [args...]

Runs a Python program with gpumem as PyTorch's CUDA allocator, unedited.
Under torchrun: torchrun --nproc-per-node N -m gpumem.torch script.py [args...]

options:
  --conf STRING  gpumem's configuration (GPUMEM_CONF grammar: limit:40G,
                 policy:pytorch, ...); without it GPUMEM_CONF applies
  --verbose      say on stderr that gpumem is enabled, and each device's
                 peak memory at exit
  -h, --help     this text
"""

_VERBOSE_ENV = "GPUMEM_TORCH_VERBOSE"


def _say(text):
    sys.stderr.write("gpumem: %s\n" % text)
    sys.stderr.flush()


def _gib(n):
    return "%.2f GiB" % (n / float(1 << 30))


def _report_at_exit():
    """Each device's peak allocated and reserved bytes under gpumem."""
    from . import _core, _lib

    try:
        lib = _lib.load()
        for device in range(_core._MAX_DEVICES):
            if lib.gpumem_binding_peek(device):
                stats = _core.memory_stats(device)
                _say(
                    "device %d: peak allocated %s, peak reserved %s"
                    % (
                        device,
                        _gib(stats.get("allocated_bytes.all.peak", 0)),
                        _gib(stats.get("reserved_bytes.all.peak", 0)),
                    )
                )
    except Exception as e:  # at exit, say why rather than print a traceback
        _say("peak memory unavailable: %s" % e)


def enable_torch(conf=None, verbose=False):
    """gpumem.torch.enable(conf); with verbose, the enabled line now and the
    peak memory report at exit."""
    import gpumem.torch as gpumem_torch

    status = gpumem_torch.enable(conf)
    if verbose:
        _say(
            "enabled as PyTorch's CUDA allocator in process %d (conf %r, out-of-memory raises %s, "
            "library %s)"
            % (
                os.getpid(),
                status.get("conf") or "",
                "torch.OutOfMemoryError" if status.get("oom_mode") == "shim" else "RuntimeError",
                status.get("library"),
            )
        )
        atexit.register(_report_at_exit)
    return status


def _parse(argv):
    """(conf, verbose, kind, target, args): kind "path" or "module"."""
    conf, verbose = None, False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            sys.stdout.write(_USAGE)
            raise SystemExit(0)
        if a == "--verbose":
            verbose = True
        elif a == "--conf":
            if i + 1 >= len(argv):
                raise _UsageError("--conf needs a value")
            i += 1
            conf = argv[i]
        elif a.startswith("--conf="):
            conf = a[len("--conf=") :]
        elif a == "-m":
            if i + 1 >= len(argv):
                raise _UsageError("-m needs a module name")
            return conf, verbose, "module", argv[i + 1], argv[i + 2 :]
        elif a == "--":
            if i + 1 >= len(argv):
                raise _UsageError("no script to run")
            return conf, verbose, "path", argv[i + 1], argv[i + 2 :]
        elif a.startswith("-"):
            raise _UsageError("unknown option %r" % a)
        else:
            return conf, verbose, "path", a, argv[i + 1 :]
        i += 1
    raise _UsageError("no script to run")


class _UsageError(Exception):
    pass


def main(argv=None):
    """Entry point of `python -m gpumem.torch`; returns the exit status when
    the program could not be started (a program that runs exits itself,
    or returns 0)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        conf, verbose, kind, target, args = _parse(argv)
    except _UsageError as e:
        sys.stderr.write("python -m gpumem.torch: %s\n\n%s" % (e, _USAGE))
        return 2
    if kind == "path" and not os.path.exists(target):
        sys.stderr.write("python -m gpumem.torch: can't open file %r: no such file\n" % target)
        return 2
    verbose = verbose or os.environ.get(_VERBOSE_ENV) == "1"
    try:
        enable_torch(conf, verbose)
    except Exception as e:
        from . import errors

        if not isinstance(e, (errors.GpumemError, RuntimeError, ImportError)):
            raise
        sys.stderr.write("python -m gpumem.torch: cannot enable gpumem: %s\n" % e)
        return 1
    if conf is not None:
        # The program's own children (DataLoader workers, subprocesses) see
        # the same configuration.
        os.environ["GPUMEM_CONF"] = conf
    if kind == "module":
        sys.argv = [target] + args  # run_module puts the module's file in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target] + args
        # As `python script.py`: the script's directory first on sys.path
        # where python -m put the working directory (neither, under -P).
        if not getattr(sys.flags, "safe_path", False):
            sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    return 0


# ---- `gpumem run`: enable in every Python process that imports torch ---------


class _EnableAfterTorchImport:
    """A meta path finder that lets the real finders locate torch, then
    enables gpumem once torch's top-level module has executed: before
    anything can create a CUDA tensor, and only in processes that use
    torch at all (a Python started for something else pays nothing)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_enable(module):
            exec_module(module)
            _enable_from_environment()

        loader.exec_module = exec_then_enable
        return spec


def _enable_from_environment():
    try:
        enable_torch(None, os.environ.get(_VERBOSE_ENV) == "1")
    except Exception as e:
        _say("cannot enable gpumem for PyTorch in process %d: %s" % (os.getpid(), e))
        raise


def enable_when_torch_imported():
    """Enables gpumem.torch as soon as torch is imported (at once if it
    already is); GPUMEM_CONF configures it."""
    if "torch" in sys.modules:
        _enable_from_environment()
    elif not any(isinstance(f, _EnableAfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _EnableAfterTorchImport())
