"""Shared fixtures: a random tiny OPT checkpoint folder in Hugging Face layout.

    tiny_opt_dir        session-wide folder (treat as read-only): config.json,
                        model.safetensors (no lm_head: tied), tokenizer.json
    make_tiny_opt_dir   factory: make_tiny_opt_dir(seed=0, **config_overrides) -> Path,
                        a fresh folder under the test's tmp_path (free to modify)

config.json says torch_dtype float32 (the stored dtype), so transformers loads it in fp32.
The model: vocab 320, hidden 32, 2 layers, 4 heads, ffn 128, 64 positions, pre-LN, with
random weights (LayerNorm and biases too, so bugs in them show). The tokenizer is a
byte-level BPE trained on a slice of the shipped WikiText-2 test text, `</s>` = id 2.
Needs only torch, safetensors and tokenizers (no transformers).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_CONFIG = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=32)


_BACKGROUND_MODULES: list = []


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    """Test modules with a `start_background(names)` and a BACKGROUND dict (tests/runtime/
    test_runtime_triton_interp.py: decode runs in the Triton interpreter, in subprocesses of minutes each)
    get the names of their collected tests now, so their scripts run beside the rest of the suite;
    `stop_background()` at the session's end. Under pytest-xdist (`-n 2`) each worker runs them inline
    instead, and those tests go first (in BACKGROUND's order, the same in every worker) so the workers
    start on them rather than end on them."""
    if config.option.collectonly:
        return
    names: dict = {}
    for item in items:
        mod = getattr(item, "module", None)
        if mod is not None and callable(getattr(mod, "start_background", None)):
            names.setdefault(mod, []).append(item.originalname)
    if hasattr(config, "workerinput"):
        order = {(mod, n): i for mod in names for i, n in enumerate(mod.BACKGROUND)}
        items.sort(key=lambda it: order.get((getattr(it, "module", None), getattr(it, "originalname", None)),
                                            len(order)))  # a stable sort: the rest keep their order
        return
    for mod, ns in names.items():
        mod.start_background(ns)
        _BACKGROUND_MODULES.append(mod)


def pytest_sessionfinish(session):
    for mod in _BACKGROUND_MODULES:
        mod.stop_background()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test uses tiny models, which run fastest on one thread on the small, shared CI
    machines (more threads only spin-wait)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


from tiny_tokenizer import tiny_tokenizer_json  # noqa: E402,F401 - re-exported for the fixtures below


def random_opt_state(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """State dict (HF names, without the tied lm_head) of a randomly initialised OPT."""
    from dejavu.models.opt import OPTForCausalLM

    torch.manual_seed(seed)
    model = OPTForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else 0.15)
    return {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def write_tiny_opt(folder: Path, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors and tokenizer.json of a random OPT into `folder`."""
    from safetensors.torch import save_file

    from dejavu.models.opt import OPTConfig

    folder.mkdir(parents=True, exist_ok=True)
    cfg = OPTConfig(**{**TINY_CONFIG, **overrides})
    hf = {**cfg.to_hf_dict(), "torch_dtype": "float32"}  # the stored weights are fp32
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    save_file(random_opt_state(cfg, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    if cfg.vocab_size >= 320:
        (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    return folder


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory) -> Path:
    """A random tiny OPT folder shared by the whole session; do not modify it."""
    return write_tiny_opt(tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture
def make_tiny_opt_dir(tmp_path):
    """Factory for fresh tiny OPT folders: make_tiny_opt_dir(seed=0, **config_overrides)."""
    count = iter(range(1_000_000))

    def make(seed: int = 0, **overrides) -> Path:
        return write_tiny_opt(tmp_path / f"tiny-opt-{next(count)}", seed, **overrides)

    return make
