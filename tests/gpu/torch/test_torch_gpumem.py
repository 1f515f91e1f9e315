"""gpumem as PyTorch's (and CuPy's) allocator, on a real GPU.

Each test runs its workload in a fresh interpreter (_child.py): gpumem's
allocator must be installed before PyTorch initializes CUDA. Everything is
skipped, saying why, where torch, a GPU, CuPy or a second GPU is missing.

Run from the repository root (tests/gpu/torch/run.sh does this):
    GPUMEM_LIBRARY=build/libgpumem.so python3 -m unittest discover -s tests/gpu/torch -v

Loss equality. With deterministic algorithms on (cuDNN deterministic, no
TF32, CUBLAS_WORKSPACE_CONFIG=:4096:8, dropout off, eager attention) the
same kernels run on the same data whatever addresses the allocator hands
out: gpumem and PyTorch both return blocks aligned to at least 512 bytes, so
even alignment-dependent kernel choices (cuBLASLt looks at up to 256-byte
alignment) are the same. Losses are therefore expected to be bitwise equal.
The tolerance is measured, not guessed: native PyTorch is run twice; if its
two runs are bitwise equal, gpumem must be too; if not (an op with no
deterministic kernel), gpumem may differ from native by at most twice the
native run-to-run spread (plus 1e-6 relative).
"""

import functools
import json
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CHILD = os.path.join(HERE, "_child.py")
TIMEOUT = int(os.environ.get("GPUMEM_GPU_TEST_TIMEOUT", "900"))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; never download
    return env


@functools.lru_cache(maxsize=None)
def probe():
    """What this machine has, asked in a child so this process never
    initializes CUDA: {"torch": bool, "gpus": n, "cupy": bool, ...}."""
    code = (
        "import json, importlib.util as u\n"
        "r = {'torch': False, 'gpus': 0}\n"
        "try:\n"
        "    import torch\n"
        "    r['torch'] = True\n"
        "    r['gpus'] = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "    r['version'] = torch.__version__\n"
        "except Exception as e:\n"
        "    r['why'] = str(e)\n"
        "for m in ('cupy', 'transformers', 'torchvision'):\n"
        "    r[m] = u.find_spec(m) is not None\n"
        "r['cupy_gpus'] = 0\n"
        "if r['cupy']:\n"
        "    try:\n"
        "        import cupy\n"
        "        r['cupy_gpus'] = cupy.cuda.runtime.getDeviceCount()\n"
        "    except Exception as e:\n"
        "        r['cupy_why'] = str(e)\n"
        "print(json.dumps(r))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:
        return {"torch": False, "gpus": 0, "why": str(e)}


def need_cupy():
    p = probe()
    if not p.get("cupy"):
        raise unittest.SkipTest("CuPy is not installed")
    if p.get("cupy_gpus", 0) < 1:
        raise unittest.SkipTest("CuPy sees no CUDA GPU (%s)" % p.get("cupy_why", "device count 0"))


def need(gpus=1, modules=()):
    p = probe()
    if not p.get("torch"):
        raise unittest.SkipTest("PyTorch is not installed (%s)" % p.get("why", ""))
    if p.get("gpus", 0) < gpus:
        raise unittest.SkipTest(
            "needs %d CUDA GPU%s; torch.cuda.device_count() is %d" % (gpus, "s" if gpus > 1 else "", p.get("gpus", 0))
        )
    for m in modules:
        if not p.get(m):
            raise unittest.SkipTest("%s is not installed" % m)


def run_child(workload, *args, launcher=None):
    cmd = (launcher or [sys.executable]) + [CHILD, workload] + list(args)
    proc = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            "%s failed (exit %d)\n--- stdout\n%s\n--- stderr\n%s"
            % (" ".join(cmd), proc.returncode, proc.stdout[-4000:], proc.stderr[-6000:])
        )
    result = json.loads(lines[-1])
    if "error" in result:
        raise AssertionError("%s: %s" % (workload, result["error"]))
    return result


class LossEqualityTest(unittest.TestCase):
    def compare(self, workload):
        native_a = run_child(workload, "--allocator", "native")["losses"]
        native_b = run_child(workload, "--allocator", "native")["losses"]
        mine = run_child(workload, "--allocator", "gpumem")
        got = mine["losses"]
        self.assertEqual(len(got), len(native_a))
        if native_a == native_b:
            self.assertEqual(got, native_a, "native runs are bitwise equal; gpumem's must be too")
        else:
            for a, b, g in zip(native_a, native_b, got):
                tol = 2 * abs(a - b) + 1e-6 * abs(a)
                self.assertLessEqual(abs(g - a), tol, "native %r / %r, gpumem %r" % (native_a, native_b, got))
        print(
            "\n  %s losses: native %s, gpumem %s; peak reserved gpumem %.2f GiB"
            % (workload, native_a, got, mine["max_reserved"] / 2**30),
            file=sys.stderr,
        )

    def test_gpt2_small_losses_match_native(self):
        need(modules=("transformers",))
        self.compare("gpt2")

    def test_resnet50_losses_match_native(self):
        need(modules=("torchvision",))
        self.compare("resnet50")


