"""Values the CPU recorder knows without computing: fake CUDA tensors every
element of which holds one known value.

Fake tensors have no values, so a job that reads one (bool(mask.all()),
.item()) gets a placeholder, and what depends on it may take a path the
real job does not. Many such reads are of tensors made from constants: an
attention mask of ones that generate() extends with new_ones at every token,
then tests with .all() to skip the mask (and with it, on a GPU, to take
the grouped-query attention kernel rather than copying keys and values per
head). KnownValues follows such tensors through the operators that keep a
tensor constant (factories, copies, casts, concatenation, padding with the
same value, reductions, comparisons, elementwise arithmetic with
constants), per storage: a view of a constant storage is constant, and any
operator that writes into a storage forgets it (unless it fills it whole
with a known value). What it cannot follow stays unknown and is read as a
placeholder with a note, as before."""

__all__ = ["KnownValues", "UNKNOWN"]

UNKNOWN = object()

# factories of a constant -> its value
_CONSTANT = {"ones": 1, "ones_like": 1, "new_ones": 1, "zeros": 0, "zeros_like": 0, "new_zeros": 0}
# factories of a given value -> the index of the argument that gives it
_FILLED = {"full": 1, "full_like": 1, "new_full": 2, "scalar_tensor": 0}
# new storages holding their first argument's value (copies, casts, repeats)
_SAME = {"clone", "_to_copy", "contiguous", "repeat", "expand_copy", "lift_fresh_copy", "index_select",
         "_unsafe_view", "view_copy", "repeat_interleave", "index", "gather", "take"}  # fmt: skip
_COMPARE = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "logical_and": lambda a, b: bool(a) and bool(b), "logical_or": lambda a, b: bool(a) or bool(b),
    "mul": lambda a, b: a * b, "add": lambda a, b: a + b, "sub": lambda a, b: a - b,
    "maximum": max, "minimum": min,
}  # fmt: skip


class KnownValues:
    def __init__(self, torch):
        self.torch = torch
        self.known = {}  # storage key -> value

    @staticmethod
    def _key(t):
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    def of(self, x):
        """The value of every element of x, or UNKNOWN."""
        torch = self.torch
        if isinstance(x, (bool, int, float)):
            return x
        if not isinstance(x, torch.Tensor):
            return UNKNOWN
        if x.device.type == "cpu" and not _is_fake(x) and x.numel() == 1:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                return x.item()
        if x.numel() == 0:
            return UNKNOWN
        return self.known.get(self._key(x), UNKNOWN)

    def forget(self, key):
        self.known.pop(key, None)

    def written(self, tensors):
        """Before an operator writes into these tensors' storages."""
        for t in tensors:
            if isinstance(t, self.torch.Tensor):
                self.forget(self._key(t))

    def after(self, func, args, kwargs, out, new_keys):
        """Records what the operator's new storages hold, where known."""
        torch = self.torch
        name = func.overloadpacket.__name__
        if name == "fill_" and isinstance(out, torch.Tensor):
            v = self.of(args[1]) if len(args) > 1 else UNKNOWN
            if v is not UNKNOWN and out.numel() * out.element_size() == out.untyped_storage().nbytes():
                self.known[self._key(out)] = _as(torch, v, out.dtype)
            return
        if not new_keys or not isinstance(out, torch.Tensor):
            return
        key = self._key(out)
        if key not in new_keys:
            return
        v = self._value(name, args, kwargs, out)
        if v is not UNKNOWN:
            self.known[key] = _as(torch, v, out.dtype)

    def _value(self, name, args, kwargs, out):
        if name in _CONSTANT:
            return _CONSTANT[name]
        if name in _FILLED:
            i = _FILLED[name]
            return self.of(args[i]) if len(args) > i else kwargs.get("fill_value", UNKNOWN)
        if not args:
            return UNKNOWN
        if name in _SAME:
            return self.of(args[0])
        if name == "cat":
            vals = [self.of(t) for t in args[0] if t.numel() > 0]
            return vals[0] if vals and all(v is not UNKNOWN and v == vals[0] for v in vals) else UNKNOWN
        if name == "constant_pad_nd":
            v = self.of(args[0])
            pad = args[2] if len(args) > 2 else kwargs.get("value", 0)
            return v if v is not UNKNOWN and v == pad else UNKNOWN
        v = self.of(args[0])
        if v is UNKNOWN:
            return UNKNOWN
        if name in ("all", "any"):
            return bool(v)
        if name in ("amax", "amin", "max", "min", "abs", "neg", "logical_not", "bitwise_not") and len(args) == 1:
            return {"abs": abs, "neg": lambda x: -x, "logical_not": lambda x: not x,
                    "bitwise_not": lambda x: (not x) if isinstance(x, bool) else ~int(x)}.get(name, lambda x: x)(v)  # fmt: skip
        if name == "sum":
            return v * (args[0].numel() // max(1, out.numel()))
        op = _COMPARE.get(name)
        if op is not None and len(args) > 1:
            w = self.of(args[1])
            if w is UNKNOWN:
                return UNKNOWN
            if name in ("add", "sub"):
                w = w * kwargs.get("alpha", 1)
            return op(v, w)
        return UNKNOWN


def _is_fake(t):
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _as(torch, v, dtype):
    if dtype == torch.bool:
        return bool(v)
    if dtype.is_floating_point or dtype.is_complex:
        return float(v)
    return int(v)
