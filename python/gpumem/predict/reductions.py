"""Scratch memory of PyTorch's CUDA reductions, worked out from the shapes
alone, for the CPU recorder.

A reduction (sum, mean) whose rows are long and whose outputs are few
splits each row across several thread blocks, and those blocks meet in a
staging buffer and a row of semaphores that the kernel takes from the
caching allocator and gives back when it returns. A bias gradient summed
over the tokens of a batch is the common case: none at a small batch, tens
of MiB at a large one, so a recording at small batches never shows it.

How big, and whether at all, follows from the launch configuration that
PyTorch's reduction kernel (ATen's Reduce.cuh) chooses from the iteration
shape, the element sizes and two properties of the GPU (its multiprocessor
count and threads per multiprocessor). This module repeats those choices
for a strided input: it orders and merges dimensions as TensorIterator
does for a reduction, then sizes the blocks and the grid. What it does not
model it says (None): complex types.

An input whose byte offsets pass 32-bit indexing is reduced in pieces, as
TensorIterator's with_32bit_indexing splits it: halved along the dimension
of the largest extent until each piece is indexable with 32 bits, each
piece launched on its own with its own staging buffer, taken and given
back before the next. Where the output cannot hold the partial sums of
the pieces (a half-precision output summed in float), one accumulation
buffer in the accumulator's type spans the pieces.
"""

__all__ = ["iteration_shape", "launch", "scratch_plan", "scratch_sizes", "scratch_of", "dense"]

WARP = 32
MAX_THREADS = 512  # per block; 256 for complex double, which is not modelled
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
INT32_MAX = (1 << 31) - 1


def _div_up(a, b):
    return -(-a // b)


def _last_pow2(n):
    """The largest power of two at most n (at least 1)."""
    return max(1, 1 << (int(n).bit_length() - 1)) if n > 0 else 1


def iteration_shape(sizes, in_strides, out_strides):
    """TensorIterator's view of a reduction: dimensions sorted fastest
    first with the reduced ones (output stride 0) in front, then adjacent
    ones merged where both operands step through them as one. Strides are
    in bytes. Returns (shape, in_strides, out_strides)."""
    n = len(sizes)
    if n == 0:
        return [], [], []
    perm = list(range(n - 1, -1, -1))
    operands = (out_strides, in_strides)

    def should_swap(d0, d1):
        for i, strides in enumerate(operands):
            s0, s1 = strides[d0], strides[d1]
            if i == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1  # reduced dimensions to the front
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if sizes[d0] > sizes[d1]:
                return 1
        return 0

    if n > 1:
        for i in range(1, n):
            d1 = i
            for d0 in range(i - 1, -1, -1):
                c = should_swap(perm[d0], perm[d1])
                if c > 0:
                    perm[d0], perm[d1] = perm[d1], perm[d0]
                    d1 = d0
                elif c < 0:
                    break
    shape = [sizes[p] for p in perm]
    strides = [[s[p] for p in perm] for s in operands]

    prev = 0
    for d in range(1, n):
        fits = shape[prev] == 1 or shape[d] == 1 or all(shape[prev] * s[prev] == s[d] for s in strides)
        if fits:
            if shape[prev] == 1:
                for s in strides:
                    s[prev] = s[d]
            shape[prev] *= shape[d]
        else:
            prev += 1
            if prev != d:
                for s in strides:
                    s[prev] = s[d]
                shape[prev] = shape[d]
    del shape[prev + 1 :]
    return shape, strides[1][: prev + 1], strides[0][: prev + 1]


def _output_vec_size(shape, in_strides, num_reduce_dims, in_size, in_offset):
    vec = 4
    for n in [in_offset, shape[num_reduce_dims]] + [
        s // in_size for j, s in enumerate(in_strides) if j != num_reduce_dims
    ]:
        while n % vec:
            vec //= 2
    return vec


def launch(shape, in_strides, out_strides, in_size, acc_size, vt0, input_vec_size, multiprocessors,
           threads_per_multiprocessor, in_offset=0):  # fmt: skip
    """The launch configuration Reduce.cuh's setReduceConfig picks for an
    iteration shape (iteration_shape's), as a dict: block (x, y), grid
    (x, y), whether blocks reduce through global memory, and the bytes of
    the staging buffer and semaphores they then take. in_size: the input's
    element size; acc_size: the accumulator's; vt0, input_vec_size: the
    kernel's template parameters; in_offset: the input's offset in
    elements from an aligned address."""
    ndim = len(shape)
    numel = 1
    for s in shape:
        numel *= s
    num_reduce_dims = sum(1 for s in out_strides if s == 0)
    num_outputs = 1
    for s, o in zip(shape, out_strides):
        if o != 0:
            num_outputs *= s
    inputs_per_output = numel // num_outputs
    output_vec_size = 1
    if ndim > 0:
        on_fastest = num_reduce_dims == ndim or in_strides[0] < in_strides[num_reduce_dims]
        if on_fastest:
            dim0, dim1 = inputs_per_output, num_outputs
            fastest_stride = in_strides[0]
        else:
            dim0, dim1 = num_outputs, inputs_per_output
            fastest_stride = in_strides[num_reduce_dims]
    else:
        on_fastest, fastest_stride, dim0, dim1 = True, in_size, 1, 1
    if fastest_stride == in_size:
        if on_fastest and dim0 > 128 and num_reduce_dims == 1 and vt0 >= input_vec_size:
            dim0 //= input_vec_size  # vectorised along the input
        elif not on_fastest:
            output_vec_size = _output_vec_size(shape, in_strides, num_reduce_dims, in_size, in_offset)
            dim0 //= output_vec_size

    max_threads = MAX_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    threads = width * height

    step_input = step_output = 1
    block_x_reduce = ndim == 0 or on_fastest
    if block_x_reduce:
        step_input *= width
    else:
        step_output *= width
    warp_split = min(height * MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD)
    split_across_warps = _div_up(inputs_per_output, step_input) >= warp_split
    if split_across_warps:
        step_input *= height
    else:
        step_output *= height

    target_grid = multiprocessors * (threads_per_multiprocessor // threads)
    grid_x = _div_up(num_outputs // output_vec_size, step_output)
    ctas = 1
    values_per_thread = _div_up(inputs_per_output, step_input)
    if split_across_warps and values_per_thread >= MAX_VALUES_PER_THREAD and grid_x <= target_grid:
        ctas = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, MIN_VALUES_PER_THREAD)),
                   _div_up(values_per_thread, MAX_VALUES_PER_THREAD))  # fmt: skip
    global_reduce = ctas > 1
    buffer = semaphores = 0
    if global_reduce:
        buffer = acc_size * num_outputs * ctas
        if not block_x_reduce:
            buffer *= width * output_vec_size
        semaphores = 4 * grid_x
    return {
        "block": (width, height),
        "grid": (grid_x, ctas),
        "output_vec_size": output_vec_size,
        "global_reduce": global_reduce,
        "buffer_bytes": buffer,
        "semaphore_bytes": semaphores,
    }


