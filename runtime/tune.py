"""A Llama engine's launch shapes tuned on the GPU at hand: the whole decode step timed per candidate.

    tuned = tune_engine(engine, say=print)         # a LlamaEngine on a CUDA device: tuned.settings, .trials
    tune_file("model.engine", device="cuda")       # the same, recorded in the engine's header
    dejavu-tune model.engine                       # the console script

TensorRT's builder times its tactics on the GPU it builds for and records the winners in the engine; this does
the same for the launches no single table serves on every model. The defaults (plugins/settings.py) were picked
on Llama-3-8B, where gate/up wants block_k 64; the Llama-3-70B TP-8 rank measured faster with the table's 128 and
with 792 GEMV programs, which cost 8B 11% (docs/llama.md, "The defaults on the H200"). Launches of one layer wait
on each other, so a projection's best shape alone is not the step's (the isolated sweep,
benchmarks/input_sparse_sweep.py, measured gains the whole step did not keep): each candidate here is the
engine's decode step captured in a CUDA graph after a prompt, timed in alternation with the incumbent settings
over several rounds, and kept only where the median of the rounds' ratios gains more than `min_gain`.

The search is coordinate descent over `search_space(sm_count)`: per projection kind (plugins.PROJECTIONS) its GEMV
programs (2, 3, 4 or 6 a streaming multiprocessor), block_k and block_m (16, 32, 64), then the attention's tile of
slots; passes repeat while one changes something, until `budget_s`. A candidate is first checked kernel by kernel: each
projection kind's GEMV on layer 0's weights and the attention kernel against their references (LlamaOps.verify,
the engine's load-time check), and refused where one disagrees or fails to launch. Settings change the order of
sums and no selection, so a tuned engine decodes what the untuned one does, to rounding.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dejavu.errors import DejavuError
from dejavu.plugins.settings import PROJECTIONS, KernelSettings, resolve_projection_settings

ATTN = "gqa_attn"  # the attention's part of KernelSettings, beside the projection kinds
PROGRAMS_PER_SM = (2, 3, 4, 6)
BLOCK_M = (16, 32, 64)


@dataclass(frozen=True)
class TuneSettings:
    """What `tune_engine` times: a prompt of `prompt_len` random tokens, then `reps` replays of the decode step per
    timing, `rounds` timings of the candidate and of the incumbent in alternation; a change is kept where the
    median ratio is below 1 - min_gain. No trial starts after budget_s seconds; at most `passes` passes."""
    prompt_len: int = 128
    reps: int = 20
    rounds: int = 5
    min_gain: float = 0.005
    budget_s: float = 300.0
    passes: int = 2
    seed: int = 0


@dataclass
class Trial:
    """One candidate: `where` (a projection kind, or gqa_attn) and its field's value, the median ratio of its
    step time to the incumbent's (None where it did not run), and what became of it."""
    where: str
    field: str
    value: object
    ratio: float | None
    ms: float | None
    outcome: str  # "kept", "slower", "within noise", or why it was refused

    def line(self) -> str:
        r = f"{self.ratio:.4f}x" if self.ratio is not None else "-"
        return f"{self.where}.{self.field}={self.value}: {r} {self.outcome}"


def search_space(sm_count: int) -> list[tuple[str, str, tuple]]:
    """(where, field, values): per projection kind its GEMV programs, block_k and block_m; the attention's tile."""
    space = []
    for kind in PROJECTIONS:
        space += [(kind, "target_programs", tuple(n * sm_count for n in PROGRAMS_PER_SM)),
                  (kind, "block_k", (64, 128)), (kind, "block_m", BLOCK_M)]
    return space + [(ATTN, "block_s", (32, 64))]


def setting(s: KernelSettings, where: str, field: str):
    """The value `where` (a projection kind, or gqa_attn) launches with for `field` under s."""
    if where == ATTN:
        return getattr(s.gqa_attn, field)
    over = resolve_projection_settings(s)[where].get("input_sparse", {})
    return over.get(field, getattr(s.input_sparse, field))


def with_setting(s: KernelSettings, where: str, field: str, value) -> KernelSettings:
    """s with `where`'s `field` at value: a gqa_attn field replaced, or a projection kind's (kind, field, value)
    triple (none where the value is the table's own)."""
    r = dataclasses.replace
    if where == ATTN:
        return r(s, gqa_attn=r(s.gqa_attn, **{field: value}))
    if where not in PROJECTIONS:
        raise DejavuError(f"tune: {where!r} is not a projection kind ({', '.join(PROJECTIONS)}) or {ATTN}")
    triples = [t for t in s.input_sparse.projections if (t[0], t[1]) != (where, field)]
    if value != getattr(s.input_sparse, field):
        triples.append((where, field, value))
    triples.sort(key=lambda t: (PROJECTIONS.index(t[0]), t[1]))
    return r(s, input_sparse=r(s.input_sparse, projections=tuple(triples)))