class OutOfMemoryTest(unittest.TestCase):
    def check_recovery(self, r):
        self.assertIn("gpumem: out of memory", r["report"])
        self.assertIn("Limit: 2.00 GiB", r["report"])
        self.assertGreaterEqual(r["num_ooms"], 1)
        # Nothing of the failed step is left once its references are gone.
        self.assertLessEqual(r["after_cleanup"], r["baseline"] + (1 << 20), r)
        self.assertEqual(len(r["losses"]), 3)
        for loss in r["losses"]:
            self.assertTrue(loss == loss and abs(loss) < 1e30, r["losses"])

    def test_oom_raises_torch_oom_and_training_recovers(self):
        need()
        r = run_child("oom", "--conf", "limit:2G")
        self.assertTrue(r["is_torch_oom"], "got %s, not torch.OutOfMemoryError" % r["exc_type"])
        self.check_recovery(r)

    def test_oom_without_the_shim_raises_runtime_error(self):
        # The no-compiler fallback: c10::detail::torchCheckFail as the hook.
        need()
        r = run_child("oom", "--conf", "limit:2G", "--no-shim")
        self.assertTrue(r["is_runtime_error"], r["exc_type"])
        self.check_recovery(r)


class OutOfMemoryFormTest(unittest.TestCase):
    """The same failures under a per-process fraction, native PyTorch and
    gpumem side by side: what tools read off the error must agree."""

    def test_oom_reads_as_pytorchs(self):
        need()
        native = run_child("oom_form", "--allocator", "native")
        mine = run_child("oom_form", "--allocator", "gpumem")
        print("\n  native: %s\n  gpumem: %s" % (native["message"][:400], mine["message"][:600]), file=sys.stderr)
        self.assertEqual(mine["exc_type"], "OutOfMemoryError")
        self.assertIsNotNone(native["first_sentence"], native["message"])
        self.assertEqual(mine["first_sentence"], native["first_sentence"])
        self.assertEqual(mine["allowed"], native["allowed"])
        self.assertIn("gpumem: out of memory", mine["message"])
        # what Accelerate's and Lightning's finders look for
        self.assertIn("CUDA out of memory.", mine["message"])
        # the observer: once per failure, PyTorch's arguments
        self.assertEqual(mine["observer_calls"], 1)
        self.assertEqual(mine["observer_after_trials"], 100)
        self.assertEqual(native["observer_after_trials"], 100)
        self.assertEqual(mine["observer_first"][0], native["observer_first"][0])  # device
        self.assertEqual(mine["observer_first"][1], native["observer_first"][1])  # allocation size
        # allowed: the fraction of the device, as each rounds it
        self.assertLessEqual(abs(mine["observer_first"][2] - native["observer_first"][2]), 2 << 20)
        self.assertEqual(mine["ooms_before"], 1)
        self.assertEqual(mine["ooms_trials"], 100)
        # recovery: every trial fits as much as the first; nothing left
        self.assertEqual(mine["trial_fills"], [mine["filled"]], mine)
        self.assertGreaterEqual(mine["filled"], native["filled"])
        self.assertEqual(mine["after_trials"], mine["base_allocated"])
        self.assertLess(mine["reserved_after_empty"], 64 << 20, mine)
        # a failure inside a captured graph and inside a MemPool: as native,
        # observed and counted as native does
        self.assertEqual(mine["observer_graph_pool"], native["observer_graph_pool"], (native, mine))
        self.assertEqual(mine["ooms_graph_pool"], native["ooms_graph_pool"], (native, mine))
        self.assertEqual(mine["graph"]["raised"], native["graph"]["raised"], (native["graph"], mine["graph"]))
        self.assertTrue(mine["graph"]["alloc_after"])
        if native["graph"]["raised"] == "OutOfMemoryError":
            self.assertTrue(mine["graph"]["text_ok"])
        if native["pool"]:
            self.assertEqual(mine["pool"]["raised"], native["pool"]["raised"], (native["pool"], mine["pool"]))
            self.assertTrue(mine["pool"]["alloc_after"])


