"""Tensor parallelism (Megatron-style) as Python nn.Modules over the C++ layers and region operations.

Each layer is built by the C++ layer, which creates this rank's slice of the weights; the Python
module then owns that slice as its nn.Parameter and hands the same tensor back to the C++ layer,
whose forward (checks, region operations, matmul) runs on it, so optimizers, state_dict() and DDP
see ordinary parameters. init="master" draws the plain layer's full weight from torch's default
generator, exactly as torch.nn.Linear / Embedding would, and keeps this rank's slice:
torch.manual_seed(s) followed by the same constructor calls then gives the same function at every
TP degree. init=None takes the C++ library's default (where it has loom::ParallelInit, "sharded":
each rank draws only its shard from the model-parallel stream).

    ps = torchloom.ParallelState(torchloom.world_comm(), tensor_parallel=2)
    fc1 = torchloom.ColumnParallelLinear(512, 2048, ps.tp_group)   # 1024 output rows per rank
    fc2 = torchloom.RowParallelLinear(2048, 512, ps.tp_group)      # 1024 input columns per rank
    y = fc2(torch.nn.functional.gelu(fc1(x)))                      # one all-reduce forward, one backward

group None means no tensor parallelism (no communication).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import _C
from ._C import (RngTracker, copy_to_region, gather_from_region, gather_from_sequence_region,
                    model_parallel_seed, padded_vocab_size, reduce_from_region, reduce_scatter_to_sequence_region,
                    scatter_to_region, scatter_to_sequence_region)

Group = Optional[_C.Communicator]


def rng_tracker(device: Any = None) -> RngTracker:
    """The process's RNG tracker for `device`'s default generator (a torch.device or a string such as
    "cuda:0"; None: the CPU one, which the layers use unless given another). Fork the tracker of the
    device the random draws happen on: forking the CPU tracker around a CUDA draw changes nothing."""
    return _C.rng_tracker(None if device is None else torch.device(device))


def fork(name: str = "model-parallel") -> Any:
    """with fork(): random draws inside come from the named stream (per TP rank after
    ParallelState.seed) on the CPU and, where ParallelState.seed ran on a machine with a GPU, on the
    current CUDA device too: dropout inside a split region, wherever the tensors live.

        ps.seed(1234)
        with torchloom.tensor_parallel.fork():
            h = torch.nn.functional.dropout(h, 0.1)   # a different mask on each TP rank
    """
    return _C.fork(name)


def _adopt(module: torch.nn.Module, impl: Any, name: str) -> None:
    """Makes the C++ layer's tensor `name` this module's parameter (the same storage), and gives the
    parameter back to the C++ layer, so gradients land on the Python parameter."""
    tensor = getattr(impl, name)
    if tensor is None:  # an undefined tensor (no bias)
        module.register_parameter(name, None)
        return
    param = torch.nn.Parameter(tensor.detach(), requires_grad=True)
    module.register_parameter(name, param)
    setattr(impl, name, param)


class _ParallelLayer(torch.nn.Module):
    _impl: Any

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._impl.forward(input)

    def load_master(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copies this rank's slice of full (master) weights into the parameters."""
        if bias is None:
            self._impl.load_master(weight)
        else:
            self._impl.load_master(weight, bias)

    def shard_info(self) -> Dict[str, Dict[str, Any]]:
        """How each parameter relates to the full tensor: split dim, global shape, offset, TP rank and size."""
        return self._impl.shard_info()


class ColumnParallelLinear(_ParallelLayer):
    """y = x A^T + b with A split by rows (output features) across the TP group."""

    def __init__(self, in_features: int, out_features: int, group: Group = None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, init: Optional[str] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._impl = _C.ColumnParallelLinear(in_features, out_features, group, bias=bias,
                                             gather_output=gather_output, sequence_parallel=sequence_parallel,
                                             init=init)
        _adopt(self, self._impl, "weight")
        _adopt(self, self._impl, "bias")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows=[{self._impl.out_start}, {self._impl.out_start + self._impl.out_per_rank})")


class RowParallelLinear(_ParallelLayer):
    """y = x A^T + b with A split by columns (input features); partial products all-reduced, bias added once."""

    def __init__(self, in_features: int, out_features: int, group: Group = None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, init: Optional[str] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._impl = _C.RowParallelLinear(in_features, out_features, group, bias=bias,
                                          input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                                          init=init)
        _adopt(self, self._impl, "weight")
        _adopt(self, self._impl, "bias")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"columns=[{self._impl.in_start}, {self._impl.in_start + self._impl.in_per_rank})")


class VocabParallelEmbedding(_ParallelLayer):
    """An embedding table split by rows (vocabulary) across the TP group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group = None,
                 sequence_parallel: bool = False, init: Optional[str] = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._impl = _C.VocabParallelEmbedding(num_embeddings, embedding_dim, group,
                                               sequence_parallel=sequence_parallel, init=init)
        _adopt(self, self._impl, "weight")

    def load_master(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self._impl.load_master(weight)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"ids=[{self._impl.vocab_start}, {self._impl.vocab_end})")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group = None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits split along the last (vocabulary) dimension; equals
    torch.nn.functional.cross_entropy on the gathered logits, without forming them."""
    return _C.vocab_parallel_cross_entropy(logits, target, group, ignore_index=ignore_index,
                                              label_smoothing=label_smoothing, reduction=reduction)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "RngTracker", "rng_tracker", "model_parallel_seed", "padded_vocab_size", "copy_to_region",
           "reduce_from_region", "scatter_to_region", "gather_from_region", "scatter_to_sequence_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region"]
