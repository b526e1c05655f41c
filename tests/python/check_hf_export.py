"""train_gpt -> checkpoint -> export --format hf-gpt2 -> transformers: the same loss.

Trains examples/train_gpt briefly at TP 2 (2 ranks, so the exported weights are joined from
slices), again at PP 2 (each stage's checkpoint holds only its own layers), and fully sharded
(--zero 3: each parameter written by the rank holding its first element), on its corpus, with a checkpoint at the end and --score on the corpus's held-out tail (the
last 10%, never trained on: the fp32 mean next-byte loss over contiguous windows, computed by
train_gpt's own model); exports the checkpoint with
`python -m torchloom.checkpoint export --format hf-gpt2`; loads the directory with transformers'
GPT2LMHeadModel.from_pretrained and computes the loss over the same windows. They must agree to
float32 rounding (the TP model reduces its row-parallel products in another order): 1e-4.

Usage: check_hf_export.py --mpirun MPIEXEC --train-gpt PATH --work DIR --corpus FILE
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpirun", required=True)
    parser.add_argument("--train-gpt", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--corpus", required=True, help="train_gpt's corpus (its default --data)")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    # The held-out tail as train_gpt splits it (--held-out 0.1 of the bytes, the last ones).
    with open(args.corpus, "rb") as f:
        corpus = f.read()
    held_out = os.path.join(args.work, "held_out.txt")
    with open(held_out, "wb") as f:
        f.write(corpus[len(corpus) - int(0.1 * len(corpus)):])
    failed = 0
    for layout in (["--tp", "2"], ["--tp", "1", "--pp", "2"], ["--tp", "1", "--zero", "3"]):
        print(" ".join(layout) + ":")
        failed += check_layout(args, layout, os.path.join(args.work, "".join(layout).replace("-", "")), held_out)
    return 1 if failed else 0


def check_layout(args, layout, work, held_out):
    os.makedirs(work)
    ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "hf-gpt2")
    seq, windows = 32, 8
    train = subprocess.run(
        [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", args.train_gpt] + layout + ["--steps", "100",
         "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", str(seq), "--batch", "8", "--eval-every", "0",
         "--data", args.corpus, "--held-out", "0.1", "--checkpoint-dir", ckpt, "--score", held_out,
         "--score-windows", str(windows), "--progress", "lines"],
        capture_output=True, text=True, timeout=300)
    if train.returncode != 0:
        print(train.stdout[-3000:], train.stderr[-3000:])
        return 1
    found = re.search(r"score .*: (\d+) windows of (\d+) bytes, loss ([0-9.]+)", train.stdout)
    assert found, train.stdout[-2000:]
    ours = float(found.group(3))

    export = subprocess.run([sys.executable, "-m", "torchloom.checkpoint", "export", "--format", "hf-gpt2", ckpt, out],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    print(export.stdout.strip())

    # An existing file as the model directory: refused with a message (exit 2), not a traceback,
    # and the file left as it was.
    a_file = os.path.join(work, "not_a_directory")
    with open(a_file, "w") as f:
        f.write("keep me")
    refused = subprocess.run([sys.executable, "-m", "torchloom.checkpoint", "export", "--format", "hf-gpt2", ckpt,
                              a_file], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "exists and is not a directory" in refused.stderr and \
        "Traceback" not in refused.stderr, (refused.returncode, refused.stderr)
    with open(a_file) as f:
        assert f.read() == "keep me"
    print("export to an existing file: refused,", refused.stderr.strip())

    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float32).eval()
    with open(held_out, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    count = int(found.group(1))
    ids = torch.stack([data[w * seq: w * seq + seq + 1] for w in range(count)])  # [windows, seq + 1]
    with torch.no_grad():
        logits = model(ids[:, :seq]).logits
        theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
    print(f"held-out loss over {count} windows of {seq} bytes: train_gpt {ours:.6f}, transformers GPT-2 {theirs:.6f}, "
          f"difference {abs(ours - theirs):.2e}")
    return 0 if abs(ours - theirs) < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
