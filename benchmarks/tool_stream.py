"""What reading a streamed reply's tool calls costs the server (`runtime/tool_calls.StreamGate`), CPU.

    python benchmarks/tool_stream.py --out F.json

A reply of two calls whose arguments hold --kb KB of text (quotes, braces and brackets inside strings), in each
streaming format, fed --step characters at a time as tokens arrive: `add` and `tool_deltas` after each piece, then
`finish`, as dejavu-serve's chat stream calls them. Prints and records the seconds per reply and checks that the
first call's arguments arrive whole.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone


def reply(parser: str, args: str) -> str:
    call = {"hermes": '<tool_call>\n{"name": "write", "arguments": ' + args + "}\n</tool_call>",
            "llama3_json": '{"name": "write", "parameters": ' + args + "}",
            "mistral": "[TOOL_CALLS]write[ARGS]" + args}[parser]
    return call + ("; " if parser == "llama3_json" else "") + call


def main() -> int:
    from dejavu.provenance import tree_commit
    from dejavu.runtime.tool_calls import StreamGate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kb", type=int, nargs="+", default=[4, 32])
    p.add_argument("--step", type=int, default=4, help="characters a token")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = {"meta": {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), "commit": tree_commit(),
                    "machine": platform.machine(), "python": platform.python_version(), "step": a.step},
           "results": []}
    for parser in ("hermes", "llama3_json", "mistral"):
        for kb in a.kb:
            args = json.dumps({"text": 'x \\"{y}[z] ' * (kb * 1024 // 14), "n": [1, {"a": "]"}]})
            text, gate, got = reply(parser, args), StreamGate(parser), ""
            t0 = time.perf_counter()
            for i in range(0, len(text), a.step):
                gate.add(text[i:i + a.step])
                got += "".join(d["function"].get("arguments", "") for d in gate.tool_deltas() if d["index"] == 0)
            _, late, has_calls = gate.finish()
            s = time.perf_counter() - t0
            got += "".join(d["function"].get("arguments", "") for d in late if d["index"] == 0)
            assert has_calls and got == args, parser
            res["results"].append({"parser": parser, "kb": kb, "reply_chars": len(text), "seconds": round(s, 3)})
            print(f"{parser:12s} {kb:3d} KB of arguments a call, 2 calls: {s:.3f} s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