# Element sizes of the accumulator for a reduction whose output has the
# given element type: half-precision inputs and outputs sum in float.
def _accumulator_size(in_dtype_name, out_dtype_name, out_size):
    if in_dtype_name in ("float16", "bfloat16") or out_dtype_name in ("float16", "bfloat16"):
        return 4
    return out_size


# (vt0, input_vec_size) of each kernel: sum loads 16-bit inputs eight at a
# time with four accumulators per thread; the others four and four.
_VECTORS = {"sum": ((4, 8), (4, 4)), "mean": ((4, 4), (4, 4))}


def _indexable_32bit(shape, strides_by_operand):
    """TensorIterator's can_use_32bit_indexing: few enough elements, and
    every operand's last byte offset within a signed 32-bit integer."""
    numel = 1
    for n in shape:
        numel *= n
    if numel > INT32_MAX:
        return False
    return all(1 + sum((n - 1) * st for n, st in zip(shape, strides)) <= INT32_MAX for strides in strides_by_operand)


def _dim_to_split(shape, strides_by_operand):
    """The dimension TensorIterator splits first: the largest extent in
    bytes over all operands, the slowest dimension winning a tie."""
    best, dim = -1, -1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] == 0:
            continue
        for strides in strides_by_operand:
            extent = (shape[d] - 1) * abs(strides[d])
            if extent > best:
                best, dim = extent, d
    return dim


def pieces_32bit(shape, in_strides, out_strides):
    """The pieces with_32bit_indexing reduces an iteration shape in, in the
    order it launches them: (shape, input offset in bytes) each. The first
    half of a split dimension (the smaller, when its size is odd) comes
    first, and is split again before the second half is looked at."""
    operands = (out_strides, in_strides)
    out = []
    stack = [(list(shape), 0)]
    while stack:
        sh, offset = stack.pop()
        if _indexable_32bit(sh, operands):
            out.append((sh, offset))
            continue
        d = _dim_to_split(sh, operands)
        first = sh[d] // 2
        low, high = list(sh), list(sh)
        low[d], high[d] = first, sh[d] - first
        stack.append((high, offset + first * in_strides[d]))
        stack.append((low, offset))
    return out


