"""A model folder's chat template (tokenizer_config.json) is carried into the engine header;
without one the header has no such key (headers of OPT models are unchanged)."""
from __future__ import annotations

import json

from dejavu.compiler.build import build_engine
from dejavu.compiler.config import BuildConfig
from dejavu.engine_file import read_header

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_chat_template_into_header(make_tiny_opt_dir, tmp_path):
    folder = make_tiny_opt_dir()
    cfg = BuildConfig(density=1.0, no_predictors=True)
    build_engine(folder, cfg, tmp_path / "plain.engine", progress=False)
    assert "chat_template" not in read_header(tmp_path / "plain.engine")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": TEMPLATE}))
    build_engine(folder, cfg, tmp_path / "chat.engine", progress=False)
    assert read_header(tmp_path / "chat.engine")["chat_template"] == TEMPLATE