class MemoryFunctionsTest(unittest.TestCase):
    def test_torch_cuda_memory_functions_report_gpumem(self):
        need()
        r = run_child("memfuncs")
        failed = [name for name, ok in r["checks"].items() if not ok]
        self.assertEqual(failed, [], r)
        print("\n  gpumem.torch.status(): %s" % r["status"], file=sys.stderr)

    def test_overflow_tier_on_host_pages(self):
        need()
        r = run_child("overflow", "--conf", "overflow:host,limit:512M")
        failed = [name for name, ok in r["checks"].items() if not ok]
        self.assertEqual(failed, [], r)
        print("\n  overflow tier: %s" % r["stats"], file=sys.stderr)

    def test_history_and_snapshot_open_in_memory_viz(self):
        need()
        r = run_child("snapshot")
        failed = [name for name, ok in r["checks"].items() if not ok]
        self.assertEqual(failed, [], r)
        print("\n  snapshot: %d segments, %d events" % (r["segments"], r["events"]), file=sys.stderr)

    def test_leak_check_and_oom_post_mortem(self):
        need()
        import tempfile

        d = tempfile.mkdtemp()
        r = run_child("leaks", "--conf", "oom_snapshot:%s/oom-%%p.json" % d)
        failed = [name for name, ok in r["checks"].items() if not ok]
        self.assertEqual(failed, [], r)
        print("\n  leaks: %s" % "\n    ".join(r["report"]), file=sys.stderr)

    def test_shared_budget_across_processes(self):
        # one process holds 6 GiB of an 8 GiB budget; another is refused 4
        # GiB, naming the budget; the holder is killed (it never destroys
        # anything) and the next taker reaps its slot and gets the memory
        need()
        import tempfile

        env = _env()
        env["GPUMEM_PUBLISH_DIR"] = tempfile.mkdtemp()
        conf = ["--conf", "shared_limit:8G,shared_name:suite"]
        holder = subprocess.Popen(
            [sys.executable, CHILD, "budget_hold", "--gib", "6"] + conf,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = holder.stdout.readline()
            self.assertTrue(line.startswith("{"), line + holder.stderr.read() if not line else line)
            held = json.loads(line)["held"]
            self.assertGreaterEqual(held, 6 << 30)

            def take():
                proc = subprocess.run(
                    [sys.executable, CHILD, "budget_take", "--gib", "4"] + conf,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT,
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                self.assertTrue(lines, proc.stderr[-3000:])
                return json.loads(lines[-1])

            r = take()
            self.assertTrue(r["refused"], r)
            self.assertIn("the shared limit of 8.00 GiB (budget ", r["report"])
            self.assertIn("Advice: the shared limit (option shared_limit), not the device, refused", r["report"])
            holder.kill()
            holder.wait(timeout=60)
            r = take()
            self.assertFalse(r["refused"], r)
            self.assertEqual(r["size"], 4 << 30)
            print("\n  budget: refused while another process held %.1f GiB, served after it was killed" % (held / 2**30), file=sys.stderr)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(timeout=60)

    def test_enable_too_late_is_a_clear_error(self):
        need()
        r = run_child("too_late")
        self.assertTrue(r["raised"])
        self.assertIn("too late", r["message"])

    def test_bad_conf_raises_before_cuda(self):
        need()
        r = run_child("bad_conf")
        self.assertEqual(r["raised"], "ConfigError")
        self.assertIn("limt", r["message"])
        self.assertFalse(r["cuda_initialized"])


class CupyTest(unittest.TestCase):
    def run_cupy(self, *args):
        need_cupy()
        r = run_child("cupy", *args)
        failed = [name for name, ok in r["checks"].items() if not ok]
        self.assertEqual(failed, [], r)

    def test_cupy_arrays_stream_aware(self):
        self.run_cupy()

    def test_cupy_arrays_cfunction_allocator(self):
        self.run_cupy("--no-stream-aware")


class StreamsTest(unittest.TestCase):
    def test_two_streams_share_a_plan_with_native_results(self):
        need()
        native_a = run_child("two_streams", "--allocator", "native", "--steps", "40")["sums"]
        native_b = run_child("two_streams", "--allocator", "native", "--steps", "40")["sums"]
        # planned placement asked for: uncapped, the default places by best fit
        r = run_child(
            "two_streams", "--allocator", "gpumem", "--steps", "40", "--conf", "placement:planned"
        )
        print(
            "\n  two streams: %d plans (%d shared, %d declined), %d planned allocations, %d stream "
            "waits, %d event records, %d syncs; peak reserved %.2f GiB"
            % (
                r["plans"],
                r["plans_shared"],
                r["plans_declined"],
                r["planned_allocs"],
                r["stream_waits"],
                r["event_records"],
                r["syncs"],
                r["max_reserved"] / 2**30,
            ),
            file=sys.stderr,
        )
        self.assertGreaterEqual(r["plans_shared"], 1, r)
        self.assertGreater(r["stream_waits"], 0, r)
        self.assertEqual(native_a, native_b, "the workload is not deterministic natively")
        self.assertEqual(r["sums"], native_a, "a stream used memory another stream's work was still using")


class DataParallelTest(unittest.TestCase):
    def test_ddp_two_gpus_nccl(self):
        need(gpus=2)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        r = run_child("ddp", "--steps", "5", launcher=launcher)
        self.assertEqual(r["world"], 2)
        self.assertTrue(r["params_equal"], "replicas diverged")
        self.assertGreater(r["allocated"], 0)
        native = run_child("ddp", "--steps", "5", "--allocator", "native", launcher=launcher)
        self.assertEqual(r["losses"], native["losses"])


if __name__ == "__main__":
    unittest.main()
