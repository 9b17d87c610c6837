"""Train `opt-mini`, the small OPT-architecture model that dejavu ships as its default.

Two seeded steps, reproducible from the public-domain and CC corpora in `../shared/data`:

    python -m dejavu.models.train_opt_mini prepare --data ../shared/data --work .carry/optmini
    python -m dejavu.models.train_opt_mini train --work .carry/optmini --out models/opt-mini

`prepare` (CPU, ~1 min) trains a byte-level BPE tokenizer with the `tokenizers` library on
Shakespeare + KJV + WikiText-2 train and writes the token streams (uint16). `train` (one
GPU) trains the model under a wall-clock budget, keeps the checkpoint with the best
WikiText-2 validation loss, and writes a Hugging Face folder (config.json, tokenizer files,
safetensors shards + index) with a model card: parameters, tokens seen, WikiText-2 test
perplexity and the per-layer fraction of zero ReLU outputs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dejavu.fileio import write_json
from dejavu.models.metrics import encode_document

ARCH = dict(vocab_size=6144, hidden_size=384, num_hidden_layers=7, num_attention_heads=12,
            ffn_dim=1536, max_position_embeddings=512)
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # OPT's ids: pad 1, bos = eos = </s> 2
TRAIN_FILES = ["corpus/shakespeare.txt", "corpus/kjv.txt", "wikitext-2/train.txt"]
SEED = 1234


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    # Like OPT's tokenizer: every encoded text starts with </s>.
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A </s> $B",
                                                       special_tokens=[("</s>", 2)])
    return tok


def prepare(data: Path, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    texts = [(data / f).read_text(encoding="utf-8") for f in TRAIN_FILES]
    tok = build_tokenizer(texts, ARCH["vocab_size"])
    tok.save(str(work / "tokenizer.json"))
    train = np.concatenate([encode_document(tok, t) for t in texts])
    valid = encode_document(tok, (data / "wikitext-2/valid.txt").read_text(encoding="utf-8"))
    test = encode_document(tok, (data / "wikitext-2/test.txt").read_text(encoding="utf-8"))
    for name, arr in [("train", train), ("valid", valid), ("test", test)]:
        arr.tofile(work / f"{name}.u16")
    stats = {k: int(v.size) for k, v in [("train", train), ("valid", valid), ("test", test)]}
    write_json(work / "stats.json", stats, indent=1)
    print("tokens:", stats)


def _dropout_hooks(model, p: float):
    """Residual-branch dropout for training only, applied from outside the model class."""
    def hook(mod, inp, out):
        return F.dropout(out, p, mod.training)
    hs = []
    for layer in model.decoder.layers:
        hs.append(layer.self_attn.out_proj.register_forward_hook(hook))
        hs.append(layer.fc2.register_forward_hook(hook))
    return hs


def _init(model, n_layers: int) -> None:
    g = torch.Generator().manual_seed(SEED)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("out_proj.weight", "fc2.weight")) else 0.02
            p.data.copy_(torch.randn(p.shape, generator=g) * std)
        elif name.endswith("bias"):
            p.data.zero_()


@torch.no_grad()
def relu_zero_fraction(model, ids: torch.Tensor, window: int, max_windows: int = 32) -> list[float]:
    zeros = [0] * len(model.decoder.layers)
    total = [0] * len(model.decoder.layers)
    hooks = []
    for i, layer in enumerate(model.decoder.layers):
        def hook(mod, inp, out, i=i):
            zeros[i] += int((out == 0).sum())
            total[i] += out.numel()
        hooks.append(layer.activation_fn.register_forward_hook(hook))
    n = min(max_windows, ids.numel() // window)
    x = ids[: n * window].view(n, window)
    for j in range(0, n, 8):
        model(x[j:j + 8])
    for h in hooks:
        h.remove()
    return [z / t for z, t in zip(zeros, total)]


def save_hf_folder(model, cfg, tok_path: Path, out: Path, card: str, shard_bytes: int = 12_000_000) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in model.state_dict().items()
          if k != "lm_head.weight"}  # tied to embed_tokens
    shards, size = [[]], 0  # shards of at most `shard_bytes`, names in sorted order
    for k in sorted(sd):
        nbytes = sd[k].numel() * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: sd[k] for k in group}, str(out / fn), metadata={"format": "pt"})
        for k in group:
            weight_map[k] = fn
            total += sd[k].numel() * 2
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map},
               indent=1, sort_keys=True)
    write_json(out / "config.json", cfg.to_hf_dict(), indent=1, sort_keys=True)
    (out / "tokenizer.json").write_text(tok_path.read_text())
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": cfg.max_position_embeddings,
        "add_bos_token": True}, indent=1)
    write_json(out / "generation_config.json", {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}, indent=1)
    (out / "README.md").write_text(card)


def train(work: Path, out: Path, budget_s: float, batch: int, lr: float, epochs: float) -> dict:
    from dejavu.models.metrics import perplexity
    from dejavu.models.opt import OPTConfig, OPTForCausalLM

    torch.manual_seed(SEED)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for smoke tests
    cfg = OPTConfig(**ARCH, word_embed_proj_dim=ARCH["hidden_size"])
    model = OPTForCausalLM(cfg)
    _init(model, cfg.num_hidden_layers)
    model.to(dev)
    hooks = _dropout_hooks(model, 0.1)
    S = cfg.max_position_embeddings
    train_ids = torch.from_numpy(np.fromfile(work / "train.u16", dtype=np.uint16).astype(np.int64)).to(dev)
    valid_ids = torch.from_numpy(np.fromfile(work / "valid.u16", dtype=np.uint16).astype(np.int64))
    test_ids = torch.from_numpy(np.fromfile(work / "test.u16", dtype=np.uint16).astype(np.int64))
    max_steps = int(epochs * train_ids.numel() / (batch * S))
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() == 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=dev == "cuda")
    warm = 200
    g = torch.Generator(device=dev).manual_seed(SEED)
    offs = torch.arange(S + 1, device=dev)

    def lr_at(step: int, frac_time: float) -> float:
        prog = max(step / max_steps, frac_time)  # whichever budget runs out first sets the schedule
        return lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0))))

    def eval_loss(ids: torch.Tensor) -> float:
        model.eval()
        with torch.autocast(dev, torch.bfloat16):
            r = perplexity(lambda x: model(x.to(dev)), ids, S, batch=32)
        model.train()
        return r["nll"]

    t0 = time.time()
    step, seen, best, best_step, log = 0, 0, float("inf"), 0, []
    best_state = None
    model.train()
    while step < max_steps and time.time() - t0 < budget_s:
        starts = torch.randint(0, train_ids.numel() - S - 1, (batch,), device=dev, generator=g)
        chunk = train_ids[starts[:, None] + offs]  # [B, S+1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, (time.time() - t0) / budget_s)
        with torch.autocast(dev, torch.bfloat16):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch * S
        if step % 250 == 0 or step == max_steps:
            v = eval_loss(valid_ids)
            log.append({"step": step, "tokens": seen, "train_loss": loss.item(), "valid_nll": v,
                        "elapsed_s": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
            if v < best:
                best, best_step = v, step
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    for h in hooks:
        h.remove()
    if best_state is not None:
        model.load_state_dict(best_state)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file  # a raw copy first, in case anything below fails
    save_file({k: v.half().contiguous().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(out / "raw-state.safetensors"))
    # Evaluate exactly what ships: fp16 weights, computed in fp32.
    model = model.half().float().eval()
    with torch.no_grad():
        test = perplexity(lambda x: model(x.to(dev)), test_ids, S, batch=32)
        valid = perplexity(lambda x: model(x.to(dev)), valid_ids, S, batch=32)
        sparsity = relu_zero_fraction(model, test_ids.to(dev), S)
    result = {"params": sum(p.numel() for p in model.parameters()), "steps": step, "tokens_seen": seen,
              "train_tokens": int(train_ids.numel()), "best_valid_nll": best, "best_step": best_step,
              "wikitext2_valid_ppl": valid["perplexity"], "wikitext2_test_ppl": test["perplexity"],
              "test_tokens": test["tokens"], "relu_zero_fraction": sparsity, "log": log,
              "train_seconds": round(time.time() - t0, 1), "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "batch": batch, "lr": lr, "seed": SEED}
    save_hf_folder(model, cfg, work / "tokenizer.json", out, model_card(cfg, result))
    write_json(out / "training_log.json", result, indent=1)
    (out / "raw-state.safetensors").unlink()
    return result


def model_card(cfg, r: dict) -> str:
    rows = "\n".join(f"| {i} | {z:.3f} |" for i, z in enumerate(r["relu_zero_fraction"]))
    return f"""# opt-mini

