"""A Llama engine against the simulation it implements, on WikiText-2 test text.

    python benchmarks/llama_engine_check.py smollm2.engine --model smollm2-135m --tokens 1024 --window 512 \
        --out check.json

Perplexity over the same windows of: the dense model (fp32), compiler/gated_sparsity's hooks on
it with the engine's thresholds (the simulation), and the engine (`Engine.logits`: each token
thresholded on its own inputs; the engine's weights as stored, run in fp32 on the CPU). An
engine built with --rotate-keep holds the rotated model's thresholds: the simulation rotates the
model first, on the engine's rotation windows (rebuilt from its build settings). An engine built
with --distill-steps holds trained weights: the source model's simulation does not apply to it and
is left out (null); dense stays the source model, the reference the engine is measured against. A
thresholded model is discontinuous at its thresholds (an input a rounding away from one flips),
so engine and simulation agree in perplexity, not logit for logit, once the engine's weights
are rounded to fp16. Writes raw JSON; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    # logits [W, S, V], ids [W, S]: each window scores its tokens 1..S-1
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                            ids[:, 1:].reshape(-1))
    return math.exp(float(nll))


def rotate_as_built(model, tok, build_config: dict) -> None:
    """In place: the rotation the build applied (compiler/rotate_llama.py), on its rotation windows
    (engines built before the rotation had its own tokens: the calibration windows); exits if they
    are not the recorded ones (fingerprint)."""
    from dejavu.compiler.build_llama import calibration_windows
    from dejavu.compiler.config import BuildConfig
    from dejavu.compiler.rotate_llama import rotate_llama
    from dejavu.compiler.text import fingerprint_tokens

    config = BuildConfig.from_dict({**build_config["settings"], "device": "cpu"})
    rec = build_config["calibration"]
    own = "rotation_fingerprint" in rec
    ids, _ = calibration_windows(model.config, tok, config, rotation=own)
    if fingerprint_tokens(ids.numpy().reshape(-1)) != rec["rotation_fingerprint" if own else "tokens_fingerprint"]:
        sys.exit("the rotation windows rebuilt from the engine's build settings are not the recorded ones")
    rotate_llama(model, ids, config.rotate_keep)


class counted_reads:
    """Within: the engine's masked-dense projections (runtime/llama_decoder.linear_ref) count the weights they
    would read; `skipped` the fraction of the block weights left unread (realized on the text run)."""

    def __enter__(self):
        from dejavu.plugins.input_sparse import produce_ref
        from dejavu.runtime import llama_decoder as D

        self.read = self.dense = 0.0
        self._mod, self._orig = D, D.linear_ref

        def counting(x, w_t, t, norm=None, swiglu=False, residual=None):
            h = produce_ref(x, *(norm or (None, 0.0)), swiglu=swiglu)
            self.read += (float((h.float().abs() > t).float().mean()) if t > 0 else 1.0) * w_t.numel()
            self.dense += w_t.numel()
            return self._orig(x, w_t, t, norm, swiglu, residual)

        D.linear_ref = counting
        return self

    def __exit__(self, *exc):
        self._mod.linear_ref = self._orig

    @property
    def skipped(self) -> float:
        return 1.0 - self.read / self.dense


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("--model", required=True, help="the model the engine was compiled from (preset, folder, .gguf)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    a = p.parse_args(argv)
    import dejavu
    from dejavu.compiler.gated_sparsity import GatedSparsity, gated_sparsity
    from dejavu.fileio import write_json
    from dejavu.models.auto import load_llama, load_text_tokenizer
    from dejavu.runtime import Engine

    eng = Engine.load(a.engine, dtype="float32")
    model, _ = load_llama(a.model)
    tok = load_text_tokenizer(a.model)
    text = (Path(dejavu.__file__).parent / "data" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok.encode(text[: 40 * a.tokens], add_bos=True)[: a.tokens // a.window * a.window]).view(-1, a.window)
    sp = eng.header["sparsity"]
    calib = sp["thresholds"]  # the engine's thresholds, {key: [L]}
    keep = eng.header["build_config"]["calibration"].get("rotate_keep")
    distilled = eng.header["build_config"]["settings"].get("distill_steps", 0) > 0
    sim = skipped = None  # a distilled engine's weights are not the source model's: no simulation of them here
    with torch.no_grad():
        dense = perplexity(model(ids), ids)
        if keep is not None and not distilled:
            rotate_as_built(model, tok, eng.header["build_config"])
        if not distilled:
            with gated_sparsity(model, calib, GatedSparsity(skip=sp["skip"])) as reads:
                sim = perplexity(model(ids), ids)
            skipped = reads.skipped
    with counted_reads() as engine_reads:
        engine = perplexity(eng.logits(ids), ids)
    res = {"engine": Path(a.engine).name, "model": a.model, "engine_dtype": eng.header["dtype"],
           "density": eng.header["build_config"]["density"], "skip": sp["skip"],
           "windows": ids.shape[0], "window": a.window, "scored_tokens": ids.shape[0] * (a.window - 1),
           "text": "dejavu/data/wikitext-2/test.txt", "ppl_dense": dense, "ppl_simulation": sim,
           "ppl_engine": engine, "skip_realized_simulation": skipped, "skip_realized_engine": engine_reads.skipped,
           "rotate_keep": keep,
           "distilled": distilled}
    print(json.dumps(res, indent=1))
    if a.out:
        write_json(a.out, res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
