"""Sparsity-aware distillation of a TEAL-sparse Llama-family model to its own dense outputs (CPU study).

    python benchmarks/llama_distill_study.py --sets norms --train skips:refined40 --steps 150 \
        --out benchmarks/results/llama_distill_2026-12-06.json

The TEAL masks stay as they are (per-layer thresholds fixed at the dense model's calibration,
masks recomputed every forward by `gated_sparsity`'s hooks, constants for autograd: the gradient
flows through the kept entries only), and a set of the model's parameters (--sets) is trained with
Adam to minimise KL(dense model's next-token distribution || sparse model's) on calibration text
(WikiText-2 *train*: the calibration file's tokens from --train-start on, never the held-out or
the evaluation text). The target is the dense model's own output, so this is not domain
adaptation; the trained model is also scored dense to show that it did not learn the text.
The shapes and the masks' rule are unchanged, so the bytes a token reads are the same.

After training the thresholds are calibrated again on the trained model (the first
--calib-tokens of the calibration file, the same targets), then scored on the held-out tokens
[--heldout) of the calibration file (where hyper-parameters are chosen) and on WikiText-2 test
(the first --ppl-tokens, windows of --window), the realized skip counted on the test text.

Trainable sets: norms (every RMSNorm weight: 2 per layer and the final one), norms+out (and
every o_proj / down_proj weight), all (every block weight and norm; the embedding / LM head stay).
Skip configurations (--train / --eval): "uniform:S" (every input kind at S) or "skips:NAME" with
NAME refined40 (33 / 45 / 31.25 / 60, the joint refinement's 40%) or refined25 (19 / 50 / 21.6 / 26.25).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

from dejavu.compiler.allocate_llama import heldout_nll, kind_thresholds
from dejavu.compiler.distill_llama import kl_to_dense
from dejavu.compiler.gated_sparsity import KEYS, GatedSparsity, calibrate, gated_sparsity
from dejavu.datafiles import CALIB_TEXT, WIKITEXT2_TEST
from dejavu.fileio import write_json
from dejavu.provenance import tree_commit
from dejavu.runtime.evaluation.evaluate import eval_perplexity, load_scoring_model, read_text, text_ids

NAMED = {"refined40": {"attn_in": 0.33, "o_in": 0.45, "mlp_in": 0.3125, "down_in": 0.6},
         "refined25": {"attn_in": 0.19, "o_in": 0.5, "mlp_in": 0.215625, "down_in": 0.2625}}
SETS = ("norms", "norms+out", "all")


def skips_of(spec: str) -> dict[str, float]:
    kind, _, v = spec.partition(":")
    if kind == "uniform":
        return {k: float(v) for k in KEYS}
    if kind == "skips" and v in NAMED:
        return NAMED[v]
    raise SystemExit(f"bad skip configuration {spec!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sets", nargs="+", default=["norms"], choices=SETS)
    p.add_argument("--train", default="skips:refined40", help="the skips the masks are trained at")
    p.add_argument("--eval", nargs="+", default=None, help="skip configurations scored (default: --train's)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=1, help="windows per step")
    p.add_argument("--train-window", type=int, default=256)
    p.add_argument("--train-start", type=int, default=16384, help="first calibration-file token of the training text")
    p.add_argument("--lr-norm", type=float, default=1e-3)
    p.add_argument("--lr-weight", type=float, default=1e-5)
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="the learning rates over the steps (cosine: to 0 at the last step)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps, log the held-out NLL at the training thresholds (0: never)")
    p.add_argument("--score-every", type=int, default=0, metavar="N",
                   help="every N steps (before the last), also score the model as it is: thresholds re-calibrated, "
                        "held-out NLL and test perplexity at --train's skips, logged (0: never)")
    p.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                   help="also score an exponential moving average of the trained weights (0: none)")
    p.add_argument("--hidden-weight", type=float, default=0.0, metavar="W",
                   help="add W x the mean over layers of |h_sparse - h_dense|^2 / |h_dense|^2 (each block's output)")
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--calib-cache", metavar="FILE", help="the dense model's calibration: load from FILE, else save")
    p.add_argument("--heldout", nargs=2, type=int, default=[8192, 10240], metavar=("FROM", "TO"))
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also score the untrained model at the --eval skips")
    p.add_argument("--save", metavar="FILE", help="save the trained parameters (torch.save) there")
    p.add_argument("--load", nargs="+", metavar="FILE",
                   help="skip training: load trained parameters saved by --save (several: their mean, a model soup)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model trains and is scored: cpu | cuda | cuda:N")
    p.add_argument("--train-text", metavar="FILE",
                   help="the training windows' text (default: the calibration file); it must begin with the "
                        "calibration file's text, so --train-start and --heldout name the same tokens")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def trainable(model, which: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of set `which` (see module doc), by name."""
    out = []
    for name, prm in model.named_parameters():
        norm = name.endswith("layernorm.weight") or name == "model.norm.weight"
        out_w = name.endswith(("o_proj.weight", "down_proj.weight"))
        block = ".layers." in name
        if norm or (which == "norms+out" and out_w) or (which == "all" and block):
            out.append((name, prm))
    return out


