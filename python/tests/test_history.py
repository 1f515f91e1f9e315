"""History and snapshots from Python on the simulated device: the dict
memory_snapshot() returns has the shape of torch.cuda.memory._snapshot()'s,
with the invariants PyTorch's memory_viz relies on (blocks tile their
segment, sizes add up), and the events recorded in order with their tags.

Run from the repository root:
    GPUMEM_LIBRARY=build/libgpumem.so python3 -m unittest discover -s python/tests -v
"""

import os
import pickle
import random
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/, where the package lives

import gpumem  # noqa: E402

MIB = 1 << 20

SEGMENT_KEYS = {
    "device": int,
    "address": int,
    "total_size": int,
    "allocated_size": int,
    "active_size": int,
    "requested_size": int,
    "stream": int,
    "segment_type": str,
    "segment_pool_id": tuple,
    "is_expandable": bool,
    "frames": list,
    "blocks": list,
}
BLOCK_KEYS = {"address": int, "size": int, "requested_size": int, "state": str, "frames": list}
EVENT_KEYS = {"action": str, "addr": int, "size": int, "stream": int, "time_us": int, "frames": list}
STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {"alloc", "free_requested", "free_completed", "oom"}


def check_keys(case, obj, keys, what):
    for key, kind in keys.items():
        case.assertIn(key, obj, "%s lacks %r" % (what, key))
        case.assertIsInstance(obj[key], kind, "%s[%r]" % (what, key))


def check_frames(case, frames):
    for f in frames:
        case.assertEqual(set(f), {"filename", "line", "name"})


def check_snapshot(case, snap, stats=None):
    """The shape and the sums memory_viz's readers assume."""
    case.assertEqual(set(snap), {"segments", "device_traces", "gpumem"})
    for seg in snap["segments"]:
        check_keys(case, seg, SEGMENT_KEYS, "segment")
        case.assertIn(seg["segment_type"], ("small", "large"))
        case.assertEqual(len(seg["segment_pool_id"]), 2)
        at = seg["address"]
        allocated = active = requested = 0
        for b in seg["blocks"]:
            check_keys(case, b, BLOCK_KEYS, "block")
            check_frames(case, b["frames"])
            case.assertIn(b["state"], STATES)
            case.assertEqual(b["address"], at, "blocks must tile their segment")
            case.assertGreater(b["size"], 0)
            case.assertLessEqual(b["requested_size"], b["size"])
            at += b["size"]
            if b["state"] == "active_allocated":
                allocated += b["size"]
                requested += b["requested_size"]
            if b["state"] != "inactive":
                active += b["size"]
        case.assertEqual(at, seg["address"] + seg["total_size"])
        case.assertEqual(allocated, seg["allocated_size"])
        case.assertEqual(active, seg["active_size"])
        case.assertEqual(requested, seg["requested_size"])
    for trace in snap["device_traces"]:
        for e in trace:
            check_keys(case, e, EVENT_KEYS, "event")
            check_frames(case, e["frames"])
            case.assertIn(e["action"], ACTIONS)
            if e["action"] == "oom":
                case.assertIn("device_free", e)
    if stats is not None:
        total = sum(seg["total_size"] for seg in snap["segments"])
        (info,) = snap["gpumem"].values()
        case.assertEqual(total + info["spare_bytes"], stats["reserved_bytes.all.current"])
        case.assertEqual(
            sum(seg["allocated_size"] for seg in snap["segments"]),
            stats["allocated_bytes.all.current"],
        )