The small OPT-architecture model that dejavu ships as its default build target and test
subject. Trained from scratch by `python -m dejavu.models.train_opt_mini` (seed {r['seed']}).

| | |
|---|---|
| architecture | OPT (pre-LayerNorm, ReLU MLP, learned positions offset 2, tied LM head) |
| layers / hidden / heads / ffn | {cfg.num_hidden_layers} / {cfg.hidden_size} / {cfg.num_attention_heads} / {cfg.ffn_dim} |
| max positions | {cfg.max_position_embeddings} |
| vocabulary | {cfg.vocab_size}, byte-level BPE trained with `tokenizers` on the training corpus |
| parameters | {r['params']:,} (embeddings tied) |
| weights | fp16, sharded safetensors (`model.safetensors.index.json`) |
| training data | Shakespeare (Project Gutenberg, public domain), King James Bible (public domain), WikiText-2 train (CC BY-SA 3.0): {r['train_tokens']:,} tokens |
| tokens seen | {r['tokens_seen']:,} ({r['steps']} steps of {r['batch']} x {cfg.max_position_embeddings}); the shipped weights are the checkpoint with the best validation loss, step {r['best_step']} ({r['best_step'] * r['batch'] * cfg.max_position_embeddings:,} tokens) |
| trained on | {r['gpu']}, {r['train_seconds']} s, torch {r['torch']}, bf16 autocast, AdamW lr {r['lr']}, residual dropout 0.1 |
| WikiText-2 valid perplexity | {r['wikitext2_valid_ppl']:.2f} |
| **WikiText-2 test perplexity** | **{r['wikitext2_test_ppl']:.2f}** |

