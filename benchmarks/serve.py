"""`dejavu-serve` under load: output tokens/s, time to first token and inter-token latency
percentiles at several numbers of concurrent streaming clients, dense engine vs sparse engine
of the same model; and how often a greedy request's tokens differ from its solo run when it
shares the batch (the "shared" index-set policy picks one set for the batch).

    # CPU, opt-mini engine files (dejavu-compile), server on loopback in a child process:
    python benchmarks/serve.py --engine opt-mini-d0.3.engine --dense opt-mini-dense.engine \
        --dtype float32 --clients 1 4 16 64 --requests 2 --prompt-len 32 --max-tokens 32 --out serve-cpu.json
    # GPU, the OPT-30B shape with random weights built in memory (no file), fp16 (benchmarks/gpu/serve.sh,
    # which says why these sizes fit one call on an 80 GB card):
    python benchmarks/serve.py --shape opt-30b --density 0.3 --device cuda --max-batch 32 \
        --max-context 128 --engines sparse dense --clients 1 16 --more-clients 4 64 --requests 2 \
        --prompt-len 64 --max-tokens 64 --agreement 16 --budget-s 400 --out $OUT/serve.json

Each engine is served by a child process (this script with --_serve: the CLI's server, the
engine from a file or built from random weights of `--shape`, benchmarks/e2e.py's), so the
clients (one asyncio loop here, raw SSE parsing) do not share the server's interpreter. Every
request asks for exactly --max-tokens tokens (`ignore_eos`), greedy, random prompt ids of
--prompt-len. Per level: output tokens / wall time, TTFT (request sent -> first token chunk)
and inter-token gaps (between a stream's successive chunks) p50 / p99. `direct_ms_per_token`:
`Engine.generate` at batch 1 in the server process (what `dejavu-run` does), the reference
for the server's batch-1 overhead. --agreement N: N prompts through the scheduler alone, then
all at once, for each batch policy; the fraction whose greedy tokens differ and the mean first
position where they do. Raw JSON to --out, a markdown table on stdout. Asserts nothing.

Order and time: every engine runs the --clients levels (one child server each), then every
engine again for the --more-clients levels (a second child server each), then the agreement.
The JSON is rewritten (temporary name, renamed) after every level, with a progress line on
stderr. --budget-s: an engine, level or agreement not started inside it is recorded in
"skipped" instead; a started one runs to its end, so keep the caller's timeout above the budget
by the longest level.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------------- server side
def build_engine(args, dense: bool):
    import torch

    from dejavu.runtime import Engine

    if args.shape is None:
        return Engine.load(args.dense if dense else args.engine, device=args.device, batch_policy=args.batch_policy,
                           dtype=args.dtype)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e

    c = e2e.TINY if args.shape == "tiny" else e2e.SHAPES[args.shape]
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    ranks, _ = e2e.default_ranks(c)
    header = e2e.header_for(c, None if dense else args.density, str(dtype)[6:], ranks)
    return Engine.from_tensors(header, e2e.random_tensors(c, dtype, args.device, ranks), args.device,
                               batch_policy=args.batch_policy)


def direct_ms_per_token(eng, args) -> float:
    """Engine.generate at batch 1, the benchmark's prompt length and tokens (dejavu-run's path)."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, eng.spec.vocab_size, (args.prompt_len,), generator=g).tolist()
    best = float("inf")
    for _ in range(2):
        eng.generate([ids], args.max_tokens, stream=lambda t: None, stop_at_eos=False)
        best = min(best, eng.stats.ms_per_token)
    eng.release()
    return best


def serve_main(args) -> int:
    """--_serve: build the engine, print its direct latency and the port, serve until SIGTERM."""
    from dejavu.runtime.serve import ServeSettings, Server, bind, run

    eng = build_engine(args, args._serve == "dense")
    direct = direct_ms_per_token(eng, args)
    settings = ServeSettings(max_batch=args.max_batch, max_queue=4096, max_context=args.max_context, port=0,
                             shutdown_grace_s=5, prefix_caching=not args.no_prefix_caching,
                             prefix_block=args.prefix_block)
    server = Server(eng, settings, "bench")
    sock = bind("127.0.0.1", 0)
    print(json.dumps({"port": sock.getsockname()[1], "direct_ms_per_token": direct, "vocab": eng.spec.vocab_size,
                      "describe": eng.describe()}),
          flush=True)
    run(server, sock, settings)
    return 0


