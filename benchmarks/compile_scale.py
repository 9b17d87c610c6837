"""dejavu-compile at real OPT shapes: wall time per stage, peak host / GPU memory, bytes on disk.

For each shape: writes a random-weight checkpoint of the real OPT dimensions (Hugging Face
layout, sharded fp16 safetensors + index, opt-mini's tokenizer files), runs the real CLI
(`python -m dejavu.compiler.cli`) in a child process and records the child's peak resident
set (VmHWM, from the summary; wait4's ru_maxrss too), the summary's stage seconds and peak GPU memory, engine bytes and
the build state's bytes. Writes OUT/compile_scale.json (raw), OUT/compile_scale.md (table)
and OUT/compile_scale.png (matplotlib, when installed). Asserts nothing.

    python benchmarks/compile_scale.py --shapes 125m,1.3b --out results/compile_scale \\
        --calib-tokens 2048 --predictor-epochs 1
    # on a GPU box, end to end (compile on cuda, then decode from the engine):
    python benchmarks/compile_scale.py --shapes 13b --device cuda --calib-tokens 65536 \\
        --decode-tokens 16 --work /scratch/ckpt --out results/compile_scale_h200

Random weights give random activations: the memory and time figures are those of the real
shapes, the predictor recall is not meaningful.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name: (hidden, layers, heads, ffn); vocab 50272, 2048 positions (the released OPT configs)
SHAPES = {"125m": (768, 12, 12, 3072), "1.3b": (2048, 24, 32, 8192), "2.7b": (2560, 32, 32, 10240),
          "6.7b": (4096, 32, 32, 16384), "13b": (5120, 40, 40, 20480), "30b": (7168, 48, 56, 28672),
          "66b": (9216, 64, 72, 36864), "175b": (12288, 96, 96, 49152)}
VOCAB, POSITIONS = 50272, 2048


def hf_config(name: str) -> dict:
    D, L, H, F = SHAPES[name]
    return {"model_type": "opt", "architectures": ["OPTForCausalLM"], "activation_function": "relu",
            "vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": H,
            "ffn_dim": F, "max_position_embeddings": POSITIONS, "word_embed_proj_dim": D,
            "do_layer_norm_before": True, "enable_bias": True, "bos_token_id": 2, "eos_token_id": 2,
            "pad_token_id": 1, "torch_dtype": "float16", "tie_word_embeddings": True}


def tensor_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    D, L, H, F = SHAPES[name]
    p = "model.decoder."
    out = [(p + "embed_tokens.weight", (VOCAB, D)), (p + "embed_positions.weight", (POSITIONS + 2, D))]
    for l in range(L):
        q = f"{p}layers.{l}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(q + f"self_attn.{proj}.weight", (D, D)), (q + f"self_attn.{proj}.bias", (D,))]
        out += [(q + "self_attn_layer_norm.weight", (D,)), (q + "self_attn_layer_norm.bias", (D,)),
                (q + "fc1.weight", (F, D)), (q + "fc1.bias", (F,)), (q + "fc2.weight", (D, F)),
                (q + "fc2.bias", (D,)), (q + "final_layer_norm.weight", (D,)), (q + "final_layer_norm.bias", (D,))]
    return out + [(p + "final_layer_norm.weight", (D,)), (p + "final_layer_norm.bias", (D,))]


def write_checkpoint(name: str, folder: Path, shard_bytes: int = 2 << 30, seed: int = 0) -> int:
    """Random fp16 weights of the shape, in shards of about `shard_bytes`; returns total bytes. Drawn on the
    GPU where there is one (CPU torch.randn of a 13B shape alone took minutes)."""
    import torch
    from safetensors.torch import save_file

    from dejavu.fileio import write_json

    if (folder / "model.safetensors.index.json").is_file():
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    folder.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda shape: torch.randn(shape, generator=g, device=dev)  # noqa: E731
    shapes = tensor_shapes(name)
    groups, cur, size = [], [], 0
    for key, shape in shapes:
        n = 2 * int(torch.Size(shape).numel())
        if cur and size + n > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append((key, shape))
        size += n
    groups.append(cur)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for key, shape in group:
            if "layer_norm.weight" in key:
                t = 1 + 0.05 * rn(shape)
            elif len(shape) == 1:
                t = 0.02 * rn(shape)
            else:  # ~N(0, 1/fan_in): activations keep their scale through the layers
                t = rn(shape) * shape[1] ** -0.5
            shard[key] = t.half().cpu()
            weight_map[key] = fname
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        total += (folder / fname).stat().st_size
        del shard
    write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map},
               indent=1)
    write_json(folder / "config.json", hf_config(name), indent=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "opt-mini" / f, folder / f)
    return total


def run_child(cmd: list[str], log: Path, timeout: float | None = None) -> dict:
    """Run cmd; its wall seconds, exit status and peak RSS (bytes, from wait4). Past `timeout`
    seconds the child is killed (SIGKILL) and `timed_out` is set."""
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if timeout is not None and time.perf_counter() - t0 > timeout and not timed_out:
                p.kill()
                timed_out = True
            time.sleep(0.5)
    return {"rc": os.waitstatus_to_exitcode(status), "wall_s": round(time.perf_counter() - t0, 2),
            "child_ru_maxrss_bytes": ru.ru_maxrss * 1024, "timed_out": timed_out}


def layer_bound(name: str, calib_tokens: int, predictors: bool, device: str) -> dict:
    """The build's stated bound (dejavu.compiler.stream.memory_bound): 2 x the largest layer
    (fp32, the embeddings counted as one) + the calibration tensors on the device + 1 GiB, + on the
    host the freed heap `dejavu-compile` keeps (compiler/cli.reuse_freed_memory)."""
    from dejavu.compiler.cli import MALLOC_KEEP_BYTES
    from dejavu.compiler.stream import memory_bound, set_kept_heap
    from dejavu.models.opt import OPTConfig

    set_kept_heap(MALLOC_KEEP_BYTES)  # the child is dejavu-compile
    return memory_bound(OPTConfig.from_hf_dict(hf_config(name)), calib_tokens if predictors else 0, host=device == "cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="125m,1.3b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--out", help="folder for the JSON, table and plot (required)")
    ap.add_argument("--work", default=None, help="folder for checkpoints and engines (default OUT/work)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compute-dtype", default="float32", help="the build's --compute-dtype")
    ap.add_argument("--density", default="0.3")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--predictor-epochs", type=int, default=1)
    ap.add_argument("--no-predictors", action="store_true", help="dense engines (density 1.0): layout only")
    ap.add_argument("--decode-tokens", type=int, default=0, help="then decode this many tokens from the engine")
    ap.add_argument("--onnx", action="store_true", help="also write the ONNX graphs (--onnx-out WORK/opt-SHAPE-onnx)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill a build after this many seconds (records the layers done and the peak so far)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and engines")
    ap.add_argument("--write-checkpoint", nargs=2, metavar=("SHAPE", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint[0], Path(args.write_checkpoint[1]))
        return 0
    if not args.out:
        ap.error("--out is required")
    from dejavu.fileio import write_json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    jpath = out / "compile_scale.json"
    rows = json.loads(jpath.read_text())["runs"] if jpath.is_file() else []
    for name in args.shapes.split(","):
        ckpt, engine, summary = work / f"opt-{name}-random", work / f"opt-{name}.engine", out / f"summary-{name}.json"
        onnx_dir = work / f"opt-{name}-onnx"
        t0 = time.perf_counter()  # in a child: this process stays small (a child's ru_maxrss
        # starts from its parent's resident set at fork)
        w = run_child([sys.executable, __file__, "--write-checkpoint", name, str(ckpt)], out / f"write-{name}.log")
        if w["rc"]:
            raise SystemExit(f"writing the {name} checkpoint failed: {out / f'write-{name}.log'}")
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        write_s = round(time.perf_counter() - t0, 1)
        cmd = [sys.executable, "-m", "dejavu.compiler.cli", str(ckpt), "-o", str(engine), "-q",
               "--device", args.device, "--summary-json", str(summary)]
        cmd += ["--compute-dtype", args.compute_dtype]
        if args.onnx:
            cmd += ["--onnx-out", str(onnx_dir)]
        if args.no_predictors:
            cmd += ["--density", "1.0", "--no-predictors"]
        else:
            cmd += ["--density", args.density, "--calib-tokens", str(args.calib_tokens),
                    "--predictor-epochs", str(args.predictor_epochs)]
        child = run_child(cmd, out / f"compile-{name}.log", args.timeout)
        if child["timed_out"]:  # the layers finished before the kill, from the build state (kept:
            # the same command again resumes after them)
            prog = engine.parent / f".{engine.name}.build" / "progress.json"
            child["layers_done"] = json.loads(prog.read_text())["layers_done"] if prog.is_file() else 0
        s = json.loads(summary.read_text()) if child["rc"] == 0 else {}
        row = {"shape": name, "dims": dict(zip(("hidden", "layers", "heads", "ffn"), SHAPES[name])),
               "device": args.device, "predictors": not args.no_predictors,
               "calib_tokens": None if args.no_predictors else args.calib_tokens,
               "predictor_epochs": None if args.no_predictors else args.predictor_epochs,
               "checkpoint_bytes": ckpt_bytes, "checkpoint_write_s": write_s, "command": " ".join(cmd[1:]),
               **child, "peak_host_bytes": s.get("peak_host_bytes"), "engine_bytes": s.get("engine_bytes"),
               "build_state_bytes": s.get("build_state_bytes"),
               "peak_gpu_bytes": s.get("peak_gpu_bytes"), "stage_seconds": s.get("stage_seconds"),
               "total_seconds": s.get("total_seconds"), "resumed_at_layer": s.get("resumed_at_layer"),
               "compute_dtype": args.compute_dtype, "onnx_out": args.onnx, "onnx": s.get("onnx"),
               "onnx_bytes": sum(f.stat().st_size for f in onnx_dir.iterdir()) if args.onnx and onnx_dir.is_dir() else None,
               **layer_bound(name, args.calib_tokens, not args.no_predictors, args.device),
               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "machine": os.uname().nodename,
               "cpus": os.cpu_count()}
        if child["rc"] == 0 and args.decode_tokens:
            row["decode"] = run_child([sys.executable, "-m", "dejavu.runtime.cli", str(engine), "--prompt",
                                       "The", "--max-new-tokens", str(args.decode_tokens), "--device", args.device,
                                       "--stats"],
                                      out / f"decode-{name}.log")
        rows = [r for r in rows if not (r["shape"] == row["shape"] and r["device"] == row["device"]
                                        and r["predictors"] == row["predictors"]
                                        and r.get("onnx_out", False) == row["onnx_out"])] + [row]
        write_json(jpath, {"runs": rows}, indent=1)
        print(json.dumps({k: row[k] for k in ("shape", "rc", "wall_s", "peak_host_bytes", "child_ru_maxrss_bytes",
                                               "bound_bytes")}),
              flush=True)
        if not args.keep and not child["timed_out"]:
            engine.unlink(missing_ok=True)
            shutil.rmtree(onnx_dir, ignore_errors=True)
            if name not in ("125m",):
                shutil.rmtree(ckpt, ignore_errors=True)
    write_table(rows, out)
    return 0


def write_table(rows: list[dict], out: Path) -> None:
    gb = lambda n: "-" if n is None else f"{n / 2**30:.2f}"
    lines = ["| shape | device | predictors (calib tokens, epochs) | checkpoint GiB | peak host GiB | bound GiB "
             "| peak GPU GiB | engine GiB | state GiB | wall s | stages (s) |", "|" + "---|" * 11]
    for r in rows:
        st = ", ".join(f"{k} {v:.0f}" for k, v in (r.get("stage_seconds") or {}).items())
        pred = f"yes ({r['calib_tokens']}, {r['predictor_epochs']})" if r["predictors"] else "no (dense)"
        pred += ", --onnx-out" if r.get("onnx_out") else ""
        killed = f" (killed after {r['layers_done']} of {r['dims']['layers']} layers)" if r.get("timed_out") else ""
        peak = r["peak_host_bytes"] or r["child_ru_maxrss_bytes"]  # a killed build has no summary
        lines.append(f"| {r['shape']} | {r['device']} | {pred} | {gb(r['checkpoint_bytes'])} | {gb(peak)} | "
                     f"{gb(r['bound_bytes'])} | {gb(r['peak_gpu_bytes'])} | {gb(r['engine_bytes'])} | "
                     f"{gb(r['build_state_bytes'])} | {r['wall_s']:.0f}{killed} | {st} |")
    (out / "compile_scale.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if r["rc"] == 0 and r.get("peak_host_bytes")]
    if not ok:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["checkpoint_bytes"] / 2**30 for r in ok]
    a1.plot(x, [r["peak_host_bytes"] / 2**30 for r in ok], "o-", label="peak host (VmHWM, measured)")
    a1.plot(x, [r["bound_bytes"] / 2**30 for r in ok], "s--", label="bound: 2 x layer + calib + 1 GiB")
    a1.set_xlabel("checkpoint GiB (fp16)")
    a1.set_ylabel("GiB")
    a1.legend()
    names = [f"{r['shape']} ({r['device']}{'' if r['predictors'] else ', dense'})" for r in ok]
    stages = sorted({k for r in ok for k in (r["stage_seconds"] or {})})
    bottom = [0.0] * len(ok)
    for st in stages:
        v = [(r["stage_seconds"] or {}).get(st, 0.0) for r in ok]
        a2.bar(names, v, bottom=bottom, label=st)
        bottom = [b + y for b, y in zip(bottom, v)]
    a2.set_ylabel("seconds")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "compile_scale.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