class StepBench:
    """The engine's decode step under given settings: a second decoder on the engine's tensors (no weight copied),
    a `prompt_len`-token prompt prefilled (at most half the model's positions), the step captured in a CUDA graph.
    `check(settings)`: the kernels against their references; `load(settings)` -> a runner with `time(reps)` (ms a
    replay) and `release()`; `sm_count`."""

    def __init__(self, engine, prompt_len: int, seed: int = 0):
        if engine.device.type != "cuda":
            raise DejavuError("tuning times the decode step's CUDA graph: it needs a CUDA device")
        self.engine = engine
        spec = engine.spec
        if prompt_len < 1:
            raise DejavuError(f"tune: the prompt must hold at least one token, got {prompt_len}")
        prompt_len = min(prompt_len, spec.max_positions // 2)  # a model of few positions: a shorter prompt
        self.max_seq = min(-(-(prompt_len + 8) // 64) * 64, spec.max_positions)
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, spec.vocab_size, (1, prompt_len + 1), generator=g).to(engine.device)
        self.prompt_len = prompt_len
        self.sm_count = torch.cuda.get_device_properties(engine.device).multi_processor_count

    def load(self, settings: KernelSettings) -> "_Runner":
        from dejavu.runtime.graphs import DecodeGraph
        from dejavu.runtime.llama_decoder import LlamaDecoder, LlamaOps

        e, P = self.engine, self.prompt_len
        dec = LlamaDecoder(e.spec, e.tensors, e.device, LlamaOps("triton", settings))
        dec.setup(1, self.max_seq)
        with torch.inference_mode():
            dec.prefill(self.ids[:, :P], torch.tensor([P], device=e.device))
            graph = DecodeGraph(dec)
        return _Runner(dec, graph, self.ids[:, P], torch.tensor([P], device=e.device))

    def check(self, settings: KernelSettings) -> None:
        """DejavuError unless every projection kind's GEMV (on layer 0's weights) and the attention kernel agree
        with their references under settings (LlamaOps.verify): a local check, where the step's logits are not
        one (on random weights a deep model's logits move far past rounding when a sum's order changes)."""
        from dejavu.runtime.llama_decoder import LlamaOps

        with torch.inference_mode():
            LlamaOps("triton", settings).verify(self.engine.spec, self.engine.tensors, kinds=PROJECTIONS)


class _Runner:
    def __init__(self, dec, graph, token, pos):
        self.dec, self.graph, self.token, self.pos = dec, graph, token, pos

    def time(self, reps: int) -> float:
        dev = self.dec.device
        with torch.inference_mode():  # the graph's static inputs were made under it
            self.graph.run(self.token, self.pos)  # the static inputs in place: the timed replays copy nothing
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            self.graph.graph.replay()
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / reps

    def release(self) -> None:
        self.graph = None
        self.dec.release()


@dataclass
class Tuned:
    """tune_engine's result: the settings, the step's ms at the engine's own settings and at these, every trial."""
    settings: KernelSettings
    start_ms: float
    ms: float
    trials: list[Trial]

    def record(self, gpu: str, prompt_len: int) -> dict:
        """What an engine header keeps of it (target.tuned)."""
        return {"gpu": gpu, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "prompt_len": prompt_len,
                "step_ms": [round(self.start_ms, 4), round(self.ms, 4)],
                "trials": [dataclasses.asdict(t) for t in self.trials]}


def tune_engine(engine, config: TuneSettings = TuneSettings(), bench=None,
                say: Callable[[str], None] | None = None) -> Tuned:
    """The engine's kernel settings with each launch shape of search_space at the value its decode step measured
    fastest on this GPU (coordinate descent from the engine's own settings), and every trial. bench: StepBench's
    interface (tests pass one that times a model of the step)."""
    if engine.header.get("model_family") != "llama":
        raise DejavuError("tune: only Llama-family engines have launch shapes to tune (their input-sparse GEMVs)")
    if getattr(engine, "decoder", None) is not None and engine.decoder.reduce is not None:
        raise DejavuError("tune: a running tensor-parallel rank is not tuned; its shard file is (tune_file times it "
                          "as the single engine of its shape)")
    if engine.spec.skip <= 0:
        raise DejavuError("tune: a dense engine (nothing skipped) runs no input-sparse launch")
    say = say or (lambda s: None)
    bench = bench or StepBench(engine, config.prompt_len, config.seed)
    best = engine.ops.settings
    t0 = time.perf_counter()
    inc = bench.load(best)
    inc_ms = statistics.median(inc.time(config.reps) for _ in range(config.rounds))
    start_ms, trials = inc_ms, []
    say(f"tune: the decode step at the engine's settings {inc_ms:.3f} ms")
    todo = [(w, f, v) for w, f, vs in search_space(bench.sm_count) for v in vs]
    try:
        for _ in range(config.passes):
            changed, was = False, {}
            for where, field, value in todo:
                if value == was.setdefault((where, field), setting(best, where, field)):
                    continue  # the value this field had when the pass reached it
                if time.perf_counter() - t0 > config.budget_s:
                    say(f"tune: past the budget of {config.budget_s:g} s: the rest untried")
                    changed = False
                    break
                cand = with_setting(best, where, field, value)
                trial, runner = _trial(bench, inc, cand, where, field, value, config)
                trials.append(trial)
                say(f"tune: {trial.line()}")
                if trial.outcome == "kept":
                    inc.release()
                    inc, best, inc_ms, changed = runner, cand, trial.ms, True
                elif runner is not None:
                    runner.release()
            if not changed:
                break
    finally:
        inc.release()
    say(f"tune: {start_ms:.3f} -> {inc_ms:.3f} ms a step "
        f"({sum(t.outcome == 'kept' for t in trials)} of {len(trials)} changes kept)")
    return Tuned(best, start_ms, inc_ms, trials)


def _trial(bench, inc, cand, where, field, value, config):
    # (the Trial, the candidate's runner where it ran)
    try:
        bench.check(cand)
        runner = bench.load(cand)
    except DejavuError as e:  # the kernels disagree with their references under cand
        return Trial(where, field, value, None, None, f"refused: {e}"), None
    except Exception as e:  # noqa: BLE001 - a launch shape this GPU or shape refuses: not a candidate
        return Trial(where, field, value, None, None, f"refused: {type(e).__name__}: {str(e)[:120]}"), None
    ratios, times = [], []
    for _ in range(config.rounds):
        a = inc.time(config.reps)
        b = runner.time(config.reps)
        ratios.append(b / a)
        times.append(b)
    ratio = statistics.median(ratios)
    outcome = "kept" if ratio < 1 - config.min_gain else ("slower" if ratio > 1 + config.min_gain else "within noise")
    return Trial(where, field, value, ratio, statistics.median(times), outcome), runner


def tune_file(path, out=None, device: str = "cuda", config: TuneSettings = TuneSettings(),
              say: Callable[[str], None] | None = None, same_for=()) -> dict:
    """Tune the engine file `path` on `device` and write it to `out` (default: in place) with the tuned settings
    in its header (write_tuned). A tensor-parallel shard is tuned as the single engine of its shape (its
    all-reduces not run); `same_for`: other files of the same shapes (the other ranks' shards), given the same
    settings in place. Returns the header's target.tuned."""
    import os

    from dejavu.engine_file import read_engine
    from dejavu.runtime.engine import Engine, _device

    dev = _device(device)
    if dev.type != "cuda":
        raise DejavuError("tune: launch shapes are timed on a GPU: give --device cuda (or cuda:N)")
    for p in (path, *same_for):
        if not os.path.isfile(p):
            raise DejavuError(f"engine file not found: {p}")
    header, tensors = read_engine(path, "cpu")
    if header.get("model_family") != "llama":
        raise DejavuError("tune: only Llama-family engines have launch shapes to tune (their input-sparse GEMVs)")
    engine = Engine.from_tensors(_standalone(header), tensors, device=dev)  # a GPU copy; the file's stay here
    result = tune_engine(engine, config, say=say)
    engine.release()
    del engine
    gpu = torch.cuda.get_device_name(dev)
    tuned = write_tuned(out or path, header, tensors, result, gpu, config.prompt_len)
    for p in same_for:
        write_tuned(p, *read_engine(p, "cpu"), result, gpu, config.prompt_len)
    return tuned


def _standalone(header: dict) -> dict:
    # a shard's header as the single engine of its shape (H/n heads, Hkv/n KV heads, F/n neurons); others as they are
    bc = header.get("build_config") or {}
    return {**header, "build_config": {k: v for k, v in bc.items() if k != "tp"}} if bc.get("tp") else header


def write_tuned(path, header: dict, tensors: dict, result: Tuned, gpu: str, prompt_len: int) -> dict:
    """The engine (header, tensors) written to `path` with result's settings as its target's (target.kernel_settings;
    the runtime takes them on the GPU they were timed on: runtime/ops.header_settings) and target.tuned: the GPU,
    the date, the step before and after, every trial. Atomic: no partial file. Returns target.tuned."""
    from dejavu.engine_file import write_engine
    from dejavu.fileio import atomic_path

    tuned = result.record(gpu, prompt_len)
    target = {**header.get("target", {}), "device": "cuda", "arch": result.settings.arch, "name": gpu,
              "kernel_settings": result.settings.to_dict(), "tuned": tuned}
    with atomic_path(path) as tmp:
        write_engine(tmp, {**header, "target": target}, tensors)
    return tuned
