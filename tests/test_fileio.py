"""dejavu.fileio.write_json: JSON and a final newline, written atomically (nothing left when it fails)."""
import json

import pytest

from dejavu.fileio import write_json


def test_write_json_indent_sort_keys_and_nothing_left_on_failure(tmp_path):
    obj = {"b": [1, 2], "a": {"z": None, "y": "é"}}
    p = write_json(str(tmp_path / "r.json"), obj, indent=1, sort_keys=True)
    assert p == tmp_path / "r.json"
    text = p.read_text(encoding="utf-8")
    assert text.endswith("}\n") and json.loads(text) == obj
    assert text == json.dumps(obj, indent=1, sort_keys=True) + "\n"
    assert text.index('"a"') < text.index('"b"') and '\n "a": {\n  "y"' in text
    write_json(tmp_path / "d.json", obj)  # default indent 2
    assert (tmp_path / "d.json").read_text() == json.dumps(obj, indent=2) + "\n"
    write_json(tmp_path / "flat.json", obj, indent=None)
    assert (tmp_path / "flat.json").read_text() == json.dumps(obj) + "\n"
    with pytest.raises(TypeError):  # not serializable: json.dumps raises before anything lands
        write_json(tmp_path / "bad.json", {"x": object()}, indent=1)
    with pytest.raises(TypeError):  # an existing file is kept as it was
        write_json(tmp_path / "r.json", {"x": {1, 2}})
    assert sorted(q.name for q in tmp_path.iterdir()) == ["d.json", "flat.json", "r.json"]  # no temporary file
    assert (tmp_path / "r.json").read_text(encoding="utf-8") == text
    write_json(tmp_path / "s.json", {"x": {1, 2}}, indent=None, default=sorted)
    assert json.loads((tmp_path / "s.json").read_text()) == {"x": [1, 2]}


def test_atomic_files_take_the_umasks_mode_not_mkstemps(tmp_path):
    import os

    from dejavu import fileio

    old, cached = os.umask(0o027), fileio._UMASK
    fileio._UMASK = None  # read once per process: read again under this umask
    try:
        write_json(tmp_path / "a.json", [1])
    finally:
        os.umask(old)
        fileio._UMASK = cached
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640  # as open() would make it under that umask
