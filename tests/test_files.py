"""formats/files.py: the temp-folder-and-rename writer."""

import pytest


def test_atomic_folder(tmp_path, monkeypatch):
    """Filled then swapped in; an error inside (or in the rename) leaves the old folder and no temp."""
    from pact.formats import files

    out = tmp_path / "out"
    with files.atomic_folder(out) as tmp:
        (tmp / "a").write_text("1")
    assert (out / "a").read_text() == "1"
    with pytest.raises(RuntimeError), files.atomic_folder(out) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("stop")
    monkeypatch.setattr(files, "replace_by_rename", lambda a, b: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(OSError), files.atomic_folder(out) as tmp:
        (tmp / "a").write_text("3")
    assert (out / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
