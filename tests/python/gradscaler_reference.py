#!/usr/bin/env python3
"""PyTorch's own torch.amp.GradScaler on a scripted scenario: the reference that
tests/unit/test_grad_scaler.cpp drives loom::GradScaler through, step for step.

Gradients come from a formula (no random numbers), so the C++ side computes the very same bits;
inf/NaN are injected into chosen tensors on chosen steps. Writes the scale after every update,
whether each step ran the optimizer, and the final weights, as JSON.
"""
import json
import math
import sys

import torch

SHAPES = [(5,), (3, 4), (7,)]
STEPS = 20
INIT_SCALE = 1024.0
GROWTH_INTERVAL = 3
# (step, tensor, flat element, value)
INJECT = [(2, 1, 0, math.inf), (3, 0, 2, math.nan), (7, 2, 6, -math.inf), (8, 1, 11, math.inf), (12, 0, 0, math.nan)]


def target_gradients(step):
    grads = []
    for i, shape in enumerate(SHAPES):
        n = math.prod(shape)
        g = torch.sin(torch.arange(n, dtype=torch.float32) * (0.37 * (step + 1)) + i)
        for s, t, e, v in INJECT:
            if s == step and t == i:
                g[e] = v
        grads.append(g.reshape(shape))
    return grads


def main(out_path):
    torch.set_num_threads(1)
    params = [(torch.arange(math.prod(s), dtype=torch.float32) * 0.1 - 0.2).reshape(s).requires_grad_()
              for s in SHAPES]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=GROWTH_INTERVAL)
    scales, stepped = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum((p * g).sum() for p, g in zip(params, target_gradients(step)))
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        stepped.append(any(not torch.equal(b, p.detach()) for b, p in zip(before, params)))
        scaler.update()
        scales.append(scaler.get_scale())
    state = scaler.state_dict()
    json.dump({
        "torch_version": torch.__version__,
        "scales": scales,
        "stepped": stepped,
        "final_weights": [p.detach().reshape(-1).tolist() for p in params],
        "state_dict": {k: float(v) for k, v in state.items()},
    }, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1])
