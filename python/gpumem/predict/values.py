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
placeholder with a note, as before.

Small tensors are followed further, element by element: a fake tensor of
at most SHADOW_NUMEL elements made by a deterministic operator from real
CPU tensors, constants and other such tensors gets a shadow, the same
operator's result on real CPU copies. Token ids copied to the device,
position ids made with arange and what a model computes from them (a
check that a batch holds no packed sequences, which decides whether a
Llama's keys and values are copied per head) are then read as the job
reads them on the GPU. A shadow holds while its tensor's version counter
(shared by its views) has not moved: a write it was not computed for
makes it unknown."""

import weakref

__all__ = ["KnownValues", "UNKNOWN", "SHADOW_NUMEL"]

UNKNOWN = object()

# Fake tensors of at most this many elements get shadow values.
SHADOW_NUMEL = 1 << 20
# Operators whose results are not values of their inputs.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}

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
        # id(fake tensor) -> (a weak reference to it, its values on the CPU, its version); tensors compare
        # element by element, so they cannot be keys themselves
        self.shadows = {}

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
        shadow = self.shadow(x)
        if shadow is not None:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                first = shadow.reshape(-1)[0]
                if shadow.numel() == 1 or bool((shadow == first).all()):
                    return first.item()
        return self.known.get(self._key(x), UNKNOWN)

    def shadow(self, x):
        """x's values as a CPU tensor, or None where they are not known."""
        entry = self.shadows.get(id(x)) if _is_fake(x) else None
        if entry is None or entry[0]() is not x or entry[2] != x._version:
            return None
        return entry[1]

    def _keep(self, fake, value):
        key = id(fake)
        shadows = self.shadows

        def gone(ref):
            if key in shadows and shadows[key][0] is ref:
                del shadows[key]

        shadows[key] = (weakref.ref(fake, gone), value, fake._version)

    def _follow(self, func, args, kwargs, out):
        """Gives out a shadow where func made it from known values alone."""
        torch = self.torch
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_flatten, tree_map

        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or any(not _is_fake(t) or t.numel() > SHADOW_NUMEL for t in outs):
            return
        if func.overloadpacket.__name__ in _UNINITIALIZED or torch.Tag.nondeterministic_seeded in func.tags:
            return
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            return  # the version counter moves after the write: nothing to keep
        missing = []

        def real(a):
            if isinstance(a, torch.Tensor):
                if not _is_fake(a):
                    return a if a.device.type == "cpu" else missing.append(a)
                shadow = self.shadow(a)
                return shadow if shadow is not None else missing.append(a)
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        cpu_args, cpu_kwargs = tree_map(real, (args, kwargs))
        if missing:
            return
        if "device" in cpu_kwargs:
            cpu_kwargs["device"] = torch.device("cpu")
        try:
            with _disable_current_modes():
                result = func(*cpu_args, **cpu_kwargs)
        except Exception:  # noqa: BLE001 (what the CPU cannot compute stays unknown)
            return
        results = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if len(results) != len(outs):
            return
        for fake, value in zip(outs, results):
            if tuple(fake.shape) == tuple(value.shape) and fake.dtype == value.dtype:
                self._keep(fake, value)

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
        self._follow(func, args, kwargs, out)
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
