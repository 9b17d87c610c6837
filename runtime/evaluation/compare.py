"""`dejavu-compare`: an engine's logits against the dense model, through Polygraphy.

    dejavu-compare opt-mini-0.3.engine                    # the dense model the header names
    dejavu-compare opt-mini-1.0-fp32.engine --exact       # density 1.0, float32: element-wise
    dejavu-compare opt-mini-0.3.engine --onnx-dir build/onnx --max-kl 0.05 --top1-min 0.9

Runners (`dejavu.runtime.evaluation.polygraphy_runners`), fed the same real text (WikiText-2 test by
default, tokenised with the engine's tokenizer):

    dense-torch  the dense PyTorch model (reference)
    dense-onnx   ONNX Runtime on the dense ONNX in --onnx-dir (when present)
    engine       the engine's token-parallel sparse logits
    sparse-onnx  ONNX Runtime on the sparse ONNX in --onnx-dir (when present)

Comparisons: dense-torch vs engine, dense-torch vs dense-onnx, engine vs sparse-onnx.

A sparse engine is not meant to reproduce the dense logits element by element, so engine vs
dense-torch is gated on what sparsity is allowed to change and a fault is not: the mean
per-token KL divergence KL(dense || engine) of the next-token distributions (`--max-kl`) and
top-1 token agreement (`--top1-min`), over `--samples` x `--tokens` positions (defaults:
8 x 256 = 2048, a top-1 standard error near 0.005). The perplexity change on the same text
is printed, and so is the accuracy the engine recorded at build where its header has one.
`--exact` gates engine vs dense-torch like the ONNX comparisons always are (for a density-1.0
engine in float32: a float16 engine's weights alone move opt-mini's logits by up to 0.03): Polygraphy `Comparator.compare_accuracy` with `SimpleCompareFunc`
on `logits` and `logprobs` (log-softmax, shift-invariant), each with its own tolerances
(`--atol` / `--rtol`, per output as `--atol logprobs:0.5`), the statistic `--check-error-stat`,
and top-1 agreement >= `--exact-top1-min`. Exit status: 0 all pass, 1 an accuracy failure,
2 a usage error.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from dejavu.cli_common import Parser, add_device, add_dtype
from dejavu.errors import DejavuError, cli_entry

OUTPUTS = ("logits", "logprobs")


@dataclass
class CompareSettings:
    """Defaults of dejavu-compare (the CLI reads them from here)."""

    # The sparse gate (engine vs dense-torch): a fault or an unusable engine fails, a good sparse
    # engine passes with room. opt-mini, 8 x 256 tokens of WikiText-2 test (docs/accuracy.md):
    # README engine (MLP 0.3, heads 1.0) KL 0.015, top-1 0.937, perplexity +0.73%; the same with
    # heads 4 of 12 KL 0.70, top-1 0.571, +77.8%; MLP predictor outputs permuted (a layout
    # fault) KL 1.47, top-1 0.369; density 1.0 in float16 KL 0.0000, top-1 0.998. KL 0.1 nats
    # is roughly a +10% perplexity: what dejavu-eval measures finer.
    max_kl: float = 0.1  # mean per-token KL(dense || engine), nats
    top1_min: float = 0.85  # fraction of positions whose argmax token equals the reference's
    # --exact (density 1.0, and the ONNX comparisons): Polygraphy element-wise tolerances
    atol: float = 1e-3
    rtol: float = 1e-3
    check_error_stat: str = "max"  # Polygraphy: max | mean | median | elemwise
    exact_top1_min: float = 0.99
    tokens: int = 256  # tokens per sample (clamped to the model's positions)
    samples: int = 8
    device: str = "cpu"
    exact: bool = False  # True: element-wise tolerances for engine vs dense too
    dtype: str | None = None  # run both in this dtype (None: the engine's own, float32 for the dense model)


def parse_tolerance(values: list[str] | None, default: float, flag: str) -> dict[str, float]:
    """`--atol 1e-3 --atol logprobs:0.5` -> {"": 1e-3, "logprobs": 0.5} (Polygraphy's syntax)."""
    out = {"": default}
    for v in values or []:
        name, _, num = v.rpartition(":")
        if name and name not in OUTPUTS:
            raise DejavuError(f"{flag}: unknown output {name!r} (outputs: {', '.join(OUTPUTS)})")
        try:
            tol = float(num)
        except ValueError:
            raise DejavuError(f"{flag}: {v!r} is not [OUTPUT:]NUMBER") from None
        if tol < 0:
            raise DejavuError(f"{flag}: tolerance must be >= 0, got {tol}")
        out[name] = tol
    return out


def source_model(header: dict) -> str | None:
    """The dense model an engine was built from, if the header records it."""
    bc = header.get("build_config") or {}
    for d in (bc, header):
        for key in ("source_model", "model", "model_name", "model_path"):
            if isinstance(d.get(key), str) and d[key]:
                return d[key]
    return None


def dense_from_header(header: dict) -> str:
    """The dense model to compare with, from the header: a preset, a hub id or a path that exists
    here. An engine built from a folder records only the folder's base name (no local paths in
    the file), which names nothing on its own: then --dense is needed, said in one line."""
    from dejavu.models.presets import GGUF_PRESETS, PRESETS

    name = source_model(header)
    if name is None:
        raise DejavuError("the engine header does not name its dense model; pass --dense MODEL")
    if name in PRESETS or name in GGUF_PRESETS or Path(name).expanduser().exists() or name.count("/") == 1:
        return name
    raise DejavuError(f"the engine records its dense model as {name!r} (a folder's base name), which is "
                      "neither a preset nor a path here; pass --dense MODEL")


def find_onnx(folder: str | None) -> tuple[Path | None, Path | None]:
    """(dense, sparse) full-sequence ONNX graphs of an --onnx-dir.

    dejavu-compile --onnx-out writes prefill.onnx (dense), prefill.sparse.onnx (form (a),
    standard ops), prefill.plugin.onnx (custom ops: not runnable in plain ONNX Runtime) and
    the decode-step graphs; other names: *dense*.onnx and *sparse*.onnx."""
    if folder is None:
        return None, None
    d = Path(folder)
    if not d.is_dir():
        raise DejavuError(f"--onnx-dir: not a folder: {d}")
    files = [f for f in sorted(d.glob("*.onnx")) if "decode" not in f.name and "plugin" not in f.name]
    dense = [f for f in files if "sparse" not in f.name]
    sparse = [f for f in files if "sparse" in f.name]
    pick = lambda fs: min(fs, key=lambda f: ("prefill" not in f.name, "dense" not in f.name, f.name))  # noqa: E731
    if not dense and not sparse:
        raise DejavuError(f"--onnx-dir {d}: no prefill.onnx / prefill.sparse.onnx (or *dense*.onnx / *sparse*.onnx)")
    return (pick(dense) if dense else None), (pick(sparse) if sparse else None)


def sample_feeds(tokenizer, text: str, tokens: int, samples: int) -> list[dict]:
    """`samples` consecutive windows of `tokens` ids from the text: [{"input_ids": [1, S]}]."""
    import numpy as np

    from dejavu.models.metrics import encode_document

    head = text[: 64 * tokens * samples]
    ids = encode_document(tokenizer.tokenizer, head[: head.rfind("\n") + 1] or head).astype("int64").tolist()
    ids[0] = tokenizer.bos_id  # line by line, as dejavu-eval's perplexity (and opt-mini's training)
    if len(ids) < tokens * samples:
        raise DejavuError(f"the comparison text has {len(ids)} tokens, fewer than "
                          f"--tokens x --samples = {tokens * samples}")
    return [{"input_ids": np.asarray(ids[i * tokens:(i + 1) * tokens], dtype=np.int64)[None]}
            for i in range(samples)]


class _WithLogprobs:
    """Wrap a runner so it also returns log_softmax(logits) as `logprobs`."""

    @staticmethod
    def add(outputs: dict) -> dict:
        import numpy as np

        x = outputs["logits"].astype(np.float64)
        m = x.max(-1, keepdims=True)
        lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
        outputs["logprobs"] = (x - lse).astype(np.float32)
        return outputs


def _runner_classes():
    """Runner subclasses that add the logprobs output (Polygraphy imported only here)."""
    from dejavu.runtime.evaluation import polygraphy_runners as pr

    def with_logprobs(cls):
        class Runner(cls):
            def infer_impl(self, feed_dict):
                return _WithLogprobs.add(dict(super().infer_impl(feed_dict)))

        Runner.__name__ = cls.__name__
        return Runner

    return (with_logprobs(pr.DenseTorchRunner), with_logprobs(pr.EngineRunner),
            with_logprobs(pr.OnnxLogitsRunner))


def top1_agreement(ref_iters, test_iters) -> float:
    """Fraction of positions where the argmax of `logits` agrees (over all iterations)."""
    import numpy as np

    same = total = 0
    for a, b in zip(ref_iters, test_iters):
        ta, tb = np.asarray(a["logits"]).argmax(-1), np.asarray(b["logits"]).argmax(-1)
        same += int((ta == tb).sum())
        total += ta.size
    return same / max(total, 1)


def divergence(ref_iters, test_iters, feeds) -> dict:
    """Mean per-token KL(ref || test) of the next-token distributions (nats), and the mean NLL
    of the text's next tokens under each (their difference = log of the perplexity ratio)."""
    import numpy as np

    kl = nll_ref = nll_test = 0.0
    n = 0
    for a, b, feed in zip(ref_iters, test_iters, feeds):
        la = np.asarray(a["logprobs"], dtype=np.float64)[0]  # [S, V]
        lb = np.asarray(b["logprobs"], dtype=np.float64)[0]
        kl += float((np.exp(la) * (la - lb)).sum(-1).sum())
        n += la.shape[0]
        nxt = np.asarray(feed["input_ids"])[0, 1:]
        rows = np.arange(nxt.size)
        nll_ref -= float(la[rows, nxt].sum())
        nll_test -= float(lb[rows, nxt].sum())
    m = max(sum(np.asarray(f["input_ids"]).shape[1] - 1 for f in feeds), 1)
    return {"kl_mean": kl / max(n, 1), "nll_reference": nll_ref / m, "nll_test": nll_test / m,
            "ppl_increase": float(np.exp((nll_test - nll_ref) / m) - 1.0)}


def recorded_accuracy(header: dict) -> dict | None:
    """The accuracy an engine recorded at build (`build_config.accuracy`, a JSON object), if any."""
    acc = (header.get("build_config") or {}).get("accuracy")
    return acc if isinstance(acc, dict) and acc else None


def run_comparison(engine_path: str, dense: str, onnx_dir: str | None, s: CompareSettings,
                   atol: dict, rtol: dict, text: str) -> dict:
    """Run every runner on the same feeds; compare through Polygraphy; return a report dict."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    from dejavu.engine_file import read_header
    from dejavu.models.tokenizer import TextTokenizer

    header = read_header(engine_path)
    mc = header.get("model_config", {})
    tok = TextTokenizer(header["tokenizer_json"], mc.get("bos_token_id"), mc.get("eos_token_id"),
                        mc.get("pad_token_id"))
    tokens = min(s.tokens, int(mc.get("max_position_embeddings", s.tokens)))
    feeds = sample_feeds(tok, text, tokens, s.samples)

    Dense, Engine, Onnx = _runner_classes()
    runners = [Dense(dense, s.device, name="dense-torch", dtype=s.dtype),
               Engine(engine_path, s.device, name="engine", dtype=s.dtype)]
    dense_onnx, sparse_onnx = find_onnx(onnx_dir)
    comparisons = [(0, 1)]
    if dense_onnx is not None:
        runners.append(Onnx(str(dense_onnx), name="dense-onnx"))
        comparisons.append((0, len(runners) - 1))
    if sparse_onnx is not None:
        runners.append(Onnx(str(sparse_onnx), name="sparse-onnx"))
        comparisons.append((1, len(runners) - 1))

    G_LOGGER.module_severity = G_LOGGER.WARNING
    with contextlib.redirect_stdout(sys.stderr):  # Polygraphy's log on stderr; stdout = our report
        results = Comparator.run(runners, data_loader=feeds)
        func = SimpleCompareFunc(atol=atol, rtol=rtol, check_error_stat=s.check_error_stat)
        acc = Comparator.compare_accuracy(results, comparisons=comparisons, compare_func=func)
    if not hasattr(acc, "keys"):  # Polygraphy >= 0.53: a list with one AccuracyResult per compare func
        acc = acc[0]

    exact = s.exact
    report = {"engine": engine_path, "dense": dense, "tokens": tokens, "samples": s.samples,
              "density": (header.get("build_config") or {}).get("density"),
              "mode": "exact" if exact else "sparse", "recorded_accuracy": recorded_accuracy(header),
              "atol": atol, "rtol": rtol, "check_error_stat": s.check_error_stat,
              "max_kl": s.max_kl, "top1_min": s.top1_min, "exact_top1_min": s.exact_top1_min,
              "comparisons": []}
    ok_all = True
    for i, j in comparisons:
        (ref_name, ref_iters), (test_name, test_iters) = results[i], results[j]
        per_out = {}
        for it in acc[(ref_name, test_name)]:
            for out, res in it.items():
                d = per_out.setdefault(out, {"passed": True, "max_absdiff": 0.0, "mean_absdiff": 0.0,
                                             "max_reldiff": 0.0})
                d["passed"] &= bool(res)
                d["max_absdiff"] = max(d["max_absdiff"], res.max_absdiff)
                d["max_reldiff"] = max(d["max_reldiff"], res.max_reldiff)
                d["mean_absdiff"] = max(d["mean_absdiff"], res.mean_absdiff)
        top1 = top1_agreement(ref_iters, test_iters)
        div = divergence(ref_iters, test_iters, feeds)
        sparse_gate = test_name == "engine" and not exact  # engine vs dense-torch of a sparse engine
        if sparse_gate:
            ok = div["kl_mean"] <= s.max_kl and top1 >= s.top1_min
        else:
            ok = all(d["passed"] for d in per_out.values()) and top1 >= s.exact_top1_min
        ok_all &= ok
        report["comparisons"].append({"reference": ref_name, "test": test_name, "passed": ok,
                                      "gate": "sparse" if sparse_gate else "exact",
                                      "top1_agreement": top1, **div, "outputs": per_out})
    report["passed"] = ok_all
    return report


def format_report(r: dict) -> str:
    lines = [f"dejavu-compare: {r['engine']} (density {r['density']}) vs {r['dense']}, "
             f"{r['samples']} x {r['tokens']} tokens, mode {r['mode']}"]
    if r.get("recorded_accuracy"):
        lines.append(f"  recorded at build: {json.dumps(r['recorded_accuracy'], sort_keys=True)}")
    for c in r["comparisons"]:
        head = f"  {c['test']} vs {c['reference']}: {'PASS' if c['passed'] else 'FAIL'}"
        if c["gate"] == "sparse":
            lines.append(f"{head}  checked: mean KL {c['kl_mean']:.4f} nats (max {r['max_kl']}), "
                         f"top-1 agreement {c['top1_agreement']:.4f} (min {r['top1_min']})")
        else:
            lines.append(f"{head}  checked: {r['check_error_stat']} |diff| <= atol or {r['check_error_stat']} "
                         f"rel diff <= rtol per output, top-1 agreement {c['top1_agreement']:.4f} "
                         f"(min {r['exact_top1_min']})")
        lines.append(f"    perplexity {100 * c['ppl_increase']:+.2f}% vs the reference on this text, "
                     f"mean KL {c['kl_mean']:.4f} nats")
        for out, d in c["outputs"].items():
            at, rt = r["atol"].get(out, r["atol"][""]), r["rtol"].get(out, r["rtol"][""])
            verdict = ("ok  " if d["passed"] else "FAIL") if c["gate"] == "exact" else "info"
            lines.append(f"    {out:9s} {verdict} max|diff| {d['max_absdiff']:.3g} "
                         f"mean|diff| {d['mean_absdiff']:.3g} max rel {d['max_reldiff']:.3g} "
                         + (f"(atol {at:g}, rtol {rt:g})" if c["gate"] == "exact" else "(not gated; --exact)"))
    lines.append("PASSED" if r["passed"] else "FAILED")
    return "\n".join(lines)


def build_parser() -> Parser:
    d = CompareSettings()
    p = Parser("dejavu-compare",
               "Compare an engine with its dense model through Polygraphy (exit 0 pass, 1 accuracy failure, "
               "2 usage error). Engine vs dense is gated on mean KL divergence and top-1 agreement; "
               "--exact gates it on element-wise tolerances (a density-1.0 float32 engine).")
    p.add_argument("engine", metavar="FILE.engine", help="the engine to check")
    p.add_argument("--dense", metavar="MODEL",
                   help="dense model (preset, folder or hub id); default: the one the engine header names")
    p.add_argument("--onnx-dir", metavar="DIR", help="folder with *dense*.onnx and/or *sparse*.onnx")
    p.add_argument("--max-kl", type=float, default=d.max_kl, metavar="NATS",
                   help="sparse gate: largest mean per-token KL(dense || engine)")
    p.add_argument("--top1-min", type=float, default=d.top1_min, metavar="F",
                   help="sparse gate: smallest top-1 token agreement with the dense model")
    p.add_argument("--exact", action="store_true",
                   help="gate engine vs dense element-wise (Polygraphy tolerances): for a density-1.0 float32 "
                        "engine")
    p.add_argument("--atol", action="append", metavar="[OUT:]TOL",
                   help=f"exact gate: absolute tolerance, per output with OUT: ({', '.join(OUTPUTS)}) "
                        f"(default: {d.atol})")
    p.add_argument("--rtol", action="append", metavar="[OUT:]TOL",
                   help=f"exact gate: relative tolerance (default: {d.rtol})")
    p.add_argument("--check-error-stat", default=d.check_error_stat, choices=["max", "mean", "median", "elemwise"],
                   help="exact gate: the error statistic that must be within tolerance")
    p.add_argument("--exact-top1-min", type=float, default=d.exact_top1_min, metavar="F",
                   help="exact gate: smallest top-1 token agreement")
    p.add_argument("--tokens", type=int, default=d.tokens, metavar="N",
                   help="tokens per sample (clamped to the model's positions)")
    p.add_argument("--samples", type=int, default=d.samples, metavar="N", help="number of text samples")
    p.add_argument("--text", metavar="FILE", help="UTF-8 text to feed (default: the shipped WikiText-2 test)")
    add_device(p, d.device)
    add_dtype(p, d.dtype, "run the engine and the dense model in this dtype (default: the engine's own, "
              "float32 for the dense model), e.g. float32 for a float16 engine on the CPU")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.engine).is_file():
        raise DejavuError(f"engine file not found: {args.engine}")
    for flag, v in (("--top1-min", args.top1_min), ("--exact-top1-min", args.exact_top1_min)):
        if not 0.0 <= v <= 1.0:
            raise DejavuError(f"{flag} must be in [0, 1], got {v}")
    if not args.max_kl >= 0:
        raise DejavuError(f"--max-kl must be >= 0, got {args.max_kl}")
    if args.tokens < 2 or args.samples < 1:
        raise DejavuError("--tokens must be >= 2 and --samples >= 1")
    s = CompareSettings(max_kl=args.max_kl, top1_min=args.top1_min, exact_top1_min=args.exact_top1_min,
                        tokens=args.tokens, samples=args.samples, check_error_stat=args.check_error_stat,
                        device=args.device, exact=args.exact, dtype=args.dtype)
    atol = parse_tolerance(args.atol, s.atol, "--atol")
    rtol = parse_tolerance(args.rtol, s.rtol, "--rtol")
    from dejavu.engine_file import read_header
    from dejavu.datafiles import WIKITEXT2_TEST
    from dejavu.runtime.evaluation.evaluate import read_text

    dense = args.dense or dense_from_header(read_header(args.engine))
    text = read_text(args.text or WIKITEXT2_TEST)
    report = run_comparison(args.engine, dense, args.onnx_dir, s, atol, rtol, text)
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_report(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
