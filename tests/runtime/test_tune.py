"""runtime/tune.py: a Llama engine's launch shapes tuned by timing its decode step (dejavu-tune)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_engine
from dejavu.errors import DejavuError
from dejavu.plugins.settings import DEFAULT, PROJECTIONS, KernelSettings, resolve_kernel_settings
from dejavu.runtime.tune import ATTN, Trial, TuneSettings, Tuned, search_space, setting, tune_engine, with_setting
from llama_helpers import write_tiny_llama

H200 = resolve_kernel_settings("sm_90", 132)


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    path = root / "d0.6.engine"
    build_engine(write_tiny_llama(root / "tiny", seed=3), BuildConfig(density=0.6, calib_tokens=512, calib_window=128,
                                                                        dtype="float32"), path, progress=False)
    return path


def test_a_setting_is_what_the_kinds_launches_read():
    """with_setting moves one kind's field (or the attention's) and nothing else; the table's own value is no
    triple; setting reads back what LlamaOps launches each kind with."""
    from dejavu.runtime.llama_decoder import LlamaOps

    def launched(settings):  # each kind's input-sparse fields (its triples applied; the triples themselves aside)
        return {k: dataclasses.replace(v.input_sparse, projections=()) for k, v in LlamaOps("triton", settings).kinds.items()}

    base = launched(H200)
    for where, field, values in search_space(132):
        for v in values:
            s = with_setting(H200, where, field, v)
            assert setting(s, where, field) == v
            kinds = launched(s)
            if where == ATTN:
                assert s.gqa_attn.block_s == v and s.input_sparse == H200.input_sparse
                continue
            assert getattr(kinds[where], field) == v
            assert all(kinds[k] == base[k] for k in PROJECTIONS if k != where)
    back = with_setting(with_setting(H200, "gate_up", "block_k", 128), "gate_up", "block_k", 64)
    assert back == H200 and H200.input_sparse.projections == (("gate_up", "block_k", 64),)
    assert with_setting(H200, "gate_up", "block_k", 128).input_sparse.projections == ()  # 128 is the table's
    assert [v for w, f, v in search_space(132) if (w, f) == ("o", "target_programs")] == [(264, 396, 528, 792)]
    with pytest.raises(DejavuError, match="projection kind"):
        with_setting(H200, "lm_head", "block_k", 64)


class _ModelBench:
    """A bench whose step time is a model: 5 ms plus, per (where, field), a cost by value; its kernel check fails
    for `wrong` settings; `fail` settings raise at load. Counts the loads."""

    sm_count = 132

    def __init__(self, costs: dict, wrong=(), fail=(), noise: float = 0.0):
        self.costs, self.wrong, self.fail, self.noise = costs, set(wrong), set(fail), noise
        self.loads, self.gen = 0, torch.Generator().manual_seed(0)

    def check(self, s: KernelSettings):
        if {(w, f, setting(s, w, f)) for w, f, _ in search_space(132)} & self.wrong:
            raise DejavuError("input_sparse_gemv disagrees with its reference on this engine (max |diff| 0.5)")

    def load(self, s: KernelSettings):
        self.loads += 1
        chosen = {(w, f, setting(s, w, f)) for w, f, _ in search_space(132)}
        if chosen & self.fail:
            raise RuntimeError("out of resources")
        ms = 5.0 + sum(self.costs.get(c, 0.0) for c in chosen)
        bench = self

        class Runner:
            def time(self, reps):
                return ms * (1 + bench.noise * float(torch.randn((), generator=bench.gen)))

            def release(self):
                pass

        return Runner()


class _Engine:
    def __init__(self, family="llama", skip=0.5):
        from types import SimpleNamespace

        self.header = {"model_family": family}
        self.spec = SimpleNamespace(skip=skip)
        self.ops = SimpleNamespace(settings=H200)
        self.decoder = SimpleNamespace(reduce=None)


def test_descent_keeps_what_the_step_gains_and_refuses_what_disagrees():
    """Coordinate descent from the engine's settings lands on each field's fastest value where the step gains more
    than min_gain; a gain inside it, a candidate whose kernels disagree with their references (even a faster one)
    and one that fails to launch are not kept; the reported times are the model's."""
    costs = {("gate_up", "block_k", 64): 0.10,  # the engine's own gate/up block_k is 0.10 ms slower than 128
             ("gate_up", "target_programs", 264): 0.06, ("gate_up", "target_programs", 396): 0.05,
             ("gate_up", "target_programs", 528): 0.08,
             ("o", "block_m", 64): 0.04, ("o", "block_m", 16): 0.02,  # o's block_m 32 gains 0.8%
             ("down", "block_m", 64): 0.01,  # 0.2%: inside min_gain 0.5%
             (ATTN, "block_s", 32): 0.0, (ATTN, "block_s", 64): -0.3}  # faster, but its logits disagree
    bench = _ModelBench(costs, wrong={(ATTN, "block_s", 64)}, fail={("qkv", "block_k", 64)})
    got = tune_engine(_Engine(), TuneSettings(rounds=3), bench=bench)
    s = got.settings
    assert setting(s, "gate_up", "block_k") == 128 and setting(s, "gate_up", "target_programs") == 792
    assert setting(s, "o", "block_m") == 32 and setting(s, "down", "block_m") == 64
    assert setting(s, "qkv", "block_k") == 128 and s.gqa_attn.block_s == 32
    by = {(t.where, t.field, t.value): t for t in got.trials}
    assert by[("down", "block_m", 32)].outcome == "within noise"
    assert by[(ATTN, "block_s", 64)].outcome.startswith("refused: input_sparse_gemv disagrees")
    assert by[("qkv", "block_k", 64)].outcome == "refused: RuntimeError: out of resources"
    assert got.start_ms == pytest.approx(5.0 + 0.10 + 0.08 + 0.04 + 0.01)
    assert got.ms == pytest.approx(5.0 + 0.01)
    # a second pass ran (the first changed something) and kept nothing more
    assert len(got.trials) > len(search_space(132)) and sum(t.outcome == "kept" for t in got.trials) == 4
    assert all(isinstance(t, Trial) for t in got.trials)


