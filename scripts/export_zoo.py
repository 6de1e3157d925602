"""Copy a finished training run into models/zoo/NAME with a model card of its measured numbers.

    python scripts/export_zoo.py runs/small small --dtype fp16 --command "speedc train runs/small ..."

Only the checkpoint (config.json, model.safetensors, tokenizer.json) and the training metrics are
copied; the optimizer state stays behind.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ZOO = Path(__file__).resolve().parent.parent / "models" / "zoo"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("name")
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--command", required=True, help="the training command, for the card")
    args = parser.parse_args()
    out = ZOO / args.name
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(args.run / "model.safetensors"))
    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(args.run / name, out / name)
    state = json.loads((args.run / "training.json").read_text())
    metrics = {k: state[k] for k in ("step", "wall_seconds", "tokens_seen", "corpus", "corpus_sha256", "corpus_tokens",
                                     "options", "history")}
    (out / "training.json").write_text(json.dumps(metrics, indent=2) + "\n")
    config = json.loads((out / "config.json").read_text())
    last = state["history"][-1]
    params = sum(v.numel() for v in tensors.values())
    plan = config["speedc"]["depth"]  # the layer map is the depth plan's: prelude, core x repeats, coda
    layer_map = [*plan["prelude"], *plan["core"] * plan["repeats"], *plan["coda"]]
    card = f"""# speedc zoo model `{args.name}`

A shared-weight Llama-style decoder trained by speedc on the bundled Shakespeare corpus.

| | |
|---|---|
| shape | {config['num_hidden_layers']} logical layers over {layer_map}, hidden {config['hidden_size']}, MLP {config['intermediate_size']}, heads {config['num_attention_heads']} ({config['num_key_value_heads']} kv), vocab {config['vocab_size']} (byte-level BPE), context {config['max_position_embeddings']} |
| early exit | after layer {config['speedc']['exit']['layer']}, own RMSNorm, shared (tied) LM head |
| unique parameters | {params:,} ({args.dtype} storage, {(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB) |
| corpus | {', '.join(state['corpus'])}: sha256 `{state['corpus_sha256']}`, {state['corpus_tokens']['train']:,} train / {state['corpus_tokens']['val']:,} validation tokens |
| training | {state['step']} steps, batch {state['options']['batch_size']} x {state['options']['seq_len']} tokens, {state['tokens_seen']:,} tokens seen, wall time {state['wall_seconds'] / 60:.1f} min on a 2-core CPU machine |
| validation loss | exit {last['val_loss_exit']}, final {last['val_loss_final']} |
| exit/final agreement | top-1 {last['agree_top1']}, top-2 {last['agree_top2']} (the speculation acceptance SPEED sees) |

Training command:

    {args.command}

All numbers above were measured by that run (see training.json for the whole history).
"""
    (out / "MODEL_CARD.md").write_text(card)
    print(card)


if __name__ == "__main__":
    main()
