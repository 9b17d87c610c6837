"""The build summary and `dejavu-inspect`'s accuracy lines (torch-free: the CLIs import it before torch)."""
from __future__ import annotations


def accuracy_lines(density, allocation, b: dict | None, h: dict | None) -> list[str]:
    """Bytes read per token and the held-out perplexity measured at build (build summary, inspect)."""
    out = []
    spread = f", {h['spread']}" if h and h.get("spread") else ""  # how the free kind was spread, where not the knapsack
    if b:
        out.append(f"bytes/token {b['engine'] / 2**20:.3f} MiB of {b['dense'] / 2**20:.3f} MiB dense = "
                   f"{b['fraction']:.4f} (density {density}, allocation {allocation}{spread})")
    if h:
        out.append(f"held-out    ppl {h['engine_ppl']:.3f} vs dense {h['dense_ppl']:.3f} ({h['increase_pct']:+.2f}%) "
                   f"on {h['tokens']} tokens: {h['source']}")
    return out


def token_k_line(tk: dict | None, h: dict | None) -> list[str]:
    """The per-token MLP K an engine carries (docs/predictors.md, "Per-token K"), if any."""
    if not tk:
        return []
    held = tk["heldout"]
    rows = sum(held["mean_rows"])
    fixed = f"; K rows for every token: {h['fixed_k_increase_pct']:+.2f}%" if h and "fixed_k_increase_pct" in h else ""
    if tk.get("rows", "selected") == "read":  # headers before the field: "selected"
        return [f"per-token K {tk['form']}, rows read: up to {sum(tk['k_max'])} MLP rows, held-out mean fc1 {rows:.0f} "
                f"+ fc2 {sum(held['mean_rows_fc2']):.0f} of 2 K {2 * sum(tk['k_mean'])}{fixed}"]
    fc2 = f" (fc2 reads {sum(held['mean_rows_fc2']):.0f})" if "mean_rows_fc2" in held else ""
    return [f"per-token K {tk['form']}: up to {sum(tk['k_max'])} MLP rows, held-out mean {rows:.0f}{fc2} of "
            f"K {sum(tk['k_mean'])}{fixed}"]


def format_summary(s: dict) -> str:
    mb = lambda n: f"{n / 2**20:.2f} MiB"
    lines = [f"engine      {s['engine']}  ({mb(s['engine_bytes'])}: weights {mb(s['weight_bytes'])}, "
             f"predictors {mb(s['predictor_bytes'])}, {s['dtype']}, target {s['target']['device']}"
             f"{' ' + s['target']['arch'] if s['target'].get('arch') else ''})",
             f"predictors  input {s['predictor_input']}"]
    lines += accuracy_lines(s.get("density"), s.get("allocation"), s.get("bytes_per_token"), s.get("heldout"))
    lines += token_k_line(s.get("token_k"), s.get("heldout"))
    rec = s["predictor_recall"]
    lines.append(f"{'layer':>5} {'K_mlp':>7} {'recall':>7} {'K_attn':>7} {'recall':>7}")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    for l, (km, ka) in enumerate(zip(s["mlp_k"], s["attn_k"])):
        lines.append(f"{l:>5} {km:>5}/{s['ffn_dim']:<1} {fmt(rec['mlp'][l]):>7} {ka:>5}/{s['num_heads']:<1} "
                     f"{fmt(rec['attn'][l]):>7}")
    if "onnx" in s:
        o = s["onnx"]
        check = (f"form (a) in ONNX Runtime vs masked dense (float64) max |diff| = {o['form_a_max_abs_diff']:.3g} "
                 f"(PyTorch in {o['dtype']}: {o['form_a_torch_same_dtype_max_abs_diff']:.3g})"
                 if o["form_a_max_abs_diff"] is not None else o["form_a_check"])
        lines.append(f"onnx        {o['dir']}: {', '.join(o['files'])} + {o['data_file']} "
                     f"({o['data_bytes'] / 2**20:.2f} MiB, {o['dtype']}); {check}")
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"
    lines.append(f"memory      peak host {gib(s['peak_host_bytes'])}, GPU {gib(s['peak_gpu_bytes'])}; bound "
                 f"{gib(s['bound_bytes'])} = 2 x largest layer {mb(s['largest_layer_fp32_bytes'])} + calibration "
                 f"tensors {mb(s['calib_device_bytes'])} (MLP targets in bfloat16 included) + 1 GiB"
                 + (f" + freed heap kept {mb(s['kept_heap_bytes'])}" if s.get("kept_heap_bytes") else "") + ", predictor "
                 f"training's float32 label copies not included; build state on disk {mb(s['build_state_bytes'])} "
                 f"(removed)" + (f"; resumed at layer {s['resumed_at_layer']}" if s["resumed_at_layer"] else ""))
    lines.append("time        " + ", ".join(f"{k} {v:.1f}s" for k, v in s["stage_seconds"].items())
                 + f"; total {s['total_seconds']:.1f}s")
    return "\n".join(lines)