# ---------------------------------------------------------------------- clients
def make_prompts(n_clients: int, args, vocab: int) -> list[list[int]]:
    """Each client's requests' prompts: --shared-prefix random ids common to every prompt of the run (a system
    prompt), then --prompt-len of its own."""
    import random

    rng = random.Random(n_clients)
    shared = [random.Random(-1).randrange(4, vocab) for _ in range(args.shared_prefix)]
    return [shared + [rng.randrange(4, vocab) for _ in range(args.prompt_len)]
            for _ in range(n_clients * args.requests)]


async def one_request(client, url, prompt, args):
    body = {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code, "body": (await r.aread()).decode()[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj["choices"] and obj["choices"][0]["finish_reason"] is None:  # a token chunk
                times.append(time.perf_counter())
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return {"ttft": times[0] - t0 if times else None, "gaps": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens, "end": time.perf_counter()}


async def level(url, n_clients, args, vocab):
    import httpx

    prompts = make_prompts(n_clients, args, vocab)
    limits = httpx.Limits(max_connections=n_clients + 4, max_keepalive_connections=n_clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, prompts[0], args)  # warm-up

        async def worker(i):
            return [await one_request(client, url, prompts[i * args.requests + j], args) for j in range(args.requests)]

        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*(worker(i) for i in range(n_clients))) for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in res if "error" not in r]
    if len(ok) < len(res):
        print(f"  errors: {[r for r in res if 'error' in r][:3]}", file=sys.stderr, flush=True)
    if not ok:
        raise RuntimeError("every request failed")
    gaps = [g for r in ok for g in r["gaps"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    toks = sum(r["tokens"] for r in ok)
    return {"clients": n_clients, "requests": len(res), "errors": len(res) - len(ok), "output_tokens": toks,
            "wall_s": round(wall, 3), "tokens_per_s": round(toks / wall, 2),
            "ttft_p50_ms": round(1e3 * pct(ttft, 50), 2), "ttft_p99_ms": round(1e3 * pct(ttft, 99), 2),
            "itl_p50_ms": round(1e3 * pct(gaps, 50), 3), "itl_p99_ms": round(1e3 * pct(gaps, 99), 3)}


class Run:
    """The result dict, rewritten to `path` after every measurement, and the time budget."""

    def __init__(self, res: dict, path: Path, budget_s: float | None):
        self.res, self.path, self.t0, self.budget_s = res, path, time.time(), budget_s
        res["budget_s"], res["skipped"] = budget_s, []

    def left(self) -> bool:
        return self.budget_s is None or time.time() - self.t0 < self.budget_s

    def skip(self, what: dict) -> None:
        self.res["skipped"].append(what)
        print(f"  skipped (budget {self.budget_s} s spent): {what}", file=sys.stderr, flush=True)
        self.save()

    def save(self) -> None:
        from dejavu.fileio import write_json

        self.res["elapsed_s"] = round(time.time() - self.t0, 1)
        write_json(self.path, self.res, indent=1)


def bench_engine(kind: str, clients: list[int], args, run: Run) -> None:
    """One child server of `kind`; the levels in `clients` appended to run.res["engines"][kind]."""
    if not run.left():
        for n in clients:
            run.skip({"engine": kind, "clients": n})
        return
    cmd = [sys.executable, __file__, "--_serve", kind] + args.passthrough
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t_start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(proc.stdout.readline())
        url = f"http://127.0.0.1:{info['port']}"
        import httpx

        t0 = time.time()
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() - t0 > 600:
                raise RuntimeError("server did not come up")
            time.sleep(0.1)
        e = run.res["engines"].setdefault(kind, {"direct_ms_per_token": round(info["direct_ms_per_token"], 3),
                                                  "describe": info["describe"], "startup_s": [], "levels": []})
        # build + direct latency + CUDA graph capture, until /health answers
        e["startup_s"].append(round(time.time() - t_start, 1))
        print(f"  {kind} server up in {e['startup_s'][-1]} s", file=sys.stderr, flush=True)
        run.save()
        for n in clients:
            if not run.left():
                run.skip({"engine": kind, "clients": n})
                continue
            e["levels"].append(asyncio.run(level(url, n, args, info["vocab"])))
            metrics = httpx.get(url + "/metrics").text
            e["metrics_tail"] = [ln for ln in metrics.splitlines() if "_total" in ln and "#" not in ln]
            run.save()
            print(f"  {kind} {n} clients (at {run.res['elapsed_s']} s): {e['levels'][-1]}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


# ---------------------------------------------------------------------- no HTTP
def level_scheduler(sched, n_clients, args, vocab):
    """The same load straight into the scheduler (no HTTP, no child process): n client threads,
    each submitting its requests one after another; token times taken in the sink."""
    import threading

    from dejavu.runtime.scheduler import Request

    prompts = make_prompts(n_clients, args, vocab)
    res = []

    def one(prompt):
        times, done, n = [], threading.Event(), [0]
        t0 = time.perf_counter()

        def sink(ev):  # token events carry text (a token that ends mid-character waits for the next)
            if ev[0] == "token":
                times.append(time.perf_counter())
            else:
                n[0] = ev[2] if ev[0] == "done" else 0
                done.set()
        sched.submit([Request(prompt=prompt, max_tokens=args.max_tokens, sink=sink, stop_at_eos=False)])
        done.wait()
        return {"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": n[0]}

    def worker(i):
        for j in range(args.requests):
            r = one(prompts[i * args.requests + j])
            res.append(r)

    one(prompts[0])  # warm-up
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = [g for r in res for g in r["gaps"]]
    ttft = [r["ttft"] for r in res]
    toks = sum(r["tokens"] for r in res)
    return {"clients": n_clients, "requests": len(res), "errors": 0, "output_tokens": toks, "wall_s": round(wall, 3),
            "tokens_per_s": round(toks / wall, 2), "ttft_p50_ms": round(1e3 * pct(ttft, 50), 2),
            "ttft_p99_ms": round(1e3 * pct(ttft, 99), 2), "itl_p50_ms": round(1e3 * pct(gaps, 50), 3),
            "itl_p99_ms": round(1e3 * pct(gaps, 99), 3)}


def bench_engine_scheduler(kind: str, clients: list[int], args, run: Run) -> None:
    """bench_engine without HTTP: the engine and scheduler in this process."""
    import torch

    from dejavu.runtime.scheduler import Scheduler

    if not run.left():
        for n in clients:
            run.skip({"engine": kind, "clients": n})
        return
    t_start = time.time()
    eng = build_engine(args, kind == "dense")
    direct = direct_ms_per_token(eng, args)
    sched = Scheduler(eng, args.max_batch, 4096, args.max_context, prefix_caching=not args.no_prefix_caching,
                      prefix_block=args.prefix_block)
    sched.start()
    e = run.res["engines"].setdefault(kind, {"direct_ms_per_token": round(direct, 3), "describe": eng.describe(),
                                              "startup_s": [], "levels": []})
    e["startup_s"].append(round(time.time() - t_start, 1))
    run.save()
    try:
        for n in clients:
            if not run.left():
                run.skip({"engine": kind, "clients": n})
                continue
            e["levels"].append(level_scheduler(sched, n, args, eng.spec.vocab_size))
            run.save()
            print(f"  {kind} {n} clients (no HTTP, at {run.res['elapsed_s']} s): {e['levels'][-1]}", file=sys.stderr,
                  flush=True)
    finally:
        sched.stop()
    del eng, sched
    if args.device == "cuda":  # the engine of this process goes before the next one
        import gc

        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- agreement
def agreement(args) -> dict:
    """For each batch policy: N greedy prompts through the scheduler alone, then all at once."""
    import random
    import threading

    import torch

    from dejavu.runtime.scheduler import Request, Scheduler

    out = {}
    for policy in ("per_sequence", "shared"):
        args.batch_policy = policy
        eng = build_engine(args, dense=False)
        rng = random.Random(7)
        prompts = [[rng.randrange(4, eng.spec.vocab_size) for _ in range(rng.randint(4, args.prompt_len))]
                   for _ in range(args.agreement)]
        sched = Scheduler(eng, args.max_batch, len(prompts), args.max_context)
        sched.start()

        def run(batch):
            toks = {i: [] for i in range(len(batch))}
            done = threading.Semaphore(0)

            def sink(i):
                def put(ev):
                    if ev[0] != "token":
                        toks[i].extend(ev[3] if ev[0] == "done" else [])
                        done.release()
                return put
            sched.submit([Request(prompt=p, max_tokens=args.max_tokens, sink=sink(i), stop_at_eos=False)
                          for i, p in enumerate(batch)])
            for _ in batch:
                done.acquire()
            return [toks[i] for i in range(len(batch))]

        solo = [run([p])[0] for p in prompts]
        together = run(prompts)
        sched.stop()
        diff = [next((j for j, (a, b) in enumerate(zip(s, t)) if a != b), None) for s, t in zip(solo, together)]
        firsts = [d for d in diff if d is not None]
        out[policy] = {"prompts": len(prompts), "differ": len(firsts), "fraction": round(len(firsts) / len(prompts), 4),
                       "mean_first_diff": round(sum(firsts) / len(firsts), 2) if firsts else None,
                       "tokens_each": args.max_tokens, "max_batch": args.max_batch}
        print(f"  agreement {policy}: {out[policy]}", file=sys.stderr, flush=True)
        del eng, sched
        import gc

        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def _tree_commit() -> str | None:
    from dejavu.provenance import tree_commit

    return tree_commit(ROOT, short=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", help="sparse .engine file")
    p.add_argument("--dense", help="dense .engine file of the same model (density 1.0)")
    p.add_argument("--shape", help="random weights of this shape instead of files (opt-30b, opt-1.3b, tiny)")
    p.add_argument("--density", type=float, default=0.3, help="--shape: the sparse engine's density")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads in the server (default: torch's)")
    p.add_argument("--dtype", default=None, help="engine files: override their dtype (float32 on CPU)")
    p.add_argument("--batch-policy", default=None, choices=["per_sequence", "shared"])
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--more-clients", type=int, nargs="*", default=[],
                   help="levels measured after every engine has run --clients (a new server each)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds; what has not started by then is recorded as skipped")
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="N random ids before every prompt, the same for all (a system prompt: prefix caching)")
    p.add_argument("--no-prefix-caching", action="store_true", help="the server prefills every prompt whole")
    p.add_argument("--prefix-block", type=int, default=16, metavar="N",
                   help="prefix caching's granularity in tokens (dejavu-serve's --prefix-block)")
    p.add_argument("--engines", nargs="*", default=["dense", "sparse"], choices=["dense", "sparse"],
                   help="which engines to load-test (one child server each)")
    p.add_argument("--agreement", type=int, default=0, help="prompts for the solo-vs-batch comparison (0: skip)")
    p.add_argument("--no-http", action="store_true",
                   help="drive the scheduler in this process instead of clients against dejavu-serve")
    p.add_argument("--out", default=None)
    p.add_argument("--_serve", choices=["dense", "sparse"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args._serve:
        return serve_main(args)
    if args.shape is None and not (args.engine and args.dense):
        p.error("give --engine and --dense, or --shape")
    args.passthrough = [a for a in sys.argv[1:]]
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "serve.json"))
    import platform

    import torch

    res = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "http": not args.no_http, "commit": _tree_commit(), "engines": {}}
    run = Run(res, out_path, args.budget_s)
    run.save()
    for clients in (args.clients, args.more_clients):
        for kind in args.engines if clients else ():
            (bench_engine_scheduler if args.no_http else bench_engine)(kind, clients, args, run)
    if args.agreement and run.left():
        res["agreement"] = agreement(args)
        run.save()
    elif args.agreement:
        run.skip({"agreement": args.agreement})
    print("| engine | clients | tokens/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms |\n|---|---|---|---|---|")
    for kind, e in res["engines"].items():
        for lv in e["levels"]:
            print(f"| {kind} | {lv['clients']} | {lv['tokens_per_s']} | {lv['ttft_p50_ms']} / {lv['ttft_p99_ms']} | "
                  f"{lv['itl_p50_ms']} / {lv['itl_p99_ms']} |")
        print(f"| {kind} direct (Engine.generate, batch 1) | 1 | | | {e['direct_ms_per_token']} ms/token |")
    if res["skipped"]:
        print(f"skipped (--budget-s {args.budget_s}): {res['skipped']}")
    print(f"raw JSON: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
