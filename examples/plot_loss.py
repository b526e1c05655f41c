#!/usr/bin/env python3
"""The main job's loss curve as a PNG: training and held-out loss of train_gpt (--loss-csv) against
the step, with the held-out loss of the trigram count model as a line to beat.

Usage: plot_loss.py LOSS.csv OUT.png [--trigram NATS]
"""
import argparse
import csv

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("png")
    parser.add_argument("--trigram", type=float, help="the trigram count model's held-out loss")
    args = parser.parse_args()
    train, held = [], []
    with open(args.csv) as f:
        for row in csv.DictReader(f):
            if row["loss"]:
                train.append((int(row["step"]), float(row["loss"])))
            if row["held_out_loss"]:
                held.append((int(row["step"]), float(row["held_out_loss"])))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*train), label="training loss (mean over the last logged steps)")
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss")
    if args.trigram is not None:
        ax.axhline(args.trigram, color="gray", linestyle="--", label=f"trigram count model, held out ({args.trigram:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("train_gpt: byte-level GPT, TP 2 x DP 2")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png)
    print(f"loss curve: {args.png}")


if __name__ == "__main__":
    main()