Perplexity is per BPE token of this model's tokenizer (not comparable with word-level or
GPT-2-BPE perplexities), on the *tokenised* WikiText-2 release (`wiki.test.tokens`, with its
`<unk>` and ` @-@ ` markers, the same format as the training split), the file encoded as one
stream starting with `</s>`, cut into non-overlapping windows of {cfg.max_position_embeddings} tokens,
exp(mean NLL) over {r['test_tokens']:,} predicted tokens, fp16 weights computed in fp32.

## Contextual sparsity: fraction of ReLU outputs that are exactly zero (WikiText-2 test)

| layer | zero fraction |
|---|---|
{rows}

Licence of the weights: CC BY-SA 3.0 (trained on WikiText-2).
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--data", type=Path, default=Path("../shared/data"))
    p.add_argument("--work", type=Path, default=Path(".carry/optmini"))
    t = sub.add_parser("train")
    t.add_argument("--work", type=Path, default=Path(".carry/optmini"))
    t.add_argument("--out", type=Path, default=Path("models/opt-mini"))
    t.add_argument("--budget-s", type=float, default=240.0)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--epochs", type=float, default=12.0)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.data, a.work)
    else:
        r = train(a.work, a.out, a.budget_s, a.batch, a.lr, a.epochs)
        print(json.dumps({k: v for k, v in r.items() if k != "log"}, indent=1))


if __name__ == "__main__":
    main()
