"""Answers at the batch itself, from the CPU recorder.

Scaling recordings of small batches sees every allocation the job makes at
those batches, and none that appears only at a larger one: the staging
buffers of reductions whose rows grew long enough to be split across
thread blocks, algorithms chosen by problem size. On fake tensors a
recording costs the same at batch 2 as at batch 200, so the CPU recorder
can record the job at the batch asked about and replay that instead. This
module does the replay (`gpumem fit`) and the search for the largest batch
that fits, started from the scaled prediction:

    checker = Checker(record_at, memory)      # record_at(b) -> a trace path
    checker.peaks(64)                         # {allocator: peak reserved bytes}
    largest(lambda b: checker.fits(b, "pytorch"), start=190, precision=0.02)
"""

import json
import subprocess

__all__ = ["Checker", "SearchBudget", "largest", "fit_rows"]


class BatchDoesNotGrow(RuntimeError):
    """A recording at a larger batch holds no more memory than one at a smaller."""


def _peak_live(rows):
    return next((r.get("peak_live_bytes") for r in rows.values() if r.get("peak_live_bytes") is not None), None)


class SearchBudget(Exception):
    """The search ran out of recordings; lo fits, hi does not (or is None)."""

    def __init__(self, lo, hi):
        Exception.__init__(self, "no recordings left: %s fits, %s does not" % (lo, hi))
        self.lo, self.hi = lo, hi


def fit_rows(binary, trace, memory):
    """`gpumem fit --memory NB --json TRACE`: {allocator: its row} (fits,
    peak_reserved_bytes, needed_bytes, ...)."""
    done = subprocess.run([binary, "fit", "--memory", "%dB" % memory, "--json", trace],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError("`gpumem fit` failed (exit status %d): %s"
                           % (done.returncode, done.stderr.decode("utf-8", "replace").strip()))  # fmt: skip
    rows = {}
    for line in done.stdout.decode("utf-8", "replace").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["allocator"]] = row
    return rows


