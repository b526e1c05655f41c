"""torchloom.GradScaler: torch.amp.GradScaler's methods and state_dict over loom::GradScaler.

The C++ scaler does the work: one fused unscale per device and dtype, found-inf all-reduced (MAX)
over `sync_groups` (e.g. the tensor-parallel group) so every rank steps or skips together, the
scale updated by ATen's _amp_update_scale_. The scale lives on the device of the first loss scaled.

    scaler = torchloom.GradScaler(sync_groups=[ps.tp_group])
    scaler.scale(loss).backward()
    scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0)   # optional
    scaler.step(opt)
    scaler.update()

With a torchloom.ZeroRedundancyOptimizer it unscales the gradient shards (fp32 where master weights
are kept), agrees on found-inf over the ZeRO group as well, and a skipped step skips every shard;
clip with zero.clip_grad_norm_ (the global norm over every shard).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from . import _C


def _grads(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _zero_of(optimizer: Any) -> Optional[_C._Zero]:
    """The engine of a torchloom.ZeroRedundancyOptimizer, whose gradients are shards."""
    from .zero import ZeroRedundancyOptimizer
    return optimizer._zero if isinstance(optimizer, ZeroRedundancyOptimizer) else None


class GradScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's methods and semantics.

    device is accepted for signature compatibility; the scale lives on the device of the first
    loss scaled. sync_groups: torchloom communicators over which found-inf is agreed."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 sync_groups: Optional[Sequence[_C.Communicator]] = None) -> None:
        self._device = device
        self._impl = _C.GradScaler(init_scale=float(init_scale), growth_factor=float(growth_factor),
                                   backoff_factor=float(backoff_factor), growth_interval=int(growth_interval),
                                   enabled=bool(enabled), sync_groups=list(sync_groups or []))

    def scale(self, outputs: Union[torch.Tensor, Iterable[Any]]) -> Any:
        """outputs * scale; a tensor, or a (nested) list/tuple of tensors."""
        if isinstance(outputs, torch.Tensor):
            return self._impl.scale(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return map(self.scale, outputs)

    def scaled_by_another_rank(self, device: Union[str, torch.device] = "cpu") -> None:
        """For a pipeline stage before the last: its gradients were scaled by the last stage's
        scale(loss); keeps the scale on `device` so unscale_, step and update run here too."""
        self._impl.scaled_by_another_rank(str(device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale in place (once between update()s)."""
        zero = _zero_of(optimizer)
        if zero is not None:
            self._impl.unscale_zero(zero)
            return
        self._impl.unscale_(id(optimizer), _grads(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[Any]:
        """Unscales (unless done) and runs optimizer.step(*args, **kwargs) unless a gradient is inf/NaN on
        any rank of the sync groups; returns what optimizer.step returned, or None when skipped."""
        result: List[Any] = []

        def run() -> None:
            result.append(optimizer.step(*args, **kwargs))

        zero = _zero_of(optimizer)
        if zero is not None:  # found-inf agreed over the ZeRO group: each rank holds one shard
            self._impl.step_zero(zero, run)
            return result[0] if result else None
        self._impl.step(id(optimizer), _grads(optimizer), run)
        return result[0] if result else None

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """Backs off after a skipped step, grows after growth_interval clean ones; or sets new_scale."""
        if new_scale is None:
            self._impl.update()
        else:
            self._impl.update(float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale))

    def get_scale(self) -> float:
        return self._impl.get_scale()

    def get_growth_factor(self) -> float:
        return self._impl.get_growth_factor()

    def set_growth_factor(self, new_factor: float) -> None:
        self._impl.set_growth_factor(float(new_factor))

    def get_backoff_factor(self) -> float:
        return self._impl.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        self._impl.set_backoff_factor(float(new_factor))

    def get_growth_interval(self) -> int:
        return self._impl.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        self._impl.set_growth_interval(int(new_interval))

    def _get_growth_tracker(self) -> int:
        return self._impl.get_growth_tracker()

    def is_enabled(self) -> bool:
        return self._impl.is_enabled()

    def state_dict(self) -> Dict[str, Any]:
        """{"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}; {} when disabled."""
        state = self._impl.state_dict()
        if not state:
            return {}
        return {"scale": float(state["scale"]), "growth_factor": float(state["growth_factor"]),
                "backoff_factor": float(state["backoff_factor"]), "growth_interval": int(state["growth_interval"]),
                "_growth_tracker": int(state["_growth_tracker"])}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._impl.load_state_dict({k: float(v) for k, v in state_dict.items()})
