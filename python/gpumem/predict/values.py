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

__all__ = ["KnownValues", "UNKNOWN", "SHADOW_NUMEL", "leaves"]

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
_UNARY = {"amax", "amin", "max", "min", "abs", "neg", "logical_not", "bitwise_not"}
# operators whose value _value derives from their first input's (beyond the factories, copies and
# concatenations it takes first)
_OF_FIRST = {"all", "any", "sum"} | _UNARY | set(_COMPARE)


class KnownValues:
    def __init__(self, torch):
        self.torch = torch
        self.known = {}  # storage key -> value
        # id(fake tensor) -> its entry (_keep); tensors compare element by element, so they cannot be keys
        # themselves
        self.shadows = {}
        self._followable_ops = {}  # operator -> whether _follow may compute its results

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
        entry = self._entry(x)
        if entry is not None:
            if entry[3] is None:
                # (a shadow is never written: whether it holds one value is
                # asked once, though most operators ask it of their input)
                from torch.utils._python_dispatch import _disable_current_modes

                shadow = entry[1]
                with _disable_current_modes():
                    first = shadow.reshape(-1)[0]
                    uniform = shadow.numel() == 1 or bool((shadow == first).all())
                    entry[3] = (first.item(),) if uniform else ()
            if entry[3]:
                return entry[3][0]
        return self.known.get(self._key(x), UNKNOWN)

    def _entry(self, x):
        """x's entry in shadows while it holds, else None."""
        entry = self.shadows.get(id(x)) if _is_fake(x) else None
        if entry is None or entry[0]() is not x or entry[2] != x._version:
            return None
        return entry

    def shadow(self, x):
        """x's values as a CPU tensor, or None where they are not known."""
        entry = self._entry(x)
        return None if entry is None else entry[1]

    def _keep(self, fake, value):
        if fake.is_inference():
            # (made under torch.inference_mode: no version counter to tell
            # a later write by, so its values are not followed)
            return
        key = id(fake)
        shadows = self.shadows

        def gone(ref):
            if key in shadows and shadows[key][0] is ref:
                del shadows[key]

        # [its weak reference, its values, its version, (its one value,) or () once asked (of)]
        shadows[key] = [weakref.ref(fake, gone), value, fake._version, None]

    def _followable(self, func):
        """Whether func's results can be values of its inputs: not for
        uninitialized or random results, nor for writes (the version
        counter moves after the write: nothing to keep). Asked at every
        operator, answered once per operator."""
        ok = self._followable_ops.get(func)
        if ok is None:
            ok = not (
                func.overloadpacket.__name__ in _UNINITIALIZED
                or self.torch.Tag.nondeterministic_seeded in func.tags
                or any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
            )
            self._followable_ops[func] = ok
        return ok

    def _follow(self, func, args, kwargs, out, flat_args=None):
        """Gives out a shadow where func made it from known values alone
        (flat_args: leaves((args, kwargs)), where the caller has them)."""
        torch = self.torch
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_map

        if not self._followable(func):
            return
        outs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or any(not _is_fake(t) or t.numel() > SHADOW_NUMEL for t in outs):
            return
        # Most operators have an input with no known values: found before
        # pytree copies the arguments
        for a in leaves((args, kwargs)) if flat_args is None else flat_args:
            if isinstance(a, torch.Tensor):
                if not _is_fake(a):
                    if a.device.type != "cpu":
                        return
                elif self.shadow(a) is None:
                    return

        def real(a):
            if isinstance(a, torch.Tensor):
                return a if not _is_fake(a) else self.shadow(a)
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        cpu_args, cpu_kwargs = tree_map(real, (args, kwargs))
        if "device" in cpu_kwargs:
            cpu_kwargs["device"] = torch.device("cpu")
        try:
            with _disable_current_modes():
                result = func(*cpu_args, **cpu_kwargs)
        except Exception:  # noqa: BLE001 (what the CPU cannot compute stays unknown)
            return
        results = [t for t in leaves(result) if isinstance(t, torch.Tensor)]
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

    def after(self, func, args, kwargs, out, new_keys, flat_args=None):
        """Records what the operator's new storages hold, where known
        (flat_args: leaves((args, kwargs)), where the caller has them)."""
        torch = self.torch
        self._follow(func, args, kwargs, out, flat_args)
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
        if name not in _OF_FIRST:
            return UNKNOWN  # (before asking: what the first input holds costs a pass over its shadow)
        v = self.of(args[0])
        if v is UNKNOWN:
            return UNKNOWN
        if name in ("all", "any"):
            return bool(v)
        if name in _UNARY and len(args) == 1:
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


_fake_class = []  # FakeTensor, imported on first use (importing it costs a lookup per call)


def _is_fake(t):
    if not _fake_class:
        from torch._subclasses.fake_tensor import FakeTensor

        _fake_class.append(FakeTensor)
    return isinstance(t, _fake_class[0])


# Types pytree takes for leaves that an operator's arguments hold most
# (tensors are checked apart: any subclass is a leaf unless registered)
_LEAF_TYPES = {int, float, bool, str, type(None)}
_pytree = []  # (torch.Tensor, pytree's registered node types, tree_flatten), imported on first use


def leaves(tree):
    """tree_flatten(tree)[0]: the leaves of an operator's arguments or
    results in pytree's order. Runs at every operator, where pytree's
    generic walk (node types, namedtuples, specs) costs more than the
    operator itself: plain tuples, lists and dicts are walked here, and
    any other container is handed to pytree."""
    if not _pytree:
        import torch
        from torch.utils import _pytree as pytree

        _pytree.extend((torch.Tensor, pytree.SUPPORTED_NODES, pytree.tree_flatten))
    out = []
    _gather(tree, out, *_pytree)
    return out


def _gather(x, out, tensor, nodes, flatten):
    t = type(x)
    if t is tuple or t is list:
        for a in x:
            _gather(a, out, tensor, nodes, flatten)
    elif t is dict:  # (pytree keeps a dict's insertion order)
        for a in x.values():
            _gather(a, out, tensor, nodes, flatten)
    elif t in _LEAF_TYPES or (isinstance(x, tensor) and t not in nodes):
        out.append(x)
    else:
        out.extend(flatten(x)[0])


def _as(torch, v, dtype):
    if dtype == torch.bool:
        return bool(v)
    if dtype.is_floating_point or dtype.is_complex:
        return float(v)
    return int(v)
