"""A training step that runs out of memory goes on as k micro-batches.

    step = gpumem.torch.microbatch(loss_fn, optimizer)      # or gpumem.microbatch
    for batch in loader:
        loss = step(batch)

loss_fn(micro_batch) runs the forward pass and returns the loss (a scalar
tensor, the mean over the micro-batch, or an object with a .loss, as
transformers' outputs have). The helper owns the rest of the step: it
clears the gradients, splits the batch along its first dimension into k
micro-batches, backpropagates each micro-batch's loss scaled by its share of
the batch (m / n), steps the optimizer once and clears the gradients again.
The optimizer sees the same effective batch whatever k is: the gradient is
the sum over micro-batches of (m / n) * grad(mean loss of the micro-batch),
which is the gradient of the batch's mean loss.

When a micro-batch runs out of memory (torch.OutOfMemoryError, or the
RuntimeError of PyTorch's and gpumem's text), the attempt is thrown away
(gradients cleared, the random number generators put back as they were at
the start of the step) and the step starts again with twice as many
micro-batches. The k that worked is kept for the next steps; after
`retry_after` steps in a row at k, the next step tries k / 2 again.
Memory the failed attempt held is free again once the error has been
caught: under gpumem at once, under PyTorch's allocator as cached blocks.

Under DistributedDataParallel (pass the wrapped model as `model`), the
ranks agree on k: each attempt ends with one all_reduce of two numbers
(did any rank run out of memory, the largest k), and all ranks start again
with the largest k any needed. Gradients are exchanged once per step. At a
k that has already worked, as DDP does with gradient accumulation: the
micro-batches but the last under model.no_sync(), the last one's backward
exchanging them (the ranks agree after its forward pass). At a k not yet
tried (the first step, after running out of memory, when a smaller k is
tried again), every micro-batch runs under no_sync and the gradients are
averaged over the ranks in one all_reduce per dtype once all ranks
succeeded, so that any micro-batch may run out of memory. Running out of
memory in the last backward at a k that had worked cannot be undone across
ranks (its gradients are being exchanged): that raises, saying so.

With autocast, call the model under torch.autocast inside loss_fn as
usual. With a GradScaler (`scaler=`), each scaled share is backpropagated
through scaler.scale and the step goes through scaler.step and
scaler.update.

What it cannot undo: buffers that the forward pass updates in place
(BatchNorm's running statistics) keep the failed attempt's updates (a
warning says so, once), and an out-of-memory error in optimizer.step()
itself (the optimizer's state is allocated at the first step) is raised,
since part of the parameters may have been updated.

Needs PyTorch; works with or without gpumem serving PyTorch.
"""

import contextlib
import math
import warnings
from collections.abc import Mapping

__all__ = ["MicroBatchStep", "microbatch", "CannotSplitError"]


class CannotSplitError(RuntimeError):
    """A step ran out of memory and its batch cannot be split further."""


def _torch():
    import torch

    return torch


def _is_oom(torch, exc):
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return "CUDA out of memory" in text or "gpumem: out of memory" in text


def _batch_size(torch, batch, path="batch"):
    """(n, where): the leading dimension shared by every tensor of batch."""
    found = []

    def visit(x, where):
        if isinstance(x, torch.Tensor):
            if x.dim() > 0:
                found.append((x.shape[0], where))
        elif isinstance(x, Mapping):
            for key in x:
                visit(x[key], "%s[%r]" % (where, key))
        elif isinstance(x, (list, tuple)):
            for i, item in enumerate(x):
                visit(item, "%s[%d]" % (where, i))

    visit(batch, path)
    if not found:
        raise CannotSplitError("gpumem.microbatch: the batch holds no tensor with a batch dimension")
    n, where = found[0]
    for m, w in found[1:]:
        if m != n:
            raise CannotSplitError(
                "gpumem.microbatch: cannot split the batch along its first dimension: %s has %d "
                "rows but %s has %d" % (where, n, w, m)
            )
    return n