def scratch_plan(kind, sizes, in_strides, in_offset, in_size, in_dtype_name, reduced, out_strides, out_size,
                 out_dtype_name, multiprocessors, threads_per_multiprocessor):  # fmt: skip
    """The allocations a CUDA `kind` reduction ("sum" or "mean") takes
    besides its output, for an input of sizes and in_strides (elements)
    reduced over the dimensions in reduced; out_strides: the output's
    strides (elements) over the input's dimensions, any value for the
    reduced ones. As (held, rounds): held (bytes, in the order taken) lasts
    the whole call and is given back last, in the reverse order; each round
    is one launch's, taken in order and given back in the reverse order
    before the next round. An input of another type than the output is
    first copied into the output's type (half precision summed into float
    is read as it is). None where this model does not reach (complex
    types)."""
    if "complex" in in_dtype_name or "complex" in out_dtype_name:
        return None
    ndim = len(sizes)
    reduced = {d % ndim for d in reduced} if ndim else set()
    numel = 1
    for s in sizes:
        numel *= s
    if numel == 0:
        return [], []
    held = []
    half_to_float = in_dtype_name in ("float16", "bfloat16") and out_dtype_name == "float32"
    if in_dtype_name != out_dtype_name and not half_to_float:
        held.append(numel * out_size)  # the input in the output's type (its strides kept where dense)
        if not dense(sizes, in_strides):
            in_strides = _contiguous(sizes)
        in_size, in_dtype_name, in_offset = out_size, out_dtype_name, 0
    ins = [st * in_size for st in in_strides]
    outs = [0 if d in reduced else out_strides[d] * out_size for d in range(ndim)]
    shape, ins, outs = iteration_shape(list(sizes), ins, outs)
    vt0, vec = _VECTORS[kind][0 if in_size == 2 else 1]
    acc = _accumulator_size(in_dtype_name, out_dtype_name, out_size)
    pieces = pieces_32bit(shape, ins, outs)
    if len(pieces) > 1:
        # The pieces meet in the output, unless it is half precision in and
        # out (float16 or bfloat16 both sides): then in a buffer of the
        # accumulator's type as large as the output's span.
        if in_dtype_name == out_dtype_name and out_dtype_name in ("float16", "bfloat16"):
            span = max([out_size] + [n * st for n, st in zip(shape, outs)])
            held.append(span // out_size * acc)
    rounds = []
    for piece, offset in pieces:
        cfg = launch(piece, ins, outs, in_size, acc, vt0, vec, multiprocessors, threads_per_multiprocessor,
                     in_offset + offset // in_size)  # fmt: skip
        rounds.append([cfg["buffer_bytes"], cfg["semaphore_bytes"]] if cfg["global_reduce"] else [])
    return held, [r for r in rounds if r]


def scratch_sizes(kind, sizes, in_strides, in_offset, in_size, in_dtype_name, reduced, out_strides, out_size,
                  out_dtype_name, multiprocessors, threads_per_multiprocessor):  # fmt: skip
    """scratch_plan's allocations as one list, in the order they are made
    ([] when none, None where not modelled): what the call asks of the
    caching allocator, in number and bytes."""
    plan = scratch_plan(kind, sizes, in_strides, in_offset, in_size, in_dtype_name, reduced, out_strides, out_size,
                        out_dtype_name, multiprocessors, threads_per_multiprocessor)  # fmt: skip
    if plan is None:
        return None
    held, rounds = plan
    return held + [n for r in rounds for n in r]


def _contiguous(sizes):
    strides, span = [], 1
    for s in reversed(sizes):
        strides.append(span)
        span *= max(s, 1)
    return strides[::-1]


def dense(sizes, strides):
    """Its elements fill a span of its own size once each."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1):
        if stride != span:
            return False
        span *= size
    return True


def scratch_of(kind, x, dims, out, multiprocessors, threads_per_multiprocessor):
    """scratch_plan for tensors (anything with PyTorch's tensor methods,
    fake ones too): a `kind` reduction of x over dims (None or empty:
    all) into out, with keepdim or without."""
    nd = x.dim()
    dims = set(range(nd)) if not dims else {d % nd for d in dims}
    kept = iter(out.stride())
    out_strides = list(out.stride()) if out.dim() == nd else [0 if d in dims else next(kept) for d in range(nd)]
    return scratch_plan(kind, list(x.shape), list(x.stride()), x.storage_offset(), x.element_size(), _name(x),
                        dims, out_strides, out.element_size(), _name(out), multiprocessors,
                        threads_per_multiprocessor)  # fmt: skip


def _name(t):
    return str(t.dtype).replace("torch.", "")
