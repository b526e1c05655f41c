"""Communication hooks for torchloom.DistributedDataParallel.register_comm_hook(state, hook).

The built-in hooks run in C++ (loom::comm_hooks): pass them as `hook` (state is ignored).

    ddp.register_comm_hook(None, torchloom.comm_hooks.fp16_compress_hook)

A Python hook is `hook(state, bucket: GradBucket)` returning a torchloom.Work, or a pair
(Work, finish) where finish() runs after the wait; when it returns, bucket.buffer must hold the
averaged gradients (divide the reduced sum by bucket.divisor). It runs on the thread running
backward, with the GIL.
"""
from ._C import BuiltinCommHook, GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "BuiltinCommHook", "GradBucket"]
