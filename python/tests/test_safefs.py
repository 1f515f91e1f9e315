"""Where gpumem.torch keeps and loads its compiled libraries
(gpumem/_safefs.py): a user with no usable home falls back to
<tmp>/gpumem-<uid>; another user who made that directory first and put a
library there must not get it loaded. The attacker is uid 65534 in a forked
child where this runs as root; otherwise the test's own files with modes
that let others write stand in."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gpumem import _safefs  # noqa: E402

NOBODY = 65534
ROOT = os.geteuid() == 0

# A library whose loading leaves a mark: loading it runs its constructor.
_MARKER_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
  const char* path = getenv("GPUMEM_TEST_MARK");
  FILE* f = path ? fopen(path, "w") : NULL;
  if (f) { fputs("loaded", f); fclose(f); }
}
"""


def _as_attacker(fn):
    """Runs fn() as uid 65534 in a forked child (as this user without
    root); raises when it fails."""
    if not ROOT:
        fn()
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the attacker's step failed")


class SafeFsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="gpumem_safefs_")
        os.chmod(self.tmp, 0o711)  # the attacker can reach the shared directory
        self.shared = os.path.join(self.tmp, "shared")  # stands in for /tmp
        os.mkdir(self.shared)
        os.chmod(self.shared, 0o1777)
        self.saved_env = {k: os.environ.get(k) for k in ("GPUMEM_CACHE_DIR", "XDG_CACHE_HOME", "HOME")}
        self.saved_tempdir = tempfile.tempdir
        # a home where ~/.cache/gpumem cannot be made: HOME is a file
        home = os.path.join(self.tmp, "home-is-a-file")
        open(home, "w").close()
        os.environ.pop("GPUMEM_CACHE_DIR", None)
        os.environ.pop("XDG_CACHE_HOME", None)
        os.environ["HOME"] = home
        tempfile.tempdir = self.shared

    def tearDown(self):
        tempfile.tempdir = self.saved_tempdir
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.tmp, ignore_errors=True)

    def cache_dir_warned(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            d = _safefs.cache_dir()
        return d, [str(w.message) for w in caught]

    def test_fallback_is_made_private(self):
        d, said = self.cache_dir_warned()
        want = os.path.join(self.shared, "gpumem-%d" % os.getuid())
        self.assertEqual(d, os.path.realpath(want))
        self.assertEqual(stat.S_IMODE(os.stat(d).st_mode), 0o700)
        self.assertEqual(said, [])
        # and the torch module's own cache directory is this one
        import gpumem.torch as gt

        self.assertEqual(gt._cache_dir(), d)

    def test_planted_fallback_refused(self):
        """Another user made <tmp>/gpumem-<uid> first (0777) and put the
        library gpumem.torch would load there (its name depends only on the
        torch install)."""
        if not shutil.which("cc"):
            self.skipTest("no C compiler to build the planted library")
        src = os.path.join(self.tmp, "mark.c")
        lib = os.path.join(self.tmp, "mark.so")
        with open(src, "w") as f:
            f.write(_MARKER_SOURCE)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", lib, src], check=True)
        os.chmod(lib, 0o755)
        planted_dir = os.path.join(self.shared, "gpumem-%d" % os.getuid())
        planted = os.path.join(planted_dir, "gpumem_torch_graphs_0123456789abcdef.so")

        def plant():
            os.mkdir(planted_dir)
            os.chmod(planted_dir, 0o777)
            shutil.copyfile(lib, planted)
            os.chmod(planted, 0o777)

        _as_attacker(plant)
        d, said = self.cache_dir_warned()
        self.assertNotEqual(d, os.path.realpath(planted_dir))
        self.assertEqual(stat.S_IMODE(os.stat(d).st_mode), 0o700)
        self.assertEqual(os.stat(d).st_uid, os.geteuid())
        self.assertTrue(any(planted_dir in s for s in said), said)
        self.assertTrue(
            any(("belongs to uid %d" % NOBODY if ROOT else "other users can write") in s for s in said), said
        )
        import gpumem.torch as gt

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertNotEqual(gt._cache_dir(), os.path.realpath(planted_dir))
        with self.assertRaises(_safefs.UnsafePathError) as cm:
            _safefs.check_library(planted)
        self.assertIn(planted, str(cm.exception))

        # gpumem.torch's loader, handed the planted library as the cached one
        mark = os.path.join(self.tmp, "loaded")
        os.environ["GPUMEM_TEST_MARK"] = mark
        saved = gt.build_graphs_shim
        gt.build_graphs_shim = lambda: (planted, None)
        try:
            state = gt._Enabled()
            self.assertFalse(gt._install_graphs(None, None, state))
        finally:
            gt.build_graphs_shim = saved
            os.environ.pop("GPUMEM_TEST_MARK", None)
        self.assertFalse(os.path.exists(mark), "the planted library was loaded")
        self.assertIn("refusing to load %s" % planted, state.why_no_graphs)
        self.assertIsNone(gt._frames_library(planted))
        self.assertFalse(os.path.exists(mark), "the planted library was loaded")

    def test_library_checks(self):
        d = _safefs.private_dir(os.path.join(self.tmp, "cache"))
        lib = os.path.join(d, "ok.so")
        with open(lib, "wb") as f:
            f.write(b"\0")
        os.chmod(lib, 0o755)
        _safefs.check_library(lib)  # this user's, in this user's directory
        os.chmod(lib, 0o775)
        with self.assertRaisesRegex(_safefs.UnsafePathError, "other users can write .*ok.so"):
            _safefs.check_library(lib)
        os.chmod(lib, 0o755)
        link = os.path.join(d, "link.so")
        os.symlink(lib, link)
        with self.assertRaisesRegex(_safefs.UnsafePathError, "symbolic link"):
            _safefs.check_library(link)
        os.chmod(d, 0o777)
        with self.assertRaisesRegex(_safefs.UnsafePathError, "other users can write %s" % d):
            _safefs.check_library(lib)
        with self.assertRaises(_safefs.UnsafePathError):
            _safefs.private_dir(d)
        os.chmod(d, 0o700)
        # a cache directory named by GPUMEM_CACHE_DIR that others can write
        open_dir = os.path.join(self.tmp, "open")
        os.mkdir(open_dir)
        os.chmod(open_dir, 0o777)
        os.environ["GPUMEM_CACHE_DIR"] = open_dir
        got, said = self.cache_dir_warned()
        self.assertNotEqual(got, os.path.realpath(open_dir))
        self.assertTrue(any(open_dir in s and "other users can write" in s for s in said), said)


if __name__ == "__main__":
    unittest.main()