def test_noise_within_min_gain_changes_nothing():
    """Every candidate the same step time, timings with 0.1% noise: no change is kept (the median of the rounds'
    ratios stays inside min_gain), and one pass runs."""
    got = tune_engine(_Engine(), TuneSettings(rounds=5), bench=_ModelBench({}, noise=0.001))
    assert got.settings == H200 and len(got.trials) == sum(len(v) - 1 for *_, v in search_space(132))
    assert {t.outcome for t in got.trials} == {"within noise"}


def test_budget_and_what_cannot_be_tuned():
    bench = _ModelBench({("gate_up", "block_k", 64): 1.0})
    got = tune_engine(_Engine(), TuneSettings(budget_s=0.0), bench=bench)
    assert got.settings == H200 and got.trials == [] and bench.loads == 1
    for eng, why in ((_Engine("opt"), "Llama-family"), (_Engine(skip=0.0), "dense engine")):
        with pytest.raises(DejavuError, match=why):
            tune_engine(eng, bench=bench)


def test_a_tuned_header_is_what_the_runtime_reads(engine_path, tmp_path):
    """write_tuned: the same tensors, the tuned settings as the target's (read back equal), target.tuned recorded;
    the runtime takes them where the arch matches and resolves its own elsewhere (here: the CPU)."""
    from dejavu.runtime.ops import settings_for
    from dejavu.runtime.tune import write_tuned

    header, tensors = read_engine(engine_path)
    tuned = with_setting(with_setting(H200, "o", "block_m", 32), "gate_up", "target_programs", 792)
    trials = [Trial("o", "block_m", 32, 0.98, 4.9, "kept")]
    out = tmp_path / "tuned.engine"
    rec = write_tuned(out, header, tensors, Tuned(tuned, 5.0, 4.9, trials), "NVIDIA H200", 128)
    h2, t2 = read_engine(out)
    assert t2.keys() == tensors.keys() and all(torch.equal(t2[k], tensors[k]) for k in tensors)
    assert KernelSettings.from_dict(h2["target"]["kernel_settings"]) == tuned
    assert h2["target"]["tuned"] == json.loads(json.dumps(rec)) and rec["step_ms"] == [5.0, 4.9]
    assert h2["target"]["arch"] == "sm_90" and h2["sparsity"] == header["sparsity"]
    assert settings_for(h2["target"], torch.device("cpu")) == DEFAULT  # another device: its own settings
    from dejavu.compiler.cli import format_llama_header

    assert ("target      cuda arch=sm_90, tuned on NVIDIA H200 (" in format_llama_header(h2, "t", 1)
            and "5.000 -> 4.900 ms a decode step; kept o.block_m=32" in format_llama_header(h2, "t", 1))


