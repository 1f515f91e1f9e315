"""What `python -m gpumem.predict` and the Python side write is as safe
from other users as the C side's files (gpumem/_safefs.py: write_file,
private_dir, read_own; docs/security.md). Another local user (uid 65534, in
a forked child: this runs as root in CI) plants each variant of the attack
first: the --traces directory made by them, a link to a file of the
victim's where a recording goes, a link to a directory of the victim's
where a run's folder goes, a regular file of theirs where a recording
goes, a meta file of theirs, a sticky directory of theirs. Each time the
victim's files must stay as they were, the attacker's files must not
receive the victim's data, and the refusal must name the path."""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
sys.path.insert(0, PYROOT)

from gpumem import _cli, _safefs  # noqa: E402

NOBODY = 65534
ROOT = os.geteuid() == 0

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

SCRIPT = """\
import argparse, torch
p = argparse.ArgumentParser(); p.add_argument("--batch-size", type=int); a = p.parse_args()
m = torch.nn.Linear(64, 64).cuda(); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(a.batch_size, 64, device="cuda"); m(x).sum().backward(); opt.step(); opt.zero_grad()
"""


def as_attacker(fn):
    """Runs fn() as uid 65534 in a forked child; raises when it fails
    (test_safefs's, beside this file)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from test_safefs import _as_attacker

    _as_attacker(fn)


@unittest.skipUnless(ROOT, "needs root to act as a second user (uid 65534)")
class PlantedByAnotherUser(unittest.TestCase):
    def setUp(self):
        self.base = tempfile.mkdtemp(prefix="gpumem-files-test-")
        os.chmod(self.base, 0o755)  # (the attacker must reach the folders below)
        # the victim's own files, which no link may lead a write to
        self.victim = os.path.join(self.base, "victim")
        os.mkdir(self.victim, 0o700)
        self.secret = os.path.join(self.victim, "secret")
        with open(self.secret, "w") as f:
            f.write("the victim's own data\n")
        os.chmod(self.secret, 0o600)
        self.victim_dir = os.path.join(self.victim, "dir")
        os.mkdir(self.victim_dir, 0o700)
        os.chmod(self.victim, 0o711)  # others may pass through (a link target), not list
        # where every user may make names, as in /tmp: root's, sticky
        self.pub = os.path.join(self.base, "pub")
        os.mkdir(self.pub)
        os.chmod(self.pub, 0o1777)

    def tearDown(self):
        shutil.rmtree(self.base, ignore_errors=True)

    def assertVictimUnchanged(self):
        with open(self.secret) as f:
            self.assertEqual(f.read(), "the victim's own data\n")
        self.assertEqual(stat.S_IMODE(os.stat(self.secret).st_mode), 0o600)
        self.assertEqual(os.listdir(self.victim_dir), [])

    def traces_dir(self):
        """A --traces folder of the victim's that was once writable by all
        (the attacker planted what they liked in it then): the victim's,
        0700 again by the time the command runs."""
        d = os.path.join(self.base, "traces")
        os.mkdir(d)
        os.chmod(d, 0o777)
        return d

    def lock(self, *dirs):
        for d in dirs:
            os.chmod(d, 0o700)

    # -- the helper itself ---------------------------------------------
    def test_link_to_a_file_is_not_written_through(self):
        d = self.traces_dir()
        target = os.path.join(d, "trace")
        as_attacker(lambda: os.symlink(self.secret, target))
        self.lock(d)
        with self.assertRaises(_safefs.UnsafePathError) as e:
            _safefs.write_file(target, "a recording")
        self.assertIn(target, str(e.exception))
        self.assertIn("symbolic link", str(e.exception))
        self.assertVictimUnchanged()

    def test_link_to_a_directory_is_not_a_run_folder(self):
        d = self.traces_dir()
        b1 = os.path.join(d, "b1")
        as_attacker(lambda: os.symlink(self.victim_dir, b1))
        self.lock(d)
        with self.assertRaises(_safefs.UnsafePathError) as e:
            _safefs.private_dir(b1)
        self.assertIn(b1, str(e.exception))
        self.assertIn("uid %d" % NOBODY, str(e.exception))
        self.assertVictimUnchanged()

    def test_planted_regular_file_receives_nothing(self):
        d = self.traces_dir()
        target = os.path.join(d, "trace")

        def plant():
            with open(target, "w") as f:
                f.write("mine\n")
            os.chmod(target, 0o666)

        as_attacker(plant)
        self.lock(d)
        with self.assertRaises(_safefs.UnsafePathError) as e:
            _safefs.write_file(target, "the victim's recording")
        self.assertIn(target, str(e.exception))
        self.assertIn("uid %d" % NOBODY, str(e.exception))
        with open(target) as f:
            self.assertEqual(f.read(), "mine\n")
        self.assertEqual(os.stat(target).st_uid, NOBODY)

    def test_planted_file_is_not_read_back(self):
        d = self.traces_dir()
        meta = os.path.join(d, "meta.json")

        def plant():
            with open(meta, "w") as f:
                json.dump({"file": self.secret, "steps": 3}, f)

        as_attacker(plant)
        self.lock(d)
        with self.assertRaises(_safefs.UnsafePathError) as e:
            _safefs.read_own(meta)
        self.assertIn(meta, str(e.exception))
        with self.assertRaises(_safefs.UnsafePathError):
            _safefs.write_file(meta, "{}")
        with open(meta) as f:
            self.assertIn(self.secret, f.read())  # theirs, untouched

    def test_another_users_sticky_directory_is_refused(self):
        sticky = os.path.join(self.pub, "sticky")
        as_attacker(lambda: (os.mkdir(sticky), os.chmod(sticky, 0o1777)))
        target = os.path.join(sticky, "r.trace")
        with self.assertRaises(_safefs.UnsafePathError) as e:
            _safefs.write_file(target, "data")
        self.assertIn(target, str(e.exception))
        self.assertIn("uid %d" % NOBODY, str(e.exception))
        self.assertFalse(os.path.exists(target))
        # the temporary directory itself (root's, sticky) stays usable
        own = os.path.join(tempfile.gettempdir(), "gpumem-files-test-%d" % os.getpid())
        try:
            _safefs.write_file(own, "data")
            self.assertEqual(stat.S_IMODE(os.stat(own).st_mode), 0o600)
        finally:
            os.unlink(own)

    def test_files_are_replaced_never_truncated(self):
        d = os.path.join(self.base, "own")
        os.mkdir(d, 0o700)
        path = os.path.join(d, "trace")
        _safefs.write_file(path, "first")
        inode = os.stat(path).st_ino
        keep = os.open(path, os.O_RDONLY)  # what a reader holds open keeps its bytes
        try:
            _safefs.write_file(path, "second")
            self.assertEqual(os.pread(keep, 100, 0), b"first")
        finally:
            os.close(keep)
        self.assertNotEqual(os.stat(path).st_ino, inode)
        self.assertEqual(_safefs.read_own(path), b"second")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual([n for n in os.listdir(d) if n != "trace"], [])

    # -- the command -----------------------------------------------------
    def predict(self, traces):
        if not HAVE_TORCH:
            self.skipTest("needs PyTorch (pip install torch; the CPU build will do)")
        if _cli.find() is None:
            self.skipTest("needs the gpumem command line program (make build)")
        script = os.path.join(self.base, "train.py")
        if not os.path.exists(script):
            with open(script, "w") as f:
                f.write(SCRIPT)
        env = dict(os.environ, PYTHONPATH=PYROOT)
        return subprocess.run([sys.executable, "-m", "gpumem.predict", "--memory", "1G", "--cpu", "--no-confirm",
                               "--traces", traces, script, "--batch-size", "{B}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip

    def test_command_refuses_another_users_traces_directory(self):
        mtr = os.path.join(self.pub, "mtr")

        def plant():
            os.mkdir(mtr)
            os.chmod(mtr, 0o777)
            for b, name in (("b1", "trace"), ("b2", "meta.json")):
                os.mkdir(os.path.join(mtr, b))
                os.chmod(os.path.join(mtr, b), 0o777)
                os.symlink(self.secret, os.path.join(mtr, b, name))

        as_attacker(plant)
        done = self.predict(mtr)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertIn(mtr, done.stderr)
        self.assertIn("uid %d" % NOBODY, done.stderr)
        self.assertVictimUnchanged()

    def test_command_refuses_planted_run_folders_and_files(self):
        d = self.traces_dir()
        b1, b2 = os.path.join(d, "b1"), os.path.join(d, "b2")
        as_attacker(lambda: os.symlink(self.victim_dir, b1))
        self.lock(d)
        done = self.predict(d)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertIn(b1, done.stderr)
        self.assertVictimUnchanged()

        # a folder of the victim's, once open to all, with a link where the recording goes
        os.unlink(b1)
        os.mkdir(b1)
        os.chmod(d, 0o777)
        os.chmod(b1, 0o777)
        as_attacker(lambda: os.symlink(self.secret, os.path.join(b1, "trace")))
        self.lock(d, b1)
        done = self.predict(d)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertIn(os.path.join(b1, "trace"), done.stderr)
        self.assertIn("symbolic link", done.stderr)
        self.assertVictimUnchanged()

        # the same folder cleaned: the run goes through, every file 0600 and the victim's
        os.unlink(os.path.join(b1, "trace"))
        os.makedirs(b2, 0o700, exist_ok=True)  # (the refused run may have made it already)
        done = self.predict(d)
        self.assertEqual(done.returncode, 0, done.stderr)
        for b in (b1, b2):
            for name in ("trace", "meta.json"):
                st = os.lstat(os.path.join(b, name))
                self.assertTrue(stat.S_ISREG(st.st_mode))
                self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (0, 0o600))
        self.assertVictimUnchanged()


if __name__ == "__main__":
    unittest.main()
