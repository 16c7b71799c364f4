"""pact-export under attack and accident: --overwrite replaces only an earlier export, by rename; an
export never writes over or into its own inputs; nothing non-finite, no code-loading key and no
weights or pickles beyond its own ship; a wrong adapter or a full disk is one clear line."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import edit_manifest, make_converted_llama, rehash_artifact
from pact.convert import export as E
from pact.convert.export import MARKER, export, read_marker
from pact.formats import PactError, open_artifact

Q = "model.layers.0.self_attn.q_proj.weight"  # [64, 64] in the tiny Llama (conftest.TEXT_DIMS)
V = "model.layers.0.self_attn.v_proj.weight"  # [32, 64]: 2 kv heads of 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_converted_llama(tmp_path_factory.mktemp("export"), 8)


def _copy(base, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(base / "art", art)
    return art


def _adapter(run, shapes, r=2, edit=None):
    """A PEFT LoRA adapter written by hand (safetensors + config): ``shapes`` {weight name: [N, K]};
    ``edit(tensors)`` changes its tensors before they are saved."""
    run.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (n, k) in shapes.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{stem}.lora_A.weight"] = torch.randn(r, k, generator=g) * 0.01
        tensors[f"{stem}.lora_B.weight"] = torch.randn(n, r, generator=g) * 0.01
    if edit:
        edit(tensors)
    save_file(tensors, run / "adapter_model.safetensors", metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
           "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (run / "adapter_config.json").write_text(json.dumps(cfg))
    return run


def _tree(folder):
    """Every file under ``folder`` with its bytes (what a refusal must leave as it was)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _complete(out):
    """The format of the complete export in ``out``: a valid marker listing exactly what is there,
    weights, config and tokenizer present."""
    doc = read_marker(out)
    assert doc is not None, sorted(p.name for p in out.iterdir())
    assert sorted(doc["files"] + [MARKER]) == E._files(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(doc["files"])
    return doc["format"]


def _siblings(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _cli(args):
    from click.testing import CliRunner

    from pact.pipelines.export import main

    r = CliRunner().invoke(main, [str(a) for a in args] + ["--quiet"])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in r.output, r.output
    return lines[0]


# ---- 1. --overwrite replaces only a folder pact-export wrote


def test_overwrite_never_replaces_a_model_folder(base, tmp_path):
    """cp -a src m; pact-export art --out m --overwrite: m is an HF model folder (config.json beside
    model.safetensors, as every export has), with the user's .git/ and notes: refused, untouched."""
    m = tmp_path / "m"
    shutil.copytree(base / "src", m)
    (m / ".git").mkdir()
    (m / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (m / "notes.md").write_text("what I changed")
    before = _tree(m)
    with pytest.raises(PactError, match=rf"--out {m} is not a checkpoint folder pact-export wrote \(no valid "
                                        rf"{MARKER}\).*choose another --out"):
        export(str(base / "art"), m, overwrite=True)
    assert _tree(m) == before and _siblings(m) == []
    assert "is not a checkpoint folder pact-export wrote" in _cli([base / "art", "--out", m, "--overwrite"])
    assert _tree(m) == before


def test_overwrite_replaces_an_export_and_nothing_added_to_it(base, tmp_path):
    out = tmp_path / "out"
    export(str(base / "art"), out)
    doc = read_marker(out)
    assert (_complete(out) == "compressed-tensors"
            and doc["artifact_fingerprint"] == open_artifact(base / "art").fingerprint())
    assert doc["artifact"] == str((base / "art").resolve()) and doc["created"]
    export(str(base / "art"), out, fmt="bf16", overwrite=True)  # an earlier export is replaced, as asked
    assert _complete(out) == "bf16" and _siblings(out) == []
    (out / "README.md").write_text("my model card")  # added by the user: replacing would delete it
    with pytest.raises(PactError, match=r"holds README.md, which pact-export did not write: refusing to replace"):
        export(str(base / "art"), out, overwrite=True)
    assert (out / "README.md").read_text() == "my model card"
    # a marker copied into a model folder does not make it an export: it lists none of the folder's files
    m = tmp_path / "m"
    shutil.copytree(base / "src", m)
    shutil.copyfile(out / MARKER, m / MARKER)
    doc = json.loads((m / MARKER).read_text())
    doc["files"] = ["config.json"]
    (m / MARKER).write_text(json.dumps(doc))
    with pytest.raises(PactError, match="which pact-export did not write"):
        export(str(base / "art"), m, overwrite=True)
    assert (m / "model.safetensors").is_file()


# ---- 2. OUT is never the artifact or the adapter run, nor inside or around one


@pytest.mark.parametrize("where,how", [("exp", "holds the artifact"), ("exp/art", "is the artifact"),
                                       ("exp/art/hf", "is inside the artifact"), ("exp/art/../art", "is the artifact"),
                                       ("exp/run", "is the --adapter run"),
                                       ("exp/run/export", "is inside the --adapter run")])
def test_out_never_touches_the_inputs(base, tmp_path, where, how):
    exp = tmp_path / "exp"
    exp.mkdir()
    art = _copy(base, exp)
    run = _adapter(exp / "run", {Q: [64, 64]})
    before = _tree(tmp_path)
    with pytest.raises(PactError, match=rf"--out .* {how} .*choose an --out outside it"):
        export(str(art), tmp_path / where, adapter=str(run), overwrite=True)
    assert _tree(tmp_path) == before  # nothing deleted, nothing written
    open_artifact(art).verify()


def test_out_through_a_link_is_refused(base, tmp_path):
    art = _copy(base, tmp_path)
    os.symlink(tmp_path, tmp_path / "link")
    with pytest.raises(PactError, match="link/art is the artifact"):  # resolved: the artifact itself
        export(str(art), tmp_path / "link" / "art", overwrite=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "out")
    with pytest.raises(PactError, match="out is a symbolic link"):
        export(str(base / "art"), tmp_path / "out", overwrite=True)
    open_artifact(art).verify()
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ---- 3. replaced by rename: OUT is the complete old export or the complete new one


_KILLED = r"""
import os, shutil, signal, sys
from pathlib import Path
from pact.convert import export as E

art, out, point = sys.argv[1:4]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if point == "write":  # half a weights file written into the temp folder
    def save(tensors, path):
        Path(path).write_bytes(b"\0" * 100)
        die()
    E._save = save
elif point == "swap":  # the old export renamed aside, the new one not yet in place
    rename = os.rename
    def renamed(src, dst):
        if Path(src).name.startswith("." + Path(out).name + ".tmp-"):
            die()
        rename(src, dst)
    os.rename = renamed
elif point == "cleanup":  # the new export in place, the old one half removed
    rmtree = shutil.rmtree
    def removing(p, *a, **kw):
        if ".old-" in Path(p).name:
            (Path(p) / "tokenizer.json").unlink()
            die()
        rmtree(p, *a, **kw)
    shutil.rmtree = removing
E.export(art, out, fmt="bf16", overwrite=True)
"""


@pytest.mark.parametrize("point,after", [("write", "compressed-tensors"), ("swap", None), ("cleanup", "bf16")])
def test_killed_overwrite_leaves_the_old_or_the_new_export(base, tmp_path, point, after):
    """kill -9 of `pact-export --format bf16 --overwrite` over a compressed-tensors export, at each
    step of the replacement: OUT is the complete old or the complete new export (between the two
    renames: absent, the old one aside); the next run puts the old one back and cleans up."""
    out = tmp_path / "out"
    export(str(base / "art"), out)
    r = subprocess.run([sys.executable, "-c", _KILLED, str(base / "art"), str(out), point], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    if after is None:
        assert not out.exists() and any(".old-" in s for s in _siblings(out))
    else:
        assert _complete(out) == after
    assert _siblings(out)  # what the killed run left is recognisable by name: .out.{tmp,old}-PID-xxxxxxxx
    with pytest.raises(PactError, match="exists: choose a new folder or pass --overwrite"):
        export(str(base / "art"), out)  # the next run: the old export renamed back, leftovers removed
    assert _complete(out) == (after or "compressed-tensors") and _siblings(out) == []
    export(str(base / "art"), out, fmt="bf16", overwrite=True)
    assert _complete(out) == "bf16" and _siblings(out) == []


def test_failed_swap_puts_the_old_export_back(base, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export(str(base / "art"), out)
    before = _tree(out)
    rename = os.rename

    def failing(src, dst):
        if str(src).startswith(str(tmp_path / ".out.tmp-")):
            raise OSError(errno.EIO, "Input/output error", str(dst))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(PactError, match=r"could not write \(Input/output error\).*the earlier export in .* is kept"):
        export(str(base / "art"), out, fmt="bf16", overwrite=True)
    monkeypatch.undo()
    assert _tree(out) == before and _siblings(out) == []


# ---- 4. nothing non-finite is written


def test_nan_block_scale_is_refused(base, tmp_path, monkeypatch):
    """A NaN E4M3 block scale (0x7f) in the artifact: refused naming the tensor, whether or not the
    artifact's verification (a cached stamp, an edit that kept sizes and times) caught it."""
    art = _copy(base, tmp_path)
    chunk = art / "tensors" / Q / "fwd_scales" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] = 0x7F
    chunk.write_bytes(bytes(data))
    rehash_artifact(art)
    for fmt in ("compressed-tensors", "bf16"):
        with pytest.raises(PactError, match=rf"{Q}.*fwd_scales.*NaN"):
            export(str(art), tmp_path / "out", fmt=fmt)
    from pact.formats.artifact import Artifact

    monkeypatch.setattr(Artifact, "verify_cached", lambda self, cache: False)  # export's own check
    with pytest.raises(PactError, match=rf"{Q}: its block scales \(fwd_scales\) hold NaN or negative values"):
        export(str(art), tmp_path / "out")
    assert _siblings(tmp_path / "out") == [] and not (tmp_path / "out").exists()


def test_nan_global_scale_and_dense_values_are_refused(base, tmp_path, monkeypatch):
    from pact.formats.artifact import Artifact

    art = _copy(base, tmp_path)
    edit_manifest(art, lambda meta: meta["tensors"][Q].update(global_scale=float("nan")))
    with pytest.raises(PactError, match=rf"{Q}.*global.scale nan"):
        export(str(art), tmp_path / "out")
    emb = tmp_path / "emb"
    shutil.copytree(base / "art", emb)
    chunk = emb / "tensors" / "model.embed_tokens.weight" / "data" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[0:2] = (0x7FC0).to_bytes(2, "little")  # bf16 NaN
    chunk.write_bytes(bytes(data))
    rehash_artifact(emb)
    with pytest.raises(PactError, match=r"embed_tokens\.weight.*(NaN|non-finite)"):
        export(str(emb), tmp_path / "out", fmt="bf16")
    monkeypatch.setattr(Artifact, "verify_cached", lambda self, cache: False)  # export's own check
    for fmt in ("bf16", "compressed-tensors"):
        with pytest.raises(PactError, match=r"model.embed_tokens.weight: non-finite values \(NaN or inf\)"):
            export(str(emb), tmp_path / "out", fmt=fmt)
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "out") == []


@pytest.mark.parametrize("fmt,merge", [("compressed-tensors", False), ("compressed-tensors", True), ("bf16", False)])
def test_nan_adapter_is_refused(base, tmp_path, monkeypatch, fmt, merge):
    """A diverged run's adapter (NaN in lora_B): refused naming the tensor, beside or merged (merged,
    it used to export all-zero codes and report a requantization error of 0)."""
    def nan(t):
        t[f"base_model.model.{V.removesuffix('.weight')}.lora_B.weight"][3, 1] = float("nan")

    run = _adapter(tmp_path / "run", {Q: [64, 64], V: [32, 64]}, edit=nan)
    with pytest.raises(PactError, match=r"v_proj.*(non-finite|NaN)"):  # the loader's check, or export's
        export(str(base / "art"), tmp_path / "out", fmt=fmt, adapter=str(run), merge=merge)
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "out") == []
    args = [base / "art", "--out", tmp_path / "out", "--format", fmt, "--adapter", run] + (["--merge"] if merge else [])
    assert "v_proj" in _cli(args)
    load = E.load_peft_adapter  # export's own check, whatever the loader lets through

    def loaded_nan(d):
        cfg, adapters = load(d)
        adapters[V][1][3, 1] = float("nan")
        return cfg, adapters

    ok = _adapter(tmp_path / "ok", {Q: [64, 64], V: [32, 64]})
    monkeypatch.setattr(E, "load_peft_adapter", loaded_nan)
    with pytest.raises(PactError,
                       match=r"v_proj\.lora_B\.weight holds non-finite values \(NaN or inf\): the run diverged"):
        export(str(base / "art"), tmp_path / "out", fmt=fmt, adapter=str(ok), merge=merge)
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "out") == []


def test_adapter_overflowing_when_merged_is_refused(base, tmp_path):
    """Finite A and B whose product overflows fp32: beside the weights it is what it is; merged it
    would be inf before re-quantization: refused naming the weight."""
    def huge(t):
        for k in t:
            t[k].fill_(1e30)

    run = _adapter(tmp_path / "run", {Q: [64, 64]}, edit=huge)
    for fmt, merge in (("compressed-tensors", True), ("bf16", False)):
        with pytest.raises(PactError, match=rf"{Q}: merged with the adapter it holds non-finite values"):
            export(str(base / "art"), tmp_path / "out", fmt=fmt, adapter=str(run), merge=merge)
    assert not (tmp_path / "out").exists()


# ---- 5. no code-loading keys; 6. no weights or pickles beyond the export's own


def test_auto_map_is_refused(base, tmp_path):
    art = _copy(base, tmp_path)
    edit_manifest(art, lambda meta: meta["hf_config"].update(auto_map={"AutoModelForCausalLM": "evil/repo--m.M"}))
    with pytest.raises(PactError, match=r"hf_config asks for custom code \(auto_map\): refusing to export it"):
        export(str(art), tmp_path / "out")
    edit_manifest(art, lambda meta: (meta["hf_config"].pop("auto_map"),
                                      meta["hf_config"].update(text_config={"auto_map": {"AutoConfig": "x.C"}})))
    with pytest.raises(PactError, match=r"custom code \(auto_map\)"):
        export(str(art), tmp_path / "out", fmt="bf16")
    gen = tmp_path / "gen"
    shutil.copytree(base / "art", gen)
    f = gen / "hf" / "generation_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "custom_pipelines": {"text-generation": {"impl": "p.P"}}}))
    rehash_artifact(gen)
    with pytest.raises(PactError, match=r"generation_config.json: asks for custom code \(custom_pipelines\)"):
        export(str(gen), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export(str(base / "art"), tmp_path / "ok")
    assert _complete(tmp_path / "ok") == "compressed-tensors"
    for rel in read_marker(tmp_path / "ok")["files"]:
        if rel.endswith(".json"):
            doc = json.loads((tmp_path / "ok" / rel).read_text())
            assert not set(E.CODE_KEYS) & set(doc), rel


def test_only_side_files_ship(base, tmp_path):
    """Weights and pickles an artifact's hf/ lists (a second model, a model.safetensors that would
    replace the export's own) never ship: config, tokenizer, chat template and processor files do."""
    art = _copy(base, tmp_path)
    other = {"lm_head.weight": torch.full((4, 4), 7.0)}
    planted = ["model.safetensors", "second.safetensors", "pytorch_model.bin", "x.pt", "a.pkl", "b.pth",
               "sub/tokenizer.json"]
    for rel in planted:
        (art / "hf" / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(other, art / "hf" / rel)
    edit_manifest(art, lambda meta: meta["files"].update({rel: "0" * 64 for rel in planted}))
    rehash_artifact(art)
    for fmt in ("bf16", "compressed-tensors"):
        out = tmp_path / fmt
        export(str(art), out, fmt=fmt)
        assert _complete(out) == fmt
        shipped = set(read_marker(out)["files"])
        assert not {"second.safetensors", "pytorch_model.bin", "x.pt", "a.pkl", "b.pth", "sub/tokenizer.json"} & shipped
        assert not any(s.endswith((".bin", ".pt", ".pkl", ".pth")) for s in shipped)
        sd = load_file(out / "model.safetensors")
        assert sd["lm_head.weight"].shape != (4, 4) and len(sd) > 1  # the export's own weights


# ---- 7. an adapter of another model; 8. a full disk


def test_adapter_of_another_model_is_one_line(base, tmp_path):
    run = _adapter(tmp_path / "run", {Q: [32, 32]})  # trained on a model with hidden size 32
    with pytest.raises(PactError, match=rf"{Q} is adapted as \[32, 32\] \(lora_A \[2, 32\], lora_B \[32, 2\]\) "
                                        rf"but .* holds it as \[64, 64\] \(an adapter trained on another model"):
        export(str(base / "art"), tmp_path / "out", adapter=str(run))
    line = _cli([base / "art", "--out", tmp_path / "out", "--adapter", run, "--merge"])
    assert "is adapted as [32, 32]" in line and "[64, 64]" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_full_disk_is_one_line_and_keeps_the_earlier_export(base, tmp_path, monkeypatch, error):
    """ENOSPC while the weights are written (as an OSError, or as safetensors reports it: its own
    error type, "os error 28"): one line; no OUT, no temp folder; an earlier export stays as it was."""
    from safetensors import SafetensorError

    def full(tensors, path, *a, **kw):
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    out = tmp_path / "out"
    monkeypatch.setattr(E, "save_safetensors", full)
    with pytest.raises(PactError, match=r"could not write \(the disk is full\).*nothing was written to"):
        export(str(base / "art"), out, fmt="bf16")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    export(str(base / "art"), out)
    before = _tree(out)
    monkeypatch.setattr(E, "save_safetensors", full)
    with pytest.raises(PactError, match=r"could not write \(the disk is full\).*the earlier export in .* is kept"):
        export(str(base / "art"), out, fmt="bf16", overwrite=True)
    assert _tree(out) == before and _siblings(out) == []
    line = _cli([base / "art", "--out", out, "--format", "bf16", "--overwrite"])
    assert "the disk is full" in line
    assert _tree(out) == before


def test_unwritable_out_is_said_before_work_and_by_its_name(base, tmp_path, monkeypatch):
    """A folder that cannot be written (the tests run as root: the probe's write fails by a patch) is one line
    naming --out, said before the export starts, never a temp path of ours nor advice to free space; a write
    that fails later for another reason than a full disk advises another folder, not free space."""
    from pathlib import Path

    from pact.formats.errors import write_error

    real = Path.write_bytes

    def denied(self, data):
        if ".probe-" in self.name:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", denied)
    out = tmp_path / "ro" / "exp"
    with pytest.raises(PactError, match=rf"^--out {out}: cannot write in {out.parent} \(Permission denied\): "
                                        "choose a writable folder$"):
        export(str(base / "art"), out)
    monkeypatch.undo()
    assert not out.exists()
    line = str(write_error(PermissionError(errno.EACCES, "Permission denied"), out, "nothing was written"))
    assert "choose a writable output folder" in line and "free space" not in line
    line = str(write_error(OSError(errno.ENOSPC, "No space left on device"), out, "nothing was written"))
    assert "the disk is full" in line and "free space" in line
