#!/usr/bin/env python3
"""PyTorch's own DistributedDataParallel (Gloo) on the model a new user tries first: a small conv
net with BatchNorm, an auxiliary branch used on some steps only (find_unused_parameters), a frozen
parameter, AdamW, two micro-batches per step under no_sync(). The reference that
tests/dist/test_pytorch_parity.cpp drives loom::DistributedDataParallel through.

Writes JSON: the initial weights (rank 0's, before wrapping), each rank's frozen bias before
wrapping, and per rank the final parameters and buffers. Inputs come from torch.manual_seed(seed)
+ torch.randn, which LibTorch reproduces bit for bit, so the C++ side draws the same batches.

    python3 tests/python/ddp_reference.py --world 2 --out ref.json
"""
import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

STEPS = 8
MICRO = 2
BATCH = 4  # per micro-batch and rank
LR = 0.01
WEIGHT_DECAY = 0.01


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 6 * 6, 10)
        self.aux = nn.Linear(8 * 6 * 6, 10)  # used on some steps only

    def forward(self, x, use_aux):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def uses_aux(step, rank):
    # Step 5: no rank uses it (globally unused); otherwise every other rank.
    return step != 5 and (step + rank) % 2 == 0


def batch(step, micro, rank):
    torch.manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(BATCH, 3, 8, 8)
    y = torch.randn(BATCH, 10)
    return x, y


def flat(t):
    return t.detach().reshape(-1).tolist()


def run(rank, world, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net()
    model.conv.bias.requires_grad_(False)  # frozen
    with torch.no_grad():
        model.conv.bias.add_(rank)  # differs per rank before wrapping: DDP broadcasts rank 0's
    initial = {k: flat(v) for k, v in model.state_dict().items()}
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            x, y = batch(step, micro, rank)
            use_aux = uses_aux(step, rank)
            if micro < MICRO - 1:
                with ddp.no_sync():
                    loss = ((ddp(x, use_aux) - y) ** 2).mean() / MICRO
                    loss.backward()
            else:
                loss = ((ddp(x, use_aux) - y) ** 2).mean() / MICRO
                loss.backward()
        opt.step()
    result = {"initial": initial,
              "parameters": {n: flat(p) for n, p in model.named_parameters()},
              "buffers": {n: flat(b.to(torch.float64)) for n, b in model.named_buffers()}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out_dir = args.out + ".d"
    os.makedirs(out_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.world, port, out_dir), nprocs=args.world, join=True)
    ranks = []
    for r in range(args.world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    doc = {"steps": STEPS, "micro_batches": MICRO, "batch": BATCH, "lr": LR, "weight_decay": WEIGHT_DECAY,
           "world": args.world, "ranks": ranks}
    with open(args.out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