def test_a_shard_is_tuned_as_the_engine_of_its_shape(tmp_path):
    """A tensor-parallel shard (refused as a model by Engine) is timed as the single engine of its shape (H/n heads,
    Hkv/n KV heads, F/n neurons, its all-reduces not run); its header keeps build_config.tp when written back."""
    from dejavu.runtime import Engine
    from dejavu.runtime.tune import _standalone, write_tuned
    from dejavu.shards import shard_path

    out = tmp_path / "tp.engine"
    build_engine(write_tiny_llama(tmp_path / "m", seed=3), BuildConfig(density=0.6, tp=2, calib_tokens=512,
                                                                          calib_window=128, dtype="float32"),
                 out, progress=False)
    path = shard_path(out, 1, 2)
    header, tensors = read_engine(path)
    with pytest.raises(DejavuError, match="tensor-parallel shard 1 of 2"):
        Engine.from_tensors(header, tensors)
    eng = Engine.from_tensors(_standalone(header), tensors)
    assert eng.describe()["heads"] == 3 and eng.describe()["kv_heads"] == 1 and eng.describe()["ffn"] == 40
    costs = {("o", "block_m", 64): 0.2, ("o", "block_m", 16): 0.1}
    got = tune_engine(eng, TuneSettings(rounds=1), bench=_ModelBench(costs))
    assert setting(got.settings, "o", "block_m") == 32
    write_tuned(path, header, tensors, got, "NVIDIA H200", 128)
    h2, _ = read_engine(path)
    assert h2["build_config"] == header["build_config"] and h2["build_config"]["tp"]["rank"] == 1
    assert KernelSettings.from_dict(h2["target"]["kernel_settings"]) == got.settings


def test_dejavu_tune_refuses_in_one_line(engine_path, tmp_path, capsys):
    from dejavu.runtime.cli import tune_main

    before = engine_path.read_bytes()
    for argv, why in (([str(engine_path), "--device", "cpu"], "--device must be cuda"),
                      ([str(tmp_path / "none.engine")], "engine file not found"),
                      ([str(engine_path), "--budget-s", "0"], "--budget-s must be > 0")):
        with pytest.raises(SystemExit) as e:
            tune_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and why in err
    assert engine_path.read_bytes() == before and list(tmp_path.iterdir()) == []


