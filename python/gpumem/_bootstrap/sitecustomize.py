"""gpumem's start-up hook for `gpumem run -- COMMAND`.

`gpumem run` puts this directory first on PYTHONPATH and sets
GPUMEM_ENABLE_TORCH=1, so every Python process of the command (and of its
children: torchrun's workers) runs this file at start-up (site.py imports
the first sitecustomize on sys.path). It then:

1. loads the gpumem package it is part of (the parent directory), under the
   name gpumem, whatever else the interpreter has installed: the command
   line and the package come from one build;
2. arranges for gpumem.torch.enable() to run the moment torch is imported
   (gpumem._launch.enable_when_torch_imported), GPUMEM_CONF configuring it;
3. runs the sitecustomize this file shadows, if the interpreter has one
   (Debian's, a virtual environment's).

Without GPUMEM_ENABLE_TORCH=1 it does only step 3.
"""

import os
import sys


def _load_gpumem():
    import importlib.util

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    loaded = sys.modules.get("gpumem")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(
        "gpumem", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpumem"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["gpumem"]
        raise
    return module


def _run_shadowed_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop("sitecustomize", None)
    saved_path = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved_path
        if me is not None:
            sys.modules["sitecustomize"] = me


if os.environ.get("GPUMEM_ENABLE_TORCH") == "1":
    try:
        _load_gpumem()
        from gpumem import _launch

        _launch.enable_when_torch_imported()
    except Exception as _e:  # never stop the interpreter from starting
        sys.stderr.write("gpumem run: the start-up hook failed: %s\n" % _e)
_run_shadowed_sitecustomize()
