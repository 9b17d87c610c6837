"""The .engine format: round trip, determinism, and every corruption → DejavuError."""
from __future__ import annotations

import json
import random
import struct
import time

import pytest
import torch

from dejavu.engine_file import (FORMAT_VERSION, encode_engine, expected_shapes, read_engine,
                                read_header, write_engine)
from dejavu.errors import DejavuError
from helpers_compiler import random_predictors, tiny_config


def _engine(seed=0):
    cfg = tiny_config()
    header = {"format": "dejavu-engine", "format_version": FORMAT_VERSION,
              "model_config": cfg.to_hf_dict(), "dtype": "float32",
              "build_config": {"mlp_k": [10, 12], "attn_k": [2, 3], "predictors": True},
              "target": {"device": "cpu", "arch": None, "kernel_settings": {}},
              "tokenizer_json": "{\"model\": \"é\"}"}
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(s, generator=g) for k, s in expected_shapes(header).items()}
    tensors.update(random_predictors(cfg))
    return header, tensors


def test_round_trip(tmp_path):
    header, tensors = _engine()
    p = tmp_path / "m.engine"
    n = write_engine(p, header, tensors)
    assert p.stat().st_size == n
    assert read_header(p) == header
    h2, t2 = read_engine(p)
    assert h2 == header and set(t2) == set(tensors)
    assert all(torch.equal(t2[k], tensors[k]) for k in tensors)
    assert [x.name for x in tmp_path.iterdir()] == ["m.engine"]  # no temporary left


def test_valid_safetensors(tmp_path):
    from safetensors import safe_open
    header, tensors = _engine()
    write_engine(tmp_path / "m.engine", header, tensors)
    with safe_open(str(tmp_path / "m.engine"), "pt") as f:
        assert json.loads(f.metadata()["dejavu_header"]) == header
        assert torch.equal(f.get_tensor("layers.1.mlp.w2_t"), tensors["layers.1.mlp.w2_t"])


def test_deterministic_bytes():
    header, tensors = _engine()
    shuffled = dict(reversed(list(tensors.items())))
    assert encode_engine(header, tensors) == encode_engine(dict(reversed(list(header.items()))), shuffled)


def test_wrong_version_names_both(tmp_path):
    header, tensors = _engine()
    header["format_version"] = 7
    write_engine(tmp_path / "m.engine", header, tensors)
    for fn in (read_header, read_engine):
        with pytest.raises(DejavuError, match=r"version 7 .*version 1"):
            fn(tmp_path / "m.engine")


def test_missing_and_misshaped_tensors(tmp_path):
    header, tensors = _engine()
    t = dict(tensors)
    del t["layers.1.attn.wkv"]
    write_engine(tmp_path / "a.engine", header, t)
    with pytest.raises(DejavuError, match="missing tensor 'layers.1.attn.wkv'"):
        read_engine(tmp_path / "a.engine")
    t = dict(tensors, **{"layers.0.mlp.w1": torch.zeros(3, 3)})
    write_engine(tmp_path / "b.engine", header, t)
    with pytest.raises(DejavuError, match="layers.0.mlp.w1"):
        read_engine(tmp_path / "b.engine")
    t = {k: v.half() for k, v in tensors.items()}
    write_engine(tmp_path / "c.engine", header, t)
    with pytest.raises(DejavuError, match="engine dtype"):
        read_engine(tmp_path / "c.engine")


def test_missing_file_and_unwritable(tmp_path):
    with pytest.raises(DejavuError, match="not found"):
        read_engine(tmp_path / "nope.engine")
    header, tensors = _engine()
    with pytest.raises(DejavuError, match="does not exist"):
        write_engine(tmp_path / "no" / "dir" / "m.engine", header, tensors)


def _mutations(blob: bytes, rng: random.Random):
    """Yield (description, corrupted bytes): flips in header and data, truncations, edits."""
    (n,) = struct.unpack("<Q", blob[:8])
    for i in range(60):  # flipped bytes in the length, the JSON header and the data
        region = (0, 8) if i % 6 == 0 else (8, 8 + n) if i % 2 else (8 + n, len(blob))
        pos = rng.randrange(*region)
        b = bytearray(blob)
        b[pos] ^= rng.randrange(1, 256)
        yield f"flip@{pos}", bytes(b)
    for _ in range(40):
        cut = rng.randrange(0, len(blob))
        yield f"truncate@{cut}", blob[:cut]
    yield "append", blob + b"\0" * 8
    yield "huge-length", struct.pack("<Q", 2**63) + blob[8:]
    yield "empty", b""
    yield "nan-header", struct.pack("<Q", 16) + b'{"a":NaN}       ' + blob[8 + n:]
    yield "deep-json", struct.pack("<Q", 20000) + b"[" * 20000 + blob[8 + n:]
    meta = json.loads(blob[8:8 + n])
    hdr = json.loads(meta["__metadata__"]["dejavu_header"])
    edits = [("density", lambda h: h["build_config"].update(mlp_k=[1, 1])),
             ("format", lambda h: h.update(format="other")),
             ("layers", lambda h: h["model_config"].update(num_hidden_layers=3))]
    for name, fn in edits:  # edited header JSON, re-framed consistently
        h = json.loads(json.dumps(hdr))
        fn(h)
        m = json.loads(json.dumps(meta))
        m["__metadata__"]["dejavu_header"] = json.dumps(h, sort_keys=True, separators=(",", ":"))
        j = json.dumps(m).encode()
        yield f"edit-{name}", struct.pack("<Q", len(j)) + j + blob[8 + n:]


