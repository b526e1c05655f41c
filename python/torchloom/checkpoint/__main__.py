"""python -m torchloom.checkpoint: tools for checkpoints written by torchloom.

    python -m torchloom.checkpoint consolidate DIR OUT.safetensors [--optimizer]
    python -m torchloom.checkpoint export --format hf-gpt2 DIR OUTDIR

consolidate: the full tensors of a checkpoint (tensor-parallel slices joined), verified against
their checksums, as one safetensors file that torch, safetensors or transformers read without
torchloom. DIR is a step_<N> directory or a checkpoint directory (its newest complete checkpoint).
export --format hf-gpt2: a checkpoint of examples/train_gpt as a directory that transformers'
GPT2LMHeadModel.from_pretrained loads (config.json and model.safetensors; see hf_gpt2.py).
Exit status 0 on success, 2 for a checkpoint that cannot be read (the reason on stderr).
"""
import argparse
import os
import sys
from typing import List, Optional

from .. import _C


def _checkpoint_path(directory: str) -> Optional[str]:
    if os.path.exists(os.path.join(directory, "manifest.json")):
        return directory
    return _C.Checkpointer.find_latest(directory)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchloom.checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser("consolidate", help="full tensors as one safetensors file")
    consolidate.add_argument("directory", help="a step_<N> directory, or a directory of checkpoints")
    consolidate.add_argument("out", help="the safetensors file to write")
    consolidate.add_argument("--optimizer", action="store_true", help="include the optimizer's state tensors (and ZeRO's fp32 master weights)")
    export = commands.add_parser("export", help="another framework's model directory")
    export.add_argument("--format", required=True, choices=["hf-gpt2"], help="hf-gpt2: transformers' GPT-2")
    export.add_argument("directory", help="a step_<N> directory, or a directory of checkpoints")
    export.add_argument("out", help="the model directory to write")
    args = parser.parse_args(argv)

    path = _checkpoint_path(args.directory)
    if path is None:
        print(f"{parser.prog}: no complete checkpoint in {args.directory}", file=sys.stderr)
        return 2
    try:
        if args.command == "export":
            from .hf_gpt2 import export_hf_gpt2
            shape = export_hf_gpt2(path, args.out)
            print(f"{args.out}: GPT-2 with {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} heads, "
                  f"{shape['seq']} positions, vocabulary {shape['vocab']}, from {path}")
            return 0
        info = _C.consolidate_checkpoint(path, args.out, optimizer=args.optimizer)
    except (_C.CheckpointError, ValueError, KeyError) as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {info['tensors']} tensors, {info['bytes'] / 1e6:.1f} MB, from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