class Checker:
    """Recordings at the batches asked about, each made once and replayed
    under every allocator with `gpumem fit` at memory bytes; at most
    `budget` of them."""

    def __init__(self, record_at, memory, binary, budget=12, record_many=None, workers=1):
        self.record_at = record_at
        self.record_many = record_many  # [batches] -> {batch: trace}, made at once
        self.workers = workers  # how many record_many makes at once
        self.memory = memory
        self.binary = binary
        self.budget = budget
        self.rows = {}
        # The fewest items of a DataLoader whose dataset was shorter than the batch (set from the
        # recordings' meta by whoever records), and the batch the script's memory stops growing
        # at because of it: no batch the script runs is larger, so none above it is searched.
        self.items_limit = None
        self.capped_at = None
        self.no_batch_past = False  # (dataset(): past the dataset's length the script gets no batch at all)

    def prefetch(self, batches):
        """Records the batches not recorded yet together (record_many), as
        many as the budget leaves, in the order given."""
        todo = []
        for b in batches:
            if self.capped_at is not None and b > self.capped_at:
                continue  # (no such batch: fits() says so without a recording)
            if b >= 1 and b not in self.rows and b not in todo:
                todo.append(b)
        todo = todo[: max(0, self.budget - len(self.rows))]
        if not todo:
            return
        paths = self.record_many(todo) if self.record_many else {b: self.record_at(b) for b in todo}
        for b in todo:
            if paths[b] is None:
                continue  # (past the dataset's length with drop_last: no batch, and dataset() was told)
            rows = fit_rows(self.binary, paths[b], self.memory)
            self.rows[b] = rows
            self._grows(b, rows)

    def dataset(self, items, no_batch_past=False):
        """A recording's DataLoader has a dataset of items, fewer than its
        batch: the batches past it are that long (items_limit), or, where
        no_batch_past (drop_last=True), there are none, and no larger batch
        runs at all (capped_at)."""
        self.items_limit = min(items, self.items_limit or items)
        if no_batch_past:
            self.capped_at = min(items, self.capped_at or items)
            self.no_batch_past = True

    def at(self, batch):
        """{allocator: fit row} at batch; {} where the script gives no batch
        there (dataset())."""
        if batch not in self.rows:
            if len(self.rows) >= self.budget:
                raise SearchBudget(None, None)
            path = self.record_at(batch)
            if path is None:
                return {}
            rows = fit_rows(self.binary, path, self.memory)
            self.rows[batch] = rows
            self._grows(batch, rows)
        return self.rows[batch]

    def _grows(self, batch, rows):
        """A job whose memory does not grow with the batch is not the one
        the search assumes (a dataset smaller than the batch, a batch the
        script caps): every larger batch would fit, and the search would
        double until its budget ran out."""
        live = _peak_live(rows)
        if live is None:
            return
        for b in sorted(self.rows):
            other = _peak_live(self.rows[b])
            if other is None or b == batch:
                continue
            (lo, lo_live), (hi, hi_live) = sorted([(b, other), (batch, live)])
            if hi_live <= lo_live:
                if self.items_limit is not None and lo >= self.items_limit:
                    # (a batch past the dataset's length is that length: an answer, not a failure)
                    self.capped_at = self.items_limit
                    continue
                raise BatchDoesNotGrow(
                    "the recording at batch %d holds no more than the one at batch %d (peak live %.3f GiB "
                    "against %.3f GiB): the script's batch stops growing with the batch size asked for "
                    "(a dataset smaller than the batch?)" % (hi, lo, hi_live / 2**30, lo_live / 2**30))

    def peaks(self, batch):
        return {a: r["peak_reserved_bytes"] for a, r in self.at(batch).items()}

    def known(self, allocator):
        """{batch: fits} for allocator over the batches recorded so far (a
        batch past the dataset's length, where it caps the batch, does not)."""
        return {b: bool(rows[allocator]["fits"]) and (self.capped_at is None or b <= self.capped_at)
                for b, rows in self.rows.items() if allocator in rows}  # fmt: skip

    def bracket(self, allocator):
        """(largest batch found to fit, smallest found not to), None where
        none is known, for allocator over the recordings so far; past the
        dataset's length, where it caps the batch, nothing fits."""
        lo, hi = _bracket(self.known(allocator))
        if self.capped_at is not None and (hi is None or hi > self.capped_at + 1):
            hi = self.capped_at + 1
        return lo, hi

    def settled(self, allocator, precision=0.02):
        """Whether the recordings so far close allocator's search as
        largest() closes it (within precision of the last batch that fits)."""
        lo, hi = self.bracket(allocator)
        return lo is not None and hi is not None and lo < hi and hi - lo <= max(1, int(lo * precision))

    def secant(self, allocator, precision=0.02):
        """Where the recordings so far do not settle allocator's largest
        batch, the batch at which a line through two of them reaches the
        memory (each recording's `needed_bytes`: the smallest limit it
        replays under): the largest and the largest at least 10% below it,
        whose slope is the nearest to the answer's that is not rounding's
        (memory that grows faster than the batch is met closer). None
        where they settle it or no two are that far apart."""
        if self.settled(allocator, precision):
            return None
        points = sorted((b, rows[allocator].get("needed_bytes")) for b, rows in self.rows.items() if allocator in rows)
        points = [(b, n) for b, n in points if n]
        if len(points) < 2:
            return None
        b2, n2 = points[-1]
        b1, n1 = next(((b, n) for b, n in reversed(points) if b <= 0.9 * b2), (None, None))
        if b1 is None or n2 <= n1:
            return None  # (two batches close together give rounding's slope, not the job's)
        return max(1, b1 + (self.memory - n1) * (b2 - b1) // (n2 - n1))

    def split(self, allocator, k):
        """Up to k batches that shrink allocator's open search the most when
        recorded at once: k points inside its bracket, or, where nothing
        recorded does not fit (or nothing fits), steps that double away
        from the last batch that fits (or the first that does not)."""
        lo, hi = self.bracket(allocator)
        if lo is not None and hi is not None and lo < hi:
            points = [lo + (hi - lo) * i // (k + 1) for i in range(1, k + 1)]
        elif lo is not None and hi is None:
            step = max(1, lo // 8)
            points = [lo + step * ((1 << i) - 1) for i in range(1, k + 1)]
        elif hi is not None and lo is None:
            step = max(1, hi // 8)
            points = [hi - step * ((1 << i) - 1) for i in range(1, k + 1)]
        else:
            return []
        seen = []
        for b in points:
            if b >= 1 and b not in self.rows and b not in seen and (lo is None or b > lo) and (hi is None or b < hi):
                seen.append(b)
        return seen

    def left(self):
        return max(0, self.budget - len(self.rows))

    def fits(self, batch, allocator):
        if self.capped_at is not None and batch > self.capped_at:
            return False  # (no such batch: the script's batches stop at its dataset's length)
        row = self.at(batch).get(allocator)
        if self.capped_at is not None and batch > self.capped_at:
            return False  # (found just now: the script gives no batch this large)
        if row is None:
            raise KeyError("gpumem fit gave no row for %s" % allocator)
        return bool(row["fits"])


def _bracket(known):
    """{batch: fits} -> (largest batch that fits, smallest that does not), None where none."""
    return (max((b for b, f in known.items() if f), default=None),
            min((b for b, f in known.items() if not f), default=None))  # fmt: skip


def largest(fits, start, precision=0.02, known=None):
    """The largest batch b for which fits(b) holds, taking memory to grow
    with the batch: from start (a prediction) up or down in steps that
    double until the answer is bracketed, then halving the bracket until
    it is within precision of its lower end (exact below 50 at 2%).
    known: {batch: fits} already found (other allocators' searches
    recorded those batches); where they bracket the answer the search
    starts from that bracket. Returns (b, first batch found not to fit,
    or None); b is 0 when batch 1 does not fit. fits may raise
    SearchBudget, which is raised again with the bracket found so far."""
    start = max(1, int(start))
    lo, hi = _bracket(known or {})
    if lo is None or hi is None or lo >= hi:
        lo = hi = None
    try:
        if lo is not None:
            pass  # bracketed already
        elif fits(start):
            lo, step = start, max(1, start // 8)
            while hi is None:
                b = lo + step
                if fits(b):
                    lo, step = b, step * 2
                else:
                    hi = b
        else:
            hi, step = start, max(1, start // 8)
            while lo is None:
                b = max(1, hi - step)
                if fits(b):
                    lo = b
                elif b == 1:
                    return 0, 1
                else:
                    hi, step = b, step * 2
        while hi - lo > max(1, int(lo * precision)):
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    except SearchBudget:
        raise SearchBudget(lo, hi) from None
    return lo, hi