def _semantic_edits(header, tensors):
    """Headers that are consistently checksummed (a buggy writer) but say the wrong thing."""
    def edit(**kw):
        h = json.loads(json.dumps(header))
        for k, v in kw.items():
            node = h
            *path, last = k.split("__")
            for p in path:
                node = node[p]
            node[last] = v
        return h
    return [edit(model_config__num_hidden_layers=10**9), edit(model_config__num_hidden_layers=3),
            edit(model_config__hidden_size=64), edit(model_config="x"), edit(build_config__mlp_k=[1]),
            edit(build_config__attn_k=[0, 9]), edit(build_config="x"), edit(dtype="int8"),
            edit(format="other"), edit(format_version="1"), edit(model_config__model_type="gpt2")]


def test_consistent_but_wrong_headers_rejected(tmp_path):
    header, tensors = _engine()
    p = tmp_path / "bad.engine"
    for h in _semantic_edits(header, tensors):
        p.write_bytes(encode_engine(h, tensors))
        t0 = time.monotonic()
        with pytest.raises(DejavuError):
            read_engine(p)
        assert time.monotonic() - t0 < 2.0, h
    p.write_bytes(encode_engine(header, {**tensors, "extra": torch.zeros(2)}))
    with pytest.raises(DejavuError, match="unexpected tensor 'extra'"):
        read_engine(p)


def test_fuzz_corruption_always_dejavu_error(tmp_path):
    header, tensors = _engine()
    blob = encode_engine(header, tensors)
    rng = random.Random(1234)
    p = tmp_path / "bad.engine"
    count = 0
    for what, data in _mutations(blob, rng):
        p.write_bytes(data)
        t0 = time.monotonic()
        with pytest.raises(DejavuError):
            read_engine(p)
        if what.startswith(("truncate", "huge", "empty", "edit")) or what.startswith("flip@") and int(what[5:]) < 8:
            with pytest.raises(DejavuError):
                read_header(p)
        assert time.monotonic() - t0 < 2.0, what
        count += 1
    assert count > 100


def _int8_engine(header, tensors):
    """The engine with its MLP predictors as int8 rows + fp16 scales (build_config.predictor_dtype)."""
    from dejavu.compiler.predictors import quantize_rows

    header = json.loads(json.dumps(header))
    header["build_config"]["predictor_dtype"] = {"mlp": "int8", "attn": "float"}
    tensors = dict(tensors)
    for name in [n for n in tensors if ".pred_mlp." in n and n.endswith((".a", ".b"))]:
        tensors[name], tensors[name + "_scale"] = quantize_rows(tensors[name])
    return header, tensors


def test_int8_predictors_and_old_engines(tmp_path):
    """An engine without build_config.predictor_dtype (written before it) reads as float predictors; an int8
    one round-trips its int8 rows and fp16 scales; each form's tensors are checked against its header."""
    from dejavu.engine_file import predictor_dtypes

    old_header, old = _engine()
    write_engine(tmp_path / "old.engine", old_header, old)
    h, t = read_engine(tmp_path / "old.engine")
    assert "predictor_dtype" not in h["build_config"] and predictor_dtypes(h) == {"mlp": "float", "attn": "float"}
    assert all(t[k].dtype == torch.float32 for k in t)
    header, tensors = _int8_engine(old_header, old)
    write_engine(tmp_path / "q.engine", header, tensors)
    h, t = read_engine(tmp_path / "q.engine")
    assert predictor_dtypes(h) == {"mlp": "int8", "attn": "float"}
    assert t["layers.1.pred_mlp.a"].dtype == torch.int8 and t["layers.1.pred_mlp.b_scale"].dtype == torch.float16
    assert all(torch.equal(t[k], tensors[k]) for k in tensors)
    bad = [({**tensors, "layers.0.pred_mlp.a": old["layers.0.pred_mlp.a"]}, header, "is F32, expected I8"),
           ({**tensors, "layers.0.pred_mlp.b_scale": tensors["layers.0.pred_mlp.b_scale"].float()}, header,
            "is F32, expected F16"),
           ({k: v for k, v in tensors.items() if k != "layers.1.pred_mlp.a_scale"}, header, "missing tensor"),
           (tensors, old_header, "unexpected tensor"),  # scales an old-form header does not name
           (old, header, "missing tensor")]
    for tens, head, match in bad:
        write_engine(tmp_path / "bad.engine", head, tens)
        with pytest.raises(DejavuError, match=match):
            read_engine(tmp_path / "bad.engine")
    head = json.loads(json.dumps(header))
    head["build_config"]["predictor_dtype"] = {"mlp": "int4", "attn": "float"}
    write_engine(tmp_path / "bad.engine", head, tensors)
    with pytest.raises(DejavuError, match="predictor_dtype must map mlp and attn"):
        read_engine(tmp_path / "bad.engine")
