"""An artifact from someone else is the normal case: opening one never follows a path outside its
folder, never runs code it ships, and the converter ships only the files a model needs."""

import json
import os
import shutil

import pytest

from conftest import make_model
from pact.convert import convert
from pact.formats import ArtifactError, open_artifact


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("untrusted")
    src = d / "src"
    make_model(src, "llama")
    (src / ".env").write_text("API_KEY=secret\n")
    (src / "helper.py").write_text("print('hello')\n")
    os.symlink("/etc/hostname", src / "hostname.txt")
    convert(str(src), d / "art", progress=False)
    return d


def _copy(base, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(base / "art", art, symlinks=True)
    return art


def _edit_manifest(art, edit):
    f = art / "zarr.json"
    root = json.loads(f.read_text())
    edit(root["attributes"]["pact"])
    f.write_text(json.dumps(root))


def test_converter_ships_only_model_files(base):
    shipped = sorted(p.name for p in (base / "art" / "hf").iterdir())
    assert not {".env", "helper.py", "hostname.txt"} & set(shipped), shipped
    assert {"config.json", "tokenizer.json"} <= set(shipped)
    open_artifact(base / "art").verify()


def test_symlink_inside_is_refused(base, tmp_path):
    art = _copy(base, tmp_path)
    os.symlink("/etc", art / "hf" / "rootlink")
    with pytest.raises(ArtifactError, match="rootlink: a symbolic link inside the artifact"):
        open_artifact(art)


def test_symlinked_chunk_is_refused(base, tmp_path):
    art = _copy(base, tmp_path)
    name = open_artifact(art).names("nvfp4")[0]
    chunk = art / "tensors" / name / "fwd_packed" / "c" / "0" / "0"
    assert chunk.is_file()
    target = tmp_path / "elsewhere"
    shutil.copyfile(chunk, target)
    chunk.unlink()
    os.symlink(target, chunk)
    with pytest.raises(ArtifactError, match="symbolic link"):
        open_artifact(art)


@pytest.mark.parametrize("where", ["file-dotdot", "file-absolute", "array-dotdot", "array-absolute"])
def test_paths_outside_are_refused(base, tmp_path, where):
    art = _copy(base, tmp_path)
    bad = "../../x/PWNED" if where.endswith("dotdot") else "/etc/hostname"

    def edit(meta):
        if where.startswith("file"):
            meta["files"][bad] = "0" * 64
        else:
            first = next(iter(meta["tensors"].values()))
            next(iter(first["arrays"].values()))["path"] = bad
    _edit_manifest(art, edit)
    with pytest.raises(ArtifactError, match="points outside the artifact"):
        open_artifact(art)


def test_code_in_an_artifact_is_refused(base, tmp_path):
    art = _copy(base, tmp_path)
    (art / "hf" / "evil_code.py").write_text("import os; os.system('touch /tmp/pwned')\n")
    with pytest.raises(ArtifactError, match="evil_code.py: the artifact ships code"):
        open_artifact(art)
    (art / "hf" / "evil_code.py").unlink()
    cfg = art / "hf" / "tokenizer_config.json"
    doc = json.loads(cfg.read_text())
    doc["auto_map"] = {"AutoTokenizer": ["evil_code.EvilTokenizer", None]}
    cfg.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="tokenizer_config.json: asks for custom code"):
        open_artifact(art)


def test_cli_refuses_in_one_line(base, tmp_path):
    from click.testing import CliRunner

    from pact.pipelines.train import main as train_cli

    art = _copy(base, tmp_path)
    os.symlink("/etc/hostname", art / "hf" / "leak")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": " b"}) + "\n")
    r = CliRunner().invoke(train_cli, [str(art), "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1"])
    assert r.exit_code != 0
    assert "symbolic link inside the artifact" in r.output and "Traceback" not in r.output, r.output


def test_overwrite_never_deletes_what_is_not_an_artifact(base, tmp_path):
    from pact.formats import PactError

    src = tmp_path / "model"
    shutil.copytree(base / "src", src, symlinks=True)
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(PactError, match="is not a pact artifact: --overwrite only replaces an artifact"):
        convert(str(src), src, overwrite=True, progress=False)  # pact-convert SRC SRC --overwrite
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(PactError, match="is not a pact artifact"):
        convert(str(src), home, overwrite=True, progress=False)
    assert sorted(p.name for p in src.iterdir()) == before and (home / "thesis.tex").is_file()
    art = tmp_path / "art"
    convert(str(src), art, progress=False)
    convert(str(src), art, overwrite=True, progress=False)  # an artifact is replaced, as asked
    open_artifact(art).verify()