def _split(torch, batch, sizes):
    """batch cut into len(sizes) pieces along dimension 0."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(sizes)) if batch.dim() > 0 else [batch] * len(sizes)
    if isinstance(batch, Mapping):
        parts = {key: _split(torch, value, sizes) for key, value in batch.items()}
        out = []
        for i in range(len(sizes)):
            items = {key: parts[key][i] for key in parts}
            try:
                out.append(type(batch)(items))
            except Exception:  # a mapping type that cannot be built from a dict
                out.append(items)
        return out
    if isinstance(batch, (list, tuple)):
        parts = [_split(torch, item, sizes) for item in batch]
        rows = [[p[i] for p in parts] for i in range(len(sizes))]
        if isinstance(batch, tuple):
            if hasattr(batch, "_fields"):  # a namedtuple
                return [type(batch)(*r) for r in rows]
            return [tuple(r) for r in rows]
        return [type(batch)(r) if type(batch) is not list else r for r in rows]
    return [batch] * len(sizes)


def _sizes(n, k):
    """n rows in k micro-batches as even as they come, larger ones first."""
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _loss_of(out):
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    return out if loss is None else loss


class MicroBatchStep:
    """One optimizer step per call, as k micro-batches (module docstring).

    loss_fn: micro_batch -> loss. optimizer: a torch.optim.Optimizer.
    model: the module (needed under DDP; used to notice in-place buffer
    updates). scaler: a torch.amp.GradScaler. k: micro-batches to start
    with (e.g. from a prediction); retry_after: steps at k before k / 2 is
    tried again (0: never); max_k: the most micro-batches (default: one row
    each).
    """

    def __init__(self, loss_fn, optimizer, model=None, scaler=None, k=1, retry_after=50, max_k=None):
        if not callable(loss_fn):
            raise TypeError("gpumem.microbatch: loss_fn must be callable")
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "zero_grad"):
            raise TypeError("gpumem.microbatch: optimizer must be a torch.optim.Optimizer")
        if not isinstance(k, int) or k < 1:
            raise ValueError("gpumem.microbatch: k must be a positive integer, not %r" % (k,))
        if not isinstance(retry_after, int) or retry_after < 0:
            raise ValueError("gpumem.microbatch: retry_after must be a non-negative integer")
        if max_k is not None and (not isinstance(max_k, int) or max_k < 1):
            raise ValueError("gpumem.microbatch: max_k must be a positive integer or None")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.model = model
        self.scaler = scaler
        self.k = k
        self.retry_after = retry_after
        self.max_k = max_k
        self.steps = 0  # optimizer steps taken
        self.ooms = 0  # attempts thrown away for want of memory
        self.last_k = None  # micro-batches of the last step
        self._steps_at_k = 0
        self._warned_buffers = False
        self._proven_k = None  # under DDP: a k whose every micro-batch fitted

    # -- distributed -------------------------------------------------------

    def _ddp(self):
        model = self.model
        return model if model is not None and hasattr(model, "no_sync") and hasattr(model, "require_backward_grad_sync") else None

    def _agree(self, torch, failed, k):
        """Under DDP: (any rank failed, the largest k of any rank)."""
        import torch.distributed as dist

        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([1 if failed else 0, k], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0].item()), int(t[1].item())

    # -- the step ----------------------------------------------------------

    def _rng_state(self, torch):
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, torch, state):
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    def _buffer_versions(self):
        if self.model is None:
            return None
        return [b._version for b in self.model.buffers()]

    def _backward(self, loss, share):
        scaled = loss * share
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()

    def _attempt(self, torch, pieces, sizes, n, ddp, safe):
        """Forward and backward of every micro-batch; returns (total loss,
        why it failed or None). Under DDP the ranks agree before gradients
        are exchanged: in a safe attempt every micro-batch runs under
        no_sync and the gradients are averaged once all ranks succeeded; in a
        fast one (a k that already worked) the last micro-batch's backward
        exchanges them as DDP does, after the ranks agreed on its forward."""
        total = None
        failed = None
        last = len(pieces) - 1
        stop = len(pieces) if safe else last
        loss = None
        try:
            for i in range(stop):
                with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
                    loss = _loss_of(self.loss_fn(pieces[i]))
                    self._backward(loss, sizes[i] / n)
                d = loss.detach() * (sizes[i] / n)
                total = d if total is None else total + d
                loss = None
            if not safe:
                loss = _loss_of(self.loss_fn(pieces[last]))  # forward only
                if ddp is None:
                    self._backward(loss, sizes[last] / n)
        except Exception as e:
            if not _is_oom(torch, e):
                raise
            failed = str(e)
            loss = None
        if ddp is not None:
            any_failed, _ = self._agree(torch, failed is not None, len(pieces))
            if any_failed:
                return None, failed or "another rank ran out of memory"
        if failed is not None:
            return None, failed
        if ddp is not None and safe:
            self._average_gradients(torch)
        elif ddp is not None:
            try:
                self._backward(loss, sizes[last] / n)
            except Exception as e:
                if not _is_oom(torch, e):
                    raise
                raise RuntimeError(
                    "gpumem.microbatch: out of memory in the backward pass of the last of %d "
                    "micro-batches under DistributedDataParallel, while gradients were being "
                    "exchanged: this cannot be retried consistently across ranks. Start with more "
                    "micro-batches (microbatch(..., k=%d)). The error was: %s"
                    % (len(pieces), 2 * len(pieces), e)
                ) from e
        if not safe:
            d = loss.detach() * (sizes[last] / n)
            total = d if total is None else total + d
        return total, None

    def _average_gradients(self, torch):
        """What DDP's last backward would have done: every gradient
        averaged over the ranks, in one all_reduce per dtype and device."""
        import torch.distributed as dist

        world = dist.get_world_size()
        groups = {}
        for p in self.model.parameters():
            if p.requires_grad and p.grad is not None:
                groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in groups.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            flat.div_(world)
            dist.all_reduce(flat)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    def __call__(self, batch):
        torch = _torch()
        n = _batch_size(torch, batch)
        ddp = self._ddp()
        most = min(n, self.max_k) if self.max_k else n
        k = min(self.k, most)
        rng = self._rng_state(torch)
        versions = self._buffer_versions()
        self.optimizer.zero_grad(set_to_none=True)
        while True:
            sizes = _sizes(n, k)
            pieces = _split(torch, batch, sizes)
            safe = ddp is not None and k != self._proven_k
            total, why = self._attempt(torch, pieces, sizes, n, ddp, safe)
            del pieces
            if why is None:
                break
            # Thrown away: gradients cleared (their memory too, before a
            # retry or the error), generators rewound.
            self.ooms += 1
            self.optimizer.zero_grad(set_to_none=True)
            self._set_rng_state(torch, rng)
            self._note_buffers(versions)
            if k >= most:
                raise CannotSplitError(
                    "gpumem.microbatch: the step ran out of memory at %d micro-batch(es) of %d "
                    "row(s) each at most, and cannot be split further (batch of %d%s). The error "
                    "was: %s"
                    % (k, math.ceil(n / k), n, ", max_k=%d" % self.max_k if self.max_k and k >= self.max_k else "", why)
                )
            k = min(2 * k, most)
            if ddp is not None:
                k = self._agree(torch, False, k)[1]
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.last_k = k
        self._proven_k = k
        if k != self.k:
            self._steps_at_k = 0
        self.k = k
        self._steps_at_k += 1
        if self.retry_after and self.k > 1 and self._steps_at_k >= self.retry_after:
            self.k = max(1, self.k // 2)
            self._steps_at_k = 0
        return total

    def _note_buffers(self, before):
        if before is None or self._warned_buffers:
            return
        after = self._buffer_versions()
        if after != before:
            self._warned_buffers = True
            warnings.warn(
                "gpumem.microbatch: a step that ran out of memory had updated some of the model's "
                "buffers in place (e.g. BatchNorm running statistics); they keep that update",
                RuntimeWarning,
                stacklevel=3,
            )


def microbatch(loss_fn, optimizer, **kwargs):
    """MicroBatchStep(loss_fn, optimizer, **kwargs): see the module docstring."""
    return MicroBatchStep(loss_fn, optimizer, **kwargs)