class BlockOutputs:
    """Forward hooks that keep every decoder block's output (the residual stream after it)."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(lambda m, a, o: self.out.append(o)) for layer in model.layers]

    def close(self):
        for h in self.handles:
            h.remove()


def kl_dense_sparse(teacher, student, thresholds, ids: torch.Tensor, hidden_weight: float = 0.0) -> torch.Tensor:
    """Mean over tokens of KL(p_dense || p_sparse) for windows ids [B, S] (student with the masks),
    plus hidden_weight x the mean over blocks and tokens of the relative squared error of each
    block's output against the dense model's."""
    if not hidden_weight:
        return kl_to_dense(teacher, student, thresholds, ids)
    hooks = (BlockOutputs(teacher), BlockOutputs(student))
    try:
        loss = kl_to_dense(teacher, student, thresholds, ids)
        rel = [((hs.float() - ht.float()).pow(2).sum(-1) / ht.float().pow(2).sum(-1)).mean()
               for ht, hs in zip(hooks[0].out, hooks[1].out)]
        return loss + hidden_weight * torch.stack(rel).mean()
    finally:
        for h in hooks:
            h.close()


def train(teacher, model, params, thresholds, windows: torch.Tensor, args, log: list, heldout=None,
          ema: list | None = None, score_at=None, save=None) -> float:
    """Adam on params for args.steps steps of args.batch windows; returns seconds. With
    args.eval_every, log [step, "heldout", NLL at `thresholds`] every that many steps; with `ema`
    (copies of params), move it towards the parameters after every step (decay args.ema). With
    args.score_every, score_at(model) is logged every that many steps, then save() writes the file."""
    norms = [p for n, p in params if p.dim() == 1]
    mats = [p for n, p in params if p.dim() > 1]
    groups = [{"params": norms, "lr": args.lr_norm}] + ([{"params": mats, "lr": args.lr_weight}] if mats else [])
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps) if args.schedule == "cosine" else None
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in params:
        p.requires_grad_(True)
    t0 = time.perf_counter()
    for step in range(args.steps):
        i = step * args.batch % windows.shape[0]
        loss = kl_dense_sparse(teacher, model, thresholds, windows[i:i + args.batch], args.hidden_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        if ema is not None:
            with torch.no_grad():
                for (_, p), e in zip(params, ema):
                    e.lerp_(p, 1 - args.ema)
        if score_at is not None and args.score_every and (step + 1) % args.score_every == 0 \
                and step + 1 < args.steps:
            row = score_at(model)
            log.append([step + 1, "scored", row])
            print(f"step {step + 1} scored {json.dumps(row)}", flush=True)
            if save is not None:
                save()
        if args.eval_every and heldout is not None and (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                nll = heldout_nll(model, heldout, thresholds)
            log.append([step + 1, "heldout", round(nll, 5)])
            print(f"step {step + 1} held-out NLL {nll:.5f}", flush=True)
        if step % 10 == 0 or step == args.steps - 1:
            log.append([step, round(float(loss.detach()), 5), round(time.perf_counter() - t0, 1)])
            print(f"step {step} kl {float(loss.detach()):.5f} {time.perf_counter() - t0:.0f}s", flush=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return time.perf_counter() - t0


def windows_of(ids: torch.Tensor, w: int) -> torch.Tensor:
    return ids[:ids.numel() // w * w].view(-1, w)


@torch.no_grad()
def score(sm, model, calib, skips, heldout, test_text, args) -> dict:
    """Held-out NLL (sparse) and test perplexity with its realized skip, thresholds from calib."""
    t = kind_thresholds(calib, skips)
    row = {"heldout_nll": round(heldout_nll(model, heldout, t), 5)}
    with gated_sparsity(model, t, GatedSparsity()) as reads:
        r = eval_perplexity(sm, test_text, args.window, args.ppl_tokens, batch=8, progress=False)
    row.update(perplexity=round(r["perplexity"], 4), ppl_tokens=r["tokens"], realized_skip=round(reads.skipped, 4))
    return row


@torch.no_grad()
def dense_scores(sm, model, heldout, test_text, args) -> dict:
    r = eval_perplexity(sm, test_text, args.window, args.ppl_tokens, batch=8, progress=False)
    return {"heldout_nll": round(heldout_nll(model, heldout), 5), "perplexity": round(r["perplexity"], 4),
            "ppl_tokens": r["tokens"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sm = load_scoring_model(args.model, device=args.device)
    model = sm.info["model"]
    teacher = copy.deepcopy(model).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    text = read_text(CALIB_TEXT)
    if args.train_text:
        train_text = read_text(args.train_text)
        if not train_text.startswith(text):
            raise SystemExit(f"--train-text {args.train_text} does not begin with the calibration file's text")
        text = train_text
    need = max(args.heldout[1], args.train_start + args.steps * args.batch * args.train_window)
    ids = text_ids(sm, text, need + 1).to(args.device)
    calib_ids = windows_of(ids[:args.calib_tokens], args.window)
    heldout = windows_of(ids[args.heldout[0]:args.heldout[1]], args.window)
    train_windows = windows_of(ids[args.train_start:], args.train_window)
    if train_windows.shape[0] < args.steps * args.batch:
        print(f"note: {train_windows.shape[0]} training windows for {args.steps * args.batch}: they repeat", flush=True)
    test_text = read_text(WIKITEXT2_TEST)
    res = {"model": args.model, "commit": tree_commit(Path(__file__)), "machine": platform.node(), "argv": vars(args),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "train_tokens": [args.train_start, args.train_start + args.steps * args.batch * args.train_window],
           "runs": []}

    def save():
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, res, indent=2)

    cache = Path(args.calib_cache) if args.calib_cache else None
    if cache is not None and cache.is_file():
        calib0 = torch.load(cache, weights_only=False)
    else:
        calib0 = calibrate(model, calib_ids)
        if cache is not None:
            torch.save(calib0, cache)
    evals = args.eval or [args.train]
    if args.baseline:
        res["runs"].append({"run": "untrained", "dense": dense_scores(sm, model, heldout, test_text, args),
                            **{e: score(sm, model, calib0, skips_of(e), heldout, test_text, args) for e in evals}})
        print(json.dumps(res["runs"][-1]), flush=True)
        save()
    for which in args.sets:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])
        params = trainable(model, which)
        row = {"run": f"distill[{which}]@{args.train}", "set": which, "train": args.train,
               "params": sum(p.numel() for _, p in params), "log": []}
        res["runs"].append(row)
        if args.load:
            states = [torch.load(f) for f in args.load]
            with torch.no_grad():
                for n, p in params:
                    p.copy_(sum(st[n] for st in states) / len(states))
            row["loaded"] = args.load
        else:
            t = kind_thresholds(calib0, skips_of(args.train))
            ema = [p.detach().clone() for _, p in params] if args.ema else None
            def score_at(m):  # the model mid-training, thresholds re-calibrated (grad off for the scoring)
                with torch.no_grad():
                    return score(sm, m, calibrate(m, calib_ids), skips_of(args.train), heldout, test_text, args)

            row["train_seconds"] = round(train(teacher, model, params, t, train_windows, args, row["log"], heldout,
                                               ema, score_at, save), 1)
            if args.save:
                torch.save({n: p.detach().clone() for n, p in params}, args.save)
        scored = [(row, None)]
        if not args.load and args.ema:
            avg = {"run": row["run"] + f" ema{args.ema}", "set": which, "train": args.train, "ema": args.ema}
            res["runs"].append(avg)
            scored.append((avg, ema))
        for r, weights in scored:
            if weights is not None:
                with torch.no_grad():
                    for (_, p), e in zip(params, weights):
                        p.copy_(e)
            t0 = time.perf_counter()
            calib = calibrate(model, calib_ids)
            r["recalib_seconds"] = round(time.perf_counter() - t0, 1)
            r["dense"] = dense_scores(sm, model, heldout, test_text, args)
            for e in evals:
                r[e] = score(sm, model, calib, skips_of(e), heldout, test_text, args)
                r[e + " (dense thresholds)"] = score(sm, model, calib0, skips_of(e), heldout, test_text, args)
            print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
            save()


if __name__ == "__main__":
    main()