def test_dejavu_compile_tune_refuses_before_building(tmp_path, capsys):
    """--tune without a GPU target or for an OPT model: one line, exit 2, nothing written."""
    from dejavu.compiler.cli import main as compile_main

    folder = write_tiny_llama(tmp_path / "m", seed=1)
    out = tmp_path / "x.engine"
    for argv, why in (([str(folder), "--tune"], "needs --device cuda"),
                      (["opt-mini", "--tune", "--device", "cuda"], "only Llama-family")):
        with pytest.raises(SystemExit) as e:
            compile_main([*argv, "--density", "0.6", "-o", str(out), "-q"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.count("\n") == 0 and why in err
    assert not out.exists()


def test_every_candidate_launch_computes_the_step_under_the_interpreter(engine_path):
    """Each launch shape of the search space, applied in turn (a bench that takes every candidate as 1% faster
    than the last, so each is kept and the next is tried on top of it), passes the kernel check with the real
    kernels under Triton's interpreter (every projection kind's GEMV and the attention against their references:
    none refused), and the last settings' decode step equals the reference ops' (ATOL 1e-4)."""
    pytest.importorskip("triton")
    script = f"""
import json, torch
from dejavu.plugins.settings import resolve_kernel_settings
from dejavu.runtime import Engine
from dejavu.runtime.llama_decoder import LlamaDecoder, LlamaOps
from dejavu.runtime.tune import TuneSettings, tune_engine
ref = Engine.load({str(engine_path)!r})
eng = Engine.load({str(engine_path)!r}, backend="triton", kernel_settings=resolve_kernel_settings("sm_90", 132))
P, tok = 5, torch.tensor([7])

class Bench:
    sm_count, loads = 132, 0
    def check(self, s):
        LlamaOps("triton", s).verify(eng.spec, eng.tensors, kinds=("qkv", "o", "gate_up", "down"))
    def load(self, s):
        Bench.loads += 1
        dec = LlamaDecoder(eng.spec, eng.tensors, eng.device, LlamaOps("triton", s))
        dec.setup(1, 16)
        with torch.inference_mode():
            dec.prefill(torch.arange(3, 3 + P)[None], torch.tensor([P]))
        ms = 10.0 * 0.99 ** Bench.loads
        class R:
            def logits(self):
                with torch.inference_mode():
                    return dec.decode_step(tok, torch.tensor([P])).float().clone()
            def time(self, reps):
                return ms
            def release(self):
                pass
        return R()

got = tune_engine(eng, TuneSettings(passes=1, rounds=1), bench=Bench())
dec = LlamaDecoder(ref.spec, ref.tensors, ref.device, LlamaOps("ref"))
dec.setup(1, 16)
with torch.inference_mode():
    dec.prefill(torch.arange(3, 3 + P)[None], torch.tensor([P]))
    want = dec.decode_step(tok, torch.tensor([P]))
    last = Bench().load(got.settings).logits()
print(json.dumps({{"outcomes": [t.outcome for t in got.trials], "diff": float((last - want).abs().max())}}))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["outcomes"] == ["kept"] * sum(len(v) - 1 for *_, v in search_space(132))
    assert row["diff"] <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing needs a CUDA device")
def test_tune_file_on_a_gpu(tmp_path):
    """On a GPU: dejavu-tune writes an engine whose recorded settings the runtime takes, and it decodes what the
    untuned engine decodes (logits to the kernels' tolerance)."""
    from dejavu.runtime import Engine
    from dejavu.runtime.cli import tune_main

    folder = write_tiny_llama(tmp_path / "m", seed=4)
    path = tmp_path / "a.engine"
    build_engine(folder, BuildConfig(density=0.6, calib_tokens=512, calib_window=128, dtype="float16",
                                     device="cuda"), path, progress=False)
    assert tune_main([str(path), "-o", str(tmp_path / "b.engine"), "--budget-s", "20", "-q"]) == 0
    a, b = Engine.load(path, device="cuda"), Engine.load(tmp_path / "b.engine", device="cuda")
    h = b.header["target"]
    assert b.ops.settings == KernelSettings.from_dict(h["kernel_settings"]) and h["tuned"]["trials"]
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    la, lb = a.decode_logits(ids), b.decode_logits(ids)
    assert float((la - lb).abs().max()) <= 2e-2 * float(la.abs().max())
