"""A checkpoint of examples/train_gpt as a Hugging Face GPT-2 model directory.

train_gpt's model is GPT-2's architecture with a byte vocabulary: learned positions, pre-layernorm
blocks (causal attention with biases, an MLP with exact GELU), a final layernorm and an untied
head without bias. The export joins the tensor-parallel slices (through the consolidation), then
renames and lays out the tensors as transformers' GPT2LMHeadModel expects:

- GPT-2's Conv1D layers store [in, out]: every Linear weight is transposed;
- train_gpt's fused QKV projection orders its output rows by head, then q/k/v ([heads, 3, d],
  so that each TP rank's rows are whole heads); GPT-2's c_attn orders them q/k/v, then head
  ([3, heads, d]): rows and biases are permuted;
- positions are [seq, 1, hidden] in train_gpt (sequence-first activations), [n_positions, hidden]
  in GPT-2;
- config: activation_function "gelu" (exact, as train_gpt; GPT-2's default is the tanh
  approximation), tie_word_embeddings false, the layernorm epsilon and shapes train_gpt records in
  the checkpoint's user values (gpt.layers, gpt.hidden, gpt.heads, gpt.seq, gpt.vocab).
"""
import json
import os
import tempfile
from typing import Dict

import torch

from .. import _C


def _user_values(checkpoint: str) -> Dict[str, str]:
    with open(os.path.join(checkpoint, "manifest.json"), encoding="utf-8") as f:
        return json.load(f).get("user", {})


def export_hf_gpt2(checkpoint: str, out_dir: str) -> Dict[str, int]:
    """Writes out_dir/config.json and out_dir/model.safetensors; returns the config's shape.
    ValueError, before anything is read or written, when out_dir exists and is not a directory."""
    from safetensors.torch import load_file, save_file

    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory: expected a model directory to write "
                         "(a new path, or an existing directory)")

    user = _user_values(checkpoint)
    missing = [k for k in ("gpt.layers", "gpt.hidden", "gpt.heads", "gpt.seq", "gpt.vocab") if k not in user]
    if missing:
        raise ValueError(f"{checkpoint} does not record {missing}: not a train_gpt checkpoint (or one saved before "
                         "train_gpt recorded its shape)")
    layers, hidden, heads = int(user["gpt.layers"]), int(user["gpt.hidden"]), int(user["gpt.heads"])
    seq, vocab = int(user["gpt.seq"]), int(user["gpt.vocab"])
    d = hidden // heads

    with tempfile.TemporaryDirectory() as scratch:
        full = os.path.join(scratch, "full.safetensors")
        _C.consolidate_checkpoint(checkpoint, full)  # slices joined, every checksum verified
        t = load_file(full)

    def qkv_rows(w: torch.Tensor) -> torch.Tensor:  # [heads, 3, d, ...] -> [3, heads, d, ...]
        return w.reshape(heads, 3, d, *w.shape[1:]).transpose(0, 1).reshape(3 * hidden, *w.shape[1:])

    hf = {
        "transformer.wte.weight": t["tok.weight"],
        "transformer.wpe.weight": t["pos"].reshape(seq, hidden),
        "transformer.ln_f.weight": t["lnf_weight"],
        "transformer.ln_f.bias": t["lnf_bias"],
        "lm_head.weight": t["head.weight"],
    }
    for i in range(layers):
        b, h = f"block{i}.", f"transformer.h.{i}."
        hf[h + "ln_1.weight"], hf[h + "ln_1.bias"] = t[b + "ln1_weight"], t[b + "ln1_bias"]
        hf[h + "ln_2.weight"], hf[h + "ln_2.bias"] = t[b + "ln2_weight"], t[b + "ln2_bias"]
        hf[h + "attn.c_attn.weight"] = qkv_rows(t[b + "qkv.weight"]).t()
        hf[h + "attn.c_attn.bias"] = qkv_rows(t[b + "qkv.bias"])
        hf[h + "attn.c_proj.weight"] = t[b + "proj.weight"].t()
        hf[h + "attn.c_proj.bias"] = t[b + "proj.bias"]
        hf[h + "mlp.c_fc.weight"] = t[b + "fc1.weight"].t()
        hf[h + "mlp.c_fc.bias"] = t[b + "fc1.bias"]
        hf[h + "mlp.c_proj.weight"] = t[b + "fc2.weight"].t()
        hf[h + "mlp.c_proj.bias"] = t[b + "fc2.bias"]
    inner = int(t["block0.fc1.weight"].shape[0])

    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": seq,
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "n_inner": inner,
        "activation_function": user.get("gpt.activation", "gelu"),
        "layer_norm_epsilon": float(user.get("gpt.layernorm_eps", "1e-5")),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "vocab": vocab, "tensors": len(hf)}