class SnapshotTest(unittest.TestCase):
    CONFS = (
        "policy:default",
        "policy:pytorch",
        "policy:default,reclaim:pressure,placement:bestfit",
        "policy:default,limit:512M",
    )

    def run_workload(self, a, rng, steps):
        """Random sizes on two streams, some used on a third, freed in
        random order; tags are the step numbers."""
        live = []
        for step in range(1, steps + 1):
            a.set_history_tag(step)
            if live and (rng.random() < 0.45 or len(live) > 40):
                a.free(live.pop(rng.randrange(len(live))))
                continue
            size = int(2 ** rng.uniform(9, 26))
            try:
                p = a.malloc(size, stream=rng.choice((0, 7)))
            except gpumem.OutOfMemoryError:
                continue
            if rng.random() < 0.1:
                a.record_stream(p, 9)
            live.append(p)
        return live

    def test_shape_sums_and_events(self):
        for conf in self.CONFS:
            with self.subTest(conf=conf):
                a = gpumem.Allocator("sim", conf=conf, capacity=1 << 30)
                try:
                    a.record_memory_history(100000)
                    live = self.run_workload(a, random.Random(5), 3000)
                    snap = a.memory_snapshot()
                    check_snapshot(self, snap, a.memory_stats())
                    events = snap["device_traces"][0]
                    stats = a.memory_stats()
                    allocs = sum(e["action"] == "alloc" for e in events)
                    self.assertEqual(allocs, stats["allocation.all.allocated"])
                    freed = sum(e["action"] == "free_requested" for e in events)
                    self.assertEqual(allocs - freed, len(live))
                    self.assertEqual(
                        sum(e["action"] == "oom" for e in events), stats["num_ooms"]
                    )
                    # every live block carries the step that allocated it
                    made = {}
                    for e in events:
                        if e["action"] == "alloc":
                            made[e["addr"]] = e["frames"][0]["line"]
                    for seg in snap["segments"]:
                        for b in seg["blocks"]:
                            if b["state"] == "active_allocated":
                                self.assertEqual(b["frames"][0]["line"], made[b["address"]])
                    # what memory_viz loads: a pickle of the dict
                    self.assertEqual(pickle.loads(pickle.dumps(snap)), snap)
                    for p in live:
                        a.free(p)
                    self.assertEqual(a.check(), 0, gpumem.last_error())
                finally:
                    a.close()

    def test_ring_keeps_the_last(self):
        with gpumem.Allocator("sim", capacity=1 << 30) as a:
            a.record_memory_history(5)
            ptrs = []
            for i in range(1, 8):
                a.set_history_tag(i)
                ptrs.append(a.malloc(i * MIB))
            events = a.memory_snapshot()["device_traces"][0]
            self.assertEqual([e["frames"][0]["line"] for e in events], [3, 4, 5, 6, 7])
            a.record_memory_history(0)
            self.assertEqual(a.memory_snapshot()["device_traces"][0], [])
            for p in ptrs:
                a.free(p)

    def test_module_functions(self):
        a = gpumem.Allocator("sim", capacity=1 << 30)
        gpumem.set_allocator(0, a)
        try:
            gpumem.record_memory_history(1000, device=0)
            p = a.malloc(3 * MIB)
            snap = gpumem.memory_snapshot()
            check_snapshot(self, snap)
            self.assertEqual(sorted(snap["gpumem"]), [0])
            self.assertEqual([e["action"] for e in snap["device_traces"][0]], ["alloc"])
            self.assertEqual(snap, gpumem.memory_snapshot(0))
            a.free(p)
            gpumem.record_memory_history(None, device=0)
        finally:
            gpumem.set_allocator(0, None)
            a.close()
        self.assertEqual(gpumem.memory_snapshot(5)["segments"], [])


class RecordTest(unittest.TestCase):
    def test_record_trace(self):
        import gzip
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "job-%p.trace.gz")
            with gpumem.Allocator("sim", conf="policy:pytorch", capacity=1 << 30) as a:
                a.record_trace(path)
                p = a.malloc(3 * MIB + 5)
                q = a.malloc(100)
                a.free(p)
                a.record_step()
                a.record_trace(None)
                a.free(q)  # after the end: not recorded
            with gzip.open(path.replace("%p", str(os.getpid())), "rt") as f:
                lines = [l for l in f.read().splitlines() if not l.startswith("# gpumem")]
            self.assertEqual(lines, ["a 1 3145733 0x0", "a 2 100 0x0", "f 1", "# step 1"])
            with gpumem.Allocator("sim", capacity=1 << 30) as a:
                with self.assertRaises(gpumem.GpumemError):
                    a.record_trace(os.path.join(d, "no", "such", "dir", "x.gz"))


if __name__ == "__main__":
    unittest.main()
