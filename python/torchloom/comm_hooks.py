"""Communication hooks for torchloom.DistributedDataParallel.register_comm_hook(state, hook).

A hook has torch's signature, `hook(state, bucket: GradBucket) -> torch.futures.Future`, the
future's value being the bucket's averaged gradients; PyTorch's own hooks run unchanged when the
DDP reduces over a torch.distributed process group of backend "loom":

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp = torchloom.DistributedDataParallel(model, process_group=torch.distributed.group.WORLD)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)

A hook may also return a torchloom.Work, or a pair (Work, finish) where finish() runs after the
wait; then bucket.buffer() must hold the averaged gradients (the reduced sum divided by
bucket.divisor) when it completes. Hooks run on the thread running backward, with the GIL.

The built-in hooks run in C++ (loom::comm_hooks), without the GIL: pass them as `hook` (state is
ignored).

    ddp.register_comm_hook(None, torchloom.comm_hooks.fp16_compress_hook)
"""
from ._C import BuiltinCommHook, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .parallel import GradBucket

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "BuiltinCommHook", "GradBucket"]
