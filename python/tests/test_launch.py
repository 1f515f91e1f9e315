"""Running unedited programs under gpumem: `python -m gpumem.torch` and
`gpumem run` (no torch needed: a stand-in torch package records what the
start-up hook does, and gpumem._launch.enable_torch is replaced where the
real one would need PyTorch)."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)  # python/, holding the gpumem package


def _library_dir():
    lib = os.environ.get("GPUMEM_LIBRARY")
    return os.path.dirname(os.path.abspath(lib)) if lib else None


def _run(args, env_extra=None, cwd=None, drop=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR
    for key in drop:
        env.pop(key, None)
    env.update(env_extra or {})
    return subprocess.run(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class LauncherTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
        return path

    def launch(self, argv, **kw):
        """gpumem._launch.main(argv) in a fresh interpreter, enable_torch
        replaced by a recorder (the real one needs PyTorch)."""
        code = (
            "import sys, gpumem._launch as L\n"
            "L.enable_torch = lambda conf, verbose: print('ENABLED conf=' + str(conf) + ' verbose=' + str(verbose), "
            "file=sys.stderr)\n"
            "sys.exit(L.main(%r))\n" % (argv,)
        )
        return _run([sys.executable, "-c", code], **kw)

    def test_script_runs_as_main_with_its_arguments(self):
        script = self.write(
            "prog/train.py",
            """
            import os, pickle, sys
            class Point:  # classes of the script pickle as they do under python script.py
                pass
            print("name", __name__)
            print("argv", sys.argv)
            print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
            print("pickled", type(pickle.loads(pickle.dumps(Point()))).__name__)
            sys.exit(3)
            """,
        )
        r = self.launch(["--conf", "limit:1G", "--verbose", script, "--lr", "3e-4"])
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("ENABLED conf=limit:1G verbose=True", r.stderr)
        self.assertIn("name __main__", r.stdout)
        self.assertIn("argv [%r, '--lr', '3e-4']" % script, r.stdout)
        self.assertIn("path0 True", r.stdout)
        self.assertIn("pickled Point", r.stdout)

    def test_module_runs_as_main(self):
        self.write("mods/fake_trainer.py", "import sys\nprint('module', __name__, sys.argv[1:])\n")
        mods = os.path.join(self.dir, "mods")
        r = self.launch(["-m", "fake_trainer", "a", "b"], env_extra={"PYTHONPATH": PYTHON_DIR + ":" + mods})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("ENABLED conf=None verbose=False", r.stderr)
        self.assertIn("module __main__ ['a', 'b']", r.stdout)

    def test_usage_errors(self):
        for argv, why in (
            ([], "no script to run"),
            (["--conf"], "--conf needs a value"),
            (["--bogus", "x.py"], "unknown option '--bogus'"),
            (["/nonexistent/train.py"], "can't open file"),
        ):
            with self.subTest(argv=argv):
                r = self.launch(argv)
                self.assertEqual(r.returncode, 2)
                self.assertIn(why, r.stderr)
                self.assertNotIn("ENABLED", r.stderr)

    def test_without_torch_says_so(self):
        # The real entry point: gpumem/torch.py run as __main__.
        script = self.write("s.py", "print('script ran')\n")
        # A torch that cannot be imported, whether or not one is installed.
        self.write("notorch/torch/__init__.py", "raise ImportError('No module named torch (hidden)')\n")
        path = os.path.join(self.dir, "notorch") + ":" + PYTHON_DIR + ":" + self.dir
        r = _run([sys.executable, "-m", "gpumem.torch", script], env_extra={"PYTHONPATH": path})
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("cannot enable gpumem: gpumem.torch needs PyTorch", r.stderr)
        self.assertNotIn("script ran", r.stdout)

    def test_predict_without_torch_says_so(self):
        # --cpu too (the recorder runs the job on PyTorch's fake tensors):
        # one line naming what to install, no traceback.
        script = self.write("s.py", "print('script ran')\n")
        self.write("notorch/torch/__init__.py", "raise ImportError('No module named torch (hidden)')\n")
        path = os.path.join(self.dir, "notorch") + ":" + PYTHON_DIR
        for cpu in ([], ["--cpu"]):
            r = _run([sys.executable, "-m", "gpumem.predict", "--memory", "8G"] + cpu + [script, "--batch-size", "{B}"],
                     env_extra={"PYTHONPATH": path})  # fmt: skip
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("gpumem.predict needs PyTorch (pip install torch)", r.stderr)
            self.assertNotIn("Traceback", r.stderr)
            self.assertNotIn("script ran", r.stdout)


@unittest.skipUnless(_library_dir() and os.path.exists(os.path.join(_library_dir(), "gpumem")),
                     "needs the gpumem program beside GPUMEM_LIBRARY")
class RunCommandTest(unittest.TestCase):
    """gpumem run -- COMMAND: the start-up hook in every Python process."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        root = self.tmp.name
        self.exe = os.path.join(_library_dir(), "gpumem")
        # A stand-in torch, and a sitecustomize the hook must not hide.
        os.makedirs(os.path.join(root, "fake", "torch"))
        with open(os.path.join(root, "fake", "torch", "__init__.py"), "w") as f:
            f.write("imported_fully = True\n")
        os.makedirs(os.path.join(root, "site"))
        with open(os.path.join(root, "site", "sitecustomize.py"), "w") as f:
            f.write("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
        self.path = os.path.join(root, "fake") + ":" + os.path.join(root, "site")

    def tearDown(self):
        self.tmp.cleanup()

    def test_every_python_process_enables_when_it_imports_torch(self):
        code = textwrap.dedent(
            """
            import os, subprocess, sys
            import gpumem, gpumem._launch as L
            def record(conf, verbose):
                t = sys.modules["torch"]
                print("ENABLED pid=%d conf=%s verbose=%s torch_done=%s" % (
                    os.getpid(), os.environ.get("GPUMEM_CONF"), verbose, getattr(t, "imported_fully", False)))
            L.enable_torch = record
            print("package", os.path.dirname(gpumem.__file__))
            print("other sitecustomize", os.environ.get("OTHER_SITECUSTOMIZE_RAN"))
            print("before import", "torch" in sys.modules)
            import torch
            import torch  # once per process
            child = ("import gpumem._launch as L, sys; "
                     "L.enable_torch = lambda c, v: print('CHILD ENABLED'); import torch")
            subprocess.run([sys.executable, "-c", child], check=True)
            """
        )
        r = _run(
            [self.exe, "run", "--conf", "limit:1G", "--verbose", "--", sys.executable, "-c", code],
            env_extra={"PYTHONPATH": self.path},
            drop=("GPUMEM_CONF",),
        )
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("package %s" % os.path.join(PYTHON_DIR, "gpumem"), r.stdout)
        self.assertIn("other sitecustomize 1", r.stdout)
        self.assertIn("before import False", r.stdout)
        self.assertEqual(r.stdout.count("ENABLED pid="), 1, r.stdout)
        self.assertIn("conf=limit:1G verbose=True torch_done=True", r.stdout)
        self.assertIn("CHILD ENABLED", r.stdout)

    def test_python_without_torch_is_untouched(self):
        r = _run([self.exe, "run", "--", sys.executable, "-c", "import sys; print('torch' in sys.modules)"])
        self.assertEqual((r.returncode, r.stdout.strip(), r.stderr), (0, "False", ""))

    def test_errors(self):
        r = _run([self.exe, "run", "--conf", "bogus:1", "--", "true"])
        self.assertEqual(r.returncode, 2)
        self.assertIn('unknown key "bogus"', r.stderr)
        r = _run([self.exe, "run"])
        self.assertEqual(r.returncode, 2)
        self.assertIn("no command to run", r.stderr)
        r = _run([self.exe, "run", "--", "/nonexistent/program"])
        self.assertEqual(r.returncode, 127)
        self.assertIn("cannot run '/nonexistent/program'", r.stderr)


if __name__ == "__main__":
    unittest.main()
