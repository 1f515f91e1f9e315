#!/usr/bin/env python3
"""Writes the snapshot pickles the tests read, in the shape of the dict that
torch.cuda.memory._snapshot() returns and _dump_snapshot() pickles (pickle.dump,
default protocol). No torch is needed: the dicts are built here by hand from a
small allocation sequence, and the same sequence is written as a trace
(small.trace) so a test can check that both replay alike.

    python3 tests/snapshots/make_fixtures.py tests/snapshots
"""
import os
import pickle
import sys

MiB = 1 << 20
BASE = 0x7F0000000000  # addresses above 2**32, as on a GPU: LONG1 integers
STREAM = 0
FRAMES = [{"filename": "train.py", "line": 12, "name": "step"}]


def sequence():
    """(op, id, size) of a two-step job: weights, then per-step activations."""
    ops = [("a", 1, 40 * MiB), ("a", 2, 3 * MiB + 5)]
    nid = 3
    for step in range(2):
        acts = []
        for k in range(6):
            size = (k + 1) * 7 * MiB + 512 * k + 3
            ops.append(("a", nid, size))
            acts.append(nid)
            nid += 1
        small = nid
        ops.append(("a", small, 4096 + step))
        nid += 1
        for a in reversed(acts):
            ops.append(("f", a, 0))
        ops.append(("f", small, 0))
    return ops


def history(ops, device=0):
    """device_traces events and the segments at the end, with segment
    events as PyTorch's allocator would log them (one segment per large
    allocation: enough for the reader, which only sums them)."""
    addr = {}
    size = {}
    nxt = BASE + device * (1 << 36)
    events = []
    reserved_seg = []
    for op, i, sz in ops:
        if op == "a":
            seg = (sz + 2 * MiB - 1) // (2 * MiB) * 2 * MiB
            events.append({"action": "segment_alloc", "addr": nxt, "size": seg, "stream": STREAM,
                           "time_us": len(events), "frames": FRAMES})
            reserved_seg.append((nxt, seg))
            addr[i] = nxt
            size[i] = sz
            nxt += seg
            events.append({"action": "alloc", "addr": addr[i], "size": sz, "stream": STREAM,
                           "time_us": len(events), "frames": FRAMES})
        else:
            events.append({"action": "free_requested", "addr": addr[i], "size": size[i],
                           "stream": STREAM, "time_us": len(events), "frames": FRAMES})
            events.append({"action": "free_completed", "addr": addr[i], "size": size[i],
                           "stream": STREAM, "time_us": len(events), "frames": FRAMES})
            del addr[i]
    segments = []
    live = {a: i for i, a in addr.items()}
    for a, seg in reserved_seg:
        blocks = []
        if a in live:
            i = live[a]
            blocks.append({"address": a, "size": seg, "requested_size": size[i],
                           "state": "active_allocated", "frames": FRAMES})
        else:
            blocks.append({"address": a, "size": seg, "requested_size": 0, "state": "inactive",
                           "frames": []})
        segments.append({"device": device, "address": a, "total_size": seg, "stream": STREAM,
                         "segment_type": "large", "segment_pool_id": (0, 0),
                         "allocated_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                         "active_size": 0, "requested_size": 0, "is_expandable": False,
                         "frames": [], "blocks": blocks})
    return events, segments


def main(out):
    ops = sequence()
    events, segments = history(ops)
    snap = {"segments": segments, "device_traces": [events], "allocator_settings": {}}
    with open(os.path.join(out, "small.pickle"), "wb") as f:
        pickle.dump(snap, f)
    with open(os.path.join(out, "small_proto2.pickle"), "wb") as f:
        pickle.dump(snap, f, protocol=2)
    with open(os.path.join(out, "small.trace"), "w") as f:
        f.write("# the allocation sequence of small.pickle\n")
        for op, i, sz in ops:
            f.write(f"a {i} {sz} 0\n" if op == "a" else f"f {i}\n")

    # two devices: the second busier, so it is the one replayed
    ev1, seg1 = history(ops + [("a", 99, 5 * MiB)], device=1)
    with open(os.path.join(out, "two_devices.pickle"), "wb") as f:
        pickle.dump({"segments": segments + seg1, "device_traces": [events, ev1]}, f)

    # recorded without history
    with open(os.path.join(out, "no_history.pickle"), "wb") as f:
        pickle.dump({"segments": segments, "device_traces": [[]]}, f)

    # a ring that wrapped: the first 10 events are gone (two allocations,
    # one later freed, the other the weights, live in the segments)
    with open(os.path.join(out, "truncated.pickle"), "wb") as f:
        pickle.dump({"segments": segments, "device_traces": [events[10:]]}, f)

    # not a snapshot dict; an object; not a pickle at all
    with open(os.path.join(out, "a_list.pickle"), "wb") as f:
        pickle.dump([1, 2, 3], f)
    import collections
    with open(os.path.join(out, "with_object.pickle"), "wb") as f:
        pickle.dump({"device_traces": [collections.OrderedDict(a=1)]}, f)
    with open(os.path.join(out, "not_a_pickle.pickle"), "w") as f:
        f.write("a 1 100 0\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
