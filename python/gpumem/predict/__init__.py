"""Predict a PyTorch job's GPU memory from short runs at small batch sizes.

    rec = gpumem.predict.record_step(build_model, make_batch, step_fn, batch_size=2)
    rec.write("b2.trace")

record_step (recorder.py) records a job's CUDA allocations on a machine
with no GPU, on fake CUDA tensors; `python -m gpumem.predict` (the
command, __main__.py) records a training script at two small batch sizes,
on the GPU when there is one, and asks `gpumem predict` what fits at a
large one. Device profiles (profiles.py) add what a CPU run cannot see.
Needs PyTorch for recording; importing this package does not."""

from .profiles import Profile, available as available_profiles, load as load_profile

__all__ = ["record_step", "recording", "Recording", "RecorderError", "Profile", "load_profile",
           "available_profiles"]


def __getattr__(name):
    # The recorder imports torch; loaded when first asked for.
    if name in ("record_step", "recording", "Recording", "RecorderError"):
        from . import recorder

        return getattr(recorder, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
