"""`gpumem top` against allocators of other processes (simulated device):
a live one, one that died without destroying its allocator, and --clean.

Run from the repository root:
    GPUMEM_LIBRARY=build/libgpumem.so python3 -m unittest discover -s python/tests -v
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
sys.path.insert(0, PYTHON_DIR)

import gpumem  # noqa: E402

MIB = 1 << 20

# A process that publishes an allocator holding 7 MiB, says "ready", then
# either waits for a line on stdin (and destroys the allocator) or dies
# without destroying it.
CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import gpumem
a = gpumem.Allocator("sim", conf="publish:on,limit:64M", capacity=1 << 30)
p = a.malloc(7 << 20)
print("ready", flush=True)
if sys.argv[2] == "die":
    os._exit(0)
sys.stdin.readline()
a.free(p)
a.close()
"""


def cli():
    lib = os.environ.get("GPUMEM_LIBRARY") or gpumem.library_path()
    path = os.path.join(os.path.dirname(os.path.abspath(lib)), "gpumem")
    return path if os.path.exists(path) else None


class TopTest(unittest.TestCase):
    def setUp(self):
        self.bin = cli()
        if not self.bin:
            self.skipTest("the gpumem command line is not beside the library")
        self.dir = tempfile.mkdtemp(prefix="gpumem_top.")
        self.env = dict(os.environ, GPUMEM_PUBLISH_DIR=self.dir)

    def tearDown(self):
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)

    def top(self, *args):
        r = subprocess.run([self.bin, "top", "--dir", self.dir] + list(args), capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout

    def child(self, mode):
        p = subprocess.Popen([sys.executable, "-c", CHILD, PYTHON_DIR, mode], env=self.env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.stdout.readline().strip(), "ready")
        return p

    def test_live_process(self):
        self.assertEqual(json.loads(self.top("--json")), [])
        p = self.child("wait")
        try:
            (row,) = json.loads(self.top("--json"))
            self.assertEqual(row["pid"], p.pid)
            self.assertTrue(row["alive"])
            self.assertEqual(row["allocated_bytes"], 7 * MIB)
            self.assertGreaterEqual(row["reserved_bytes"], 7 * MIB)
            self.assertEqual(row["limit_bytes"], 64 * MIB)
            self.assertEqual(row["policy"], "default")
            table = self.top("--once")
            self.assertIn("1 allocator published", table)
            self.assertIn(str(p.pid), table)
            self.assertIn("7.00 MiB", table)
        finally:
            p.stdin.write("\n")
            p.stdin.close()
            p.wait(timeout=60)
            p.stdout.close()
        self.assertEqual(json.loads(self.top("--json")), [], "the file outlived its allocator")

    def test_dead_process_and_clean(self):
        p = self.child("die")
        p.wait(timeout=60)
        p.stdin.close()
        p.stdout.close()
        (row,) = json.loads(self.top("--json"))
        self.assertEqual(row["pid"], p.pid)
        self.assertFalse(row["alive"])
        self.assertIn("exited", self.top("--once"))
        out = self.top("--clean", "--once")
        self.assertIn("removed 1 file of exited processes", out)
        self.assertEqual(os.listdir(self.dir), [])

    def test_publish_method(self):
        saved = os.environ.get("GPUMEM_PUBLISH_DIR")
        os.environ["GPUMEM_PUBLISH_DIR"] = self.dir
        try:
            with gpumem.Allocator("sim", conf="publish:on", capacity=1 << 30) as a:
                p = a.malloc(3 * MIB)
                a.publish()
                (row,) = json.loads(self.top("--json"))
                self.assertEqual((row["pid"], row["allocated_bytes"]), (os.getpid(), 3 * MIB))
                a.free(p)
            with gpumem.Allocator("sim", capacity=1 << 30) as a:  # auto: off here
                with self.assertRaises(gpumem.UnsupportedError):
                    a.publish()
        finally:
            if saved is None:
                del os.environ["GPUMEM_PUBLISH_DIR"]
            else:
                os.environ["GPUMEM_PUBLISH_DIR"] = saved
        self.assertEqual(json.loads(self.top("--json")), [])

    def test_usage_errors(self):
        r = subprocess.run([self.bin, "top", "--bogus"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown option", r.stderr)
        r = subprocess.run([self.bin, "top", "--once", "--dir", os.path.join(self.dir, "none")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("cannot read", r.stderr)


if __name__ == "__main__":
    unittest.main()
