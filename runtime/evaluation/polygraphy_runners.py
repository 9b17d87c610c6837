"""Polygraphy runners over dejavu's backends: each maps {"input_ids": int64 [B, S]} to
{"logits": float32 [B, S, V]}, so Polygraphy's Comparator can line them up by output name.

    DenseTorchRunner   the dense PyTorch model (the reference)
    EngineRunner       a .engine through `Engine.logits` (token-parallel sparse logits)
    OnnxLogitsRunner   ONNX Runtime on an exported ONNX (dense, or the sparse form (a)),
                       with other model inputs (attention_mask, position_ids) filled in

Models load in `activate_impl` and are dropped in `deactivate_impl` (Polygraphy's runner
life cycle), so a comparison holds one model at a time when run through `Comparator.run`.
"""
from __future__ import annotations

import time

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from dejavu.errors import DejavuError

INPUT = "input_ids"
OUTPUT = "logits"


def _ids_metadata() -> TensorMetadata:
    return TensorMetadata().add(INPUT, np.int64, (None, None))


class _TorchLogitsRunner(BaseRunner):
    """Shared infer: numpy ids -> torch -> logits_fn -> numpy float32."""

    def __init__(self, device: str = "cpu", name: str | None = None, prefix: str = "dejavu"):
        super().__init__(name=name, prefix=prefix)
        self.device = device
        self._logits_fn = None

    def get_input_metadata_impl(self):
        return _ids_metadata()

    def infer_impl(self, feed_dict):
        import torch

        ids = torch.from_numpy(np.ascontiguousarray(feed_dict[INPUT])).long().to(self.device)  # [B, S]
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = self._logits_fn(ids)  # [B, S, V]
        out = logits.float().cpu().numpy()
        self.inference_time = time.perf_counter() - t0
        return {OUTPUT: out}

    def deactivate_impl(self):
        self._logits_fn = None


class DenseTorchRunner(_TorchLogitsRunner):
    """The dense OPT in PyTorch, loaded with `dejavu.models.loader.load_model` in `dtype` (float32 unless given)."""

    def __init__(self, model: str, device: str = "cpu", name: str | None = None, dtype: str | None = None):
        super().__init__(device, name or f"dense-torch[{model}]")
        self.model = model
        self.dtype = dtype

    def activate_impl(self):
        import torch

        from dejavu.models.loader import load_model

        m, _ = load_model(self.model, dtype=getattr(torch, self.dtype or "float32"), device=self.device)
        self._logits_fn = m


class EngineRunner(_TorchLogitsRunner):
    """A dejavu engine: every position with its own sparse selection (`Engine.logits`), in `dtype`
    (None: the engine's own)."""

    def __init__(self, engine_path: str, device: str = "cpu", name: str | None = None, dtype: str | None = None):
        super().__init__(device, name or f"engine[{engine_path}]")
        self.engine_path = engine_path
        self.dtype = dtype
        self.engine = None

    def activate_impl(self):
        from dejavu.runtime.engine import Engine

        self.engine = Engine.load(self.engine_path, self.device, dtype=self.dtype)
        self._logits_fn = self.engine.logits

    def deactivate_impl(self):
        self.engine = None
        self._logits_fn = None


class OnnxLogitsRunner(BaseRunner):
    """ONNX Runtime (CPU) on an exported model; the first output (or `logits`) is reported."""

    def __init__(self, onnx_path: str, name: str | None = None):
        super().__init__(name=name or f"onnxrt[{onnx_path}]", prefix="onnxrt")
        self.onnx_path = onnx_path
        self.session = None

    def activate_impl(self):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(self.onnx_path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - ORT raises its own types for bad files / custom ops
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DejavuError(f"{self.onnx_path}: ONNX Runtime cannot load it ({first})") from None
        names = [i.name for i in self.session.get_inputs()]
        if INPUT not in names:
            raise DejavuError(f"{self.onnx_path}: no '{INPUT}' input (inputs: {', '.join(names)})")
        outs = [o.name for o in self.session.get_outputs()]
        self._out = OUTPUT if OUTPUT in outs else outs[0]

    def get_input_metadata_impl(self):
        return _ids_metadata()

    def _feed(self, ids: np.ndarray) -> dict:
        B, S = ids.shape
        feed = {}
        for inp in self.session.get_inputs():
            dt = np.int32 if "int32" in inp.type else np.int64
            if inp.name == INPUT:
                feed[inp.name] = ids.astype(dt)
            elif inp.name == "attention_mask":
                feed[inp.name] = np.ones((B, S), dtype=dt)
            elif inp.name == "position_ids":
                feed[inp.name] = np.broadcast_to(np.arange(S, dtype=dt), (B, S)).copy()
            else:
                raise DejavuError(f"{self.onnx_path}: do not know how to feed input {inp.name!r}")
        return feed

    def infer_impl(self, feed_dict):
        t0 = time.perf_counter()
        out = self.session.run([self._out], self._feed(np.asarray(feed_dict[INPUT])))[0]
        self.inference_time = time.perf_counter() - t0
        return {OUTPUT: np.asarray(out, dtype=np.float32)}

    def deactivate_impl(self):
        self.session = None
