"""An artifact from someone else is the normal case: opening one never follows a path outside its
folder, never runs code it ships, and the converter ships only the files a model needs."""

import errno
import functools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import edit_manifest, make_model, rehash_artifact
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


@pytest.mark.parametrize("where", ["file-dotdot", "file-absolute", "array-dotdot", "array-absolute", "array-nul",
                                   "file-backslash"])
def test_paths_outside_are_refused(base, tmp_path, where):
    art = _copy(base, tmp_path)
    bad = {"dotdot": "../../x/PWNED", "absolute": "/etc/hostname", "nul": "tensors/model.norm\0x.weight/data",
           "backslash": "..\\..\\x"}[where.split("-")[1]]

    def edit(meta):
        if where.startswith("file"):
            meta["files"][bad] = "0" * 64
        else:
            first = next(iter(meta["tensors"].values()))
            next(iter(first["arrays"].values()))["path"] = bad
    edit_manifest(art, edit)
    with pytest.raises(ArtifactError, match="points outside the artifact"):
        open_artifact(art)


def test_folder_that_cannot_be_listed_is_refused(base, tmp_path, monkeypatch):
    """A folder inside the artifact that cannot be listed (no read permission; the tests run as root, so the
    listing fails by a patch) cannot be checked for links or code: one error naming it, not a skip."""
    import pact.formats.artifact as artifact_module

    art = _copy(base, tmp_path)
    listing = os.scandir

    def scandir(folder):
        if os.path.basename(folder) == "hf":
            raise PermissionError(errno.EACCES, "Permission denied")
        return listing(folder)

    monkeypatch.setattr(artifact_module.os, "scandir", scandir)
    with pytest.raises(ArtifactError, match=r"hf: cannot be listed \(Permission denied\): make the artifact readable"):
        open_artifact(art)


@pytest.mark.parametrize("where", ["hf/evil.json", "tensors/zarr.json"])
def test_named_pipe_is_refused_not_waited_on(base, tmp_path, where):
    """A FIFO (tar carries them) would block whoever opens it forever: refused by its type, never opened."""
    art = _copy(base, tmp_path)
    (art / where).unlink(missing_ok=True)
    os.mkfifo(art / where)
    with pytest.raises(ArtifactError, match="not a regular file"):
        open_artifact(art)


def test_named_pipe_in_a_model_folder_is_refused(base, tmp_path):
    from pact.formats import PactError

    src = tmp_path / "model"
    shutil.copytree(base / "src", src, symlinks=True)
    (src / "hostname.txt").unlink()
    os.mkfifo(src / "extra.safetensors")
    with pytest.raises(PactError, match="extra.safetensors: not a regular file"):
        convert(str(src), tmp_path / "art", progress=False)


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


def test_not_an_artifact_says_what_it_is(base, tmp_path):
    """pact-train given the wrong folder: one line naming what it is and the fix."""
    from click.testing import CliRunner

    from pact.pipelines.train import main as train_cli

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": " b"}) + "\n")
    cache = tmp_path / "cache"  # a work folder with an artifact one level down (pact demo's cache)
    cache.mkdir()
    shutil.copytree(base / "art", cache / "model-nvfp4", symlinks=True)
    cases = {tmp_path / "missing": "missing: no such artifact folder: create one with `pact-convert MODEL",
             cache: f"holds one: give {cache / 'model-nvfp4'}",
             base / "src": "looks like a Hugging Face model folder: convert it first, `pact-convert"}
    adapter = tmp_path / "someone-run"  # a run (or PEFT adapter) folder given as the artifact
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cases[adapter] = f"it is a LoRA adapter or pact-train run: give the artifact it was trained on, and this " \
                     f"folder as --adapter {adapter}"
    for folder, want in cases.items():
        r = CliRunner().invoke(train_cli, [str(folder), "--data", str(data), "--out", str(tmp_path / "run"),
                                           "--steps", "1"])
        assert r.exit_code != 0 and want in r.output and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "run").exists()
    from pact.formats import PactError
    from pact.formats.peft import load_peft_adapter

    with pytest.raises(PactError, match="--adapter .*nope: no such folder"):
        load_peft_adapter(tmp_path / "nope")


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


def test_overwrite_never_deletes_files_kept_in_an_artifact(base, tmp_path):
    """--overwrite replaces what the manifest lists and nothing else: notes or a run a user keeps in the
    artifact folder make pact-convert, pact-push and pact-train refuse, and stay."""
    from pact.formats import PactError
    from pact.formats.push import push_artifact
    from pact.runtime.trainer import check_inputs

    art = _copy(base, tmp_path)
    (art / "NOTES.txt").write_text("what this artifact is for")
    (art / "myrun").mkdir()
    (art / "myrun" / "adapter_model.safetensors").write_bytes(b"weeks of training")
    with pytest.raises(PactError, match=r"holds files its manifest does not list \(NOTES.txt, "
                                        r"myrun/adapter_model.safetensors\): --overwrite would delete them"):
        convert(str(base / "src"), art, overwrite=True, progress=False)
    with pytest.raises(PactError, match="NOTES.txt"):
        push_artifact(base / "art", str(art), overwrite=True)
    assert (art / "NOTES.txt").is_file() and (art / "myrun" / "adapter_model.safetensors").is_file()
    with pytest.raises(PactError, match="is inside the artifact"):  # where such a run would come from
        check_inputs(_cfg(base, tmp_path, artifact=str(art), out=str(art / "run2")))
    shutil.rmtree(art / "myrun")
    (art / "NOTES.txt").unlink()
    (art / "hf" / ".DS_Store").write_bytes(b"\0")  # what a file browser leaves is nobody's data
    convert(str(base / "src"), art, overwrite=True, progress=False)  # only the artifact: replaced, as asked
    open_artifact(art).verify()


def test_adapter_in_a_hub_cache_snapshot_loads(base, tmp_path):
    """A PEFT adapter in the Hugging Face cache (snapshots/<rev>/ files linking to the repo's blobs/) loads;
    a link out of that repo is refused."""
    from pact.formats import PactError
    from pact.formats.peft import load_peft_adapter
    from pact.runtime.trainer import train

    train(_cfg(base, tmp_path), progress=False)
    repo = tmp_path / "hub" / "models--someone--adapter"
    snap, blobs = repo / "snapshots" / "rev1", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(("adapter_config.json", "adapter_model.safetensors")):
        shutil.copyfile(tmp_path / "run" / name, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / name)
    cfg, weights = load_peft_adapter(snap)
    assert cfg.r == 4 and weights
    (snap / "adapter_config.json").unlink()
    os.symlink(tmp_path / "run" / "adapter_config.json", snap / "adapter_config.json")  # outside the repo
    with pytest.raises(PactError, match="a symbolic link to .* outside the adapter's folder"):
        load_peft_adapter(snap)


def test_killed_between_renames_the_artifact_is_restored(base, tmp_path):
    """A run killed between replace_by_rename's two renames left no OUT and the old artifact aside: the
    next write to OUT renames it back (never sweeps it away as a leftover)."""
    out = tmp_path / "art"
    shutil.copytree(base / "art", tmp_path / ".art.old-999999999-deadbeef")
    with pytest.raises(ArtifactError, match="already exists: pass --overwrite"):
        convert(str(base / "src"), out, progress=False)
    open_artifact(out).verify()
    assert not (tmp_path / ".art.old-999999999-deadbeef").exists()
    from pact.formats import PactError
    from pact.formats.push import push_artifact

    pushed = tmp_path / "pushed"  # the same for pact-push's local destination
    shutil.copytree(base / "art", tmp_path / ".pushed.old-999999999-deadbeef")
    with pytest.raises(PactError, match="already holds an artifact"):
        push_artifact(base / "art", str(pushed))
    open_artifact(pushed).verify()


# ---- a run never loses what it made, and a damaged input never trains


def _data(tmp_path, n=32):
    from conftest import make_sentiment_jsonl

    return make_sentiment_jsonl(tmp_path / "train.jsonl", n, seed=0)


def _cfg(base, tmp_path, **kw):
    from pact.runtime.trainer import TrainConfig

    args = dict(artifact=str(base / "art"), data=str(_data(tmp_path)), out=str(tmp_path / "run"), max_len=32,
                batch_size=8, steps=2, lr=1e-3, lora_r=4, lora_alpha=8, kernels="torch")
    return TrainConfig(**{**args, **kw})


def test_resume_never_overwrites_a_finished_run(base, tmp_path):
    from pact.formats import PactError
    from pact.runtime.trainer import train

    train(_cfg(base, tmp_path), progress=False)
    adapter = (tmp_path / "run" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(PactError, match="is a finished run .* no checkpoint"):
        train(_cfg(base, tmp_path), resume=True, progress=False)
    assert (tmp_path / "run" / "adapter_model.safetensors").read_bytes() == adapter
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("what", ["data", "artifact"])
def test_resume_refuses_replaced_inputs(base, tmp_path, what):
    from pact.formats import PactError
    from pact.runtime.trainer import train

    art = _copy(base, tmp_path)
    cfg = _cfg(base, tmp_path, artifact=str(art), steps=4, save_every=2)
    train(cfg, progress=False, stop_after=2)
    if what == "data":
        from conftest import make_sentiment_jsonl

        make_sentiment_jsonl(tmp_path / "train.jsonl", 32, seed=5)
    else:
        name = open_artifact(art).names("nvfp4")[0]
        chunk = art / "tensors" / name / "fwd_packed" / "c" / "0" / "0"
        b = bytearray(chunk.read_bytes())
        b[0] ^= 0x11
        chunk.write_bytes(bytes(b))
        rehash_artifact(art)  # a re-converted artifact: valid, but not the one the run started on
    with pytest.raises(PactError, match=f"the {what} changed since .* was saved"):
        train(cfg, resume=True, progress=False)


def test_one_writer_per_run_folder(base, tmp_path):
    import socket

    from pact.formats import PactError
    from pact.runtime.trainer import train

    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text(f"{socket.gethostname()} {os.getppid()}\n")  # a live process holds it
    with pytest.raises(PactError, match=r"is in use by another pact-train .*pid"):
        train(_cfg(base, tmp_path), progress=False)
    assert not (run / "adapter_model.safetensors").exists()
    (run / ".lock").write_text(f"{socket.gethostname()} 999999999\n")  # its process is gone: taken over
    train(_cfg(base, tmp_path), progress=False)
    assert (run / "adapter_model.safetensors").is_file() and not (run / ".lock").exists()


def test_damaged_artifact_never_trains(base, tmp_path):
    from pact.formats import PactError
    from pact.runtime.trainer import train

    art = _copy(base, tmp_path)
    name = open_artifact(art).names("nvfp4")[0]
    chunk = art / "tensors" / name / "fwd_packed" / "c" / "0" / "0"
    b = bytearray(chunk.read_bytes())
    b[5] ^= 0x01  # one flipped code bit: same size, different weights
    chunk.write_bytes(bytes(b))
    with pytest.raises(PactError, match="checksum mismatch"):
        train(_cfg(base, tmp_path, artifact=str(art)), progress=False)
    assert not (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_non_finite_loss_stops_at_its_step(base, tmp_path):
    from pact.formats import PactError
    from pact.runtime.trainer import train

    art = _copy(base, tmp_path)
    # NaN block scales are refused by verification (test_red_team_artifact.py); finite global scales
    # near fp32's largest make the weights overflow to Inf in the forward instead
    edit_manifest(art, lambda m: [e.update(global_scale=3e38) for e in m["tensors"].values() if e["kind"] == "nvfp4"])
    run = tmp_path / "run"
    with pytest.raises(PactError, match=r"step 1: loss nan.*not finite, training stopped and no adapter written"):
        train(_cfg(base, tmp_path, artifact=str(art)), progress=False)
    assert not (run / "adapter_model.safetensors").exists()


def test_checkpoints_survive_a_full_disk_and_an_emptied_one(base, tmp_path, monkeypatch):
    import errno

    from pact.formats import PactError
    from pact.runtime import checkpoints, trainer

    cfg = _cfg(base, tmp_path, steps=6, save_every=2)
    trainer.train(cfg, progress=False, stop_after=4)
    ck = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-0000002", "step-0000004"]
    real = checkpoints.save_safetensors

    def full(tensors, path, *a, **kw):
        if str(path).endswith("optimizer.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(checkpoints, "save_safetensors", full)
    with pytest.raises(PactError, match=r"checkpoints/step-0000006: could not write \(the disk is full\)"
                                        r".*earlier checkpoints are kept"):
        trainer.train(cfg, resume=True, progress=False)
    monkeypatch.undo()
    assert sorted(p.name for p in ck.iterdir()) == ["step-0000002", "step-0000004"]  # no half checkpoint
    (ck / "step-0000004" / "optimizer.safetensors").write_bytes(b"")  # emptied: the older one is used
    r = trainer.train(cfg, resume=True, progress=False)
    assert r["step"] == 6
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_killed_convert_leftovers_are_removed(base, tmp_path):
    out = tmp_path / "art"
    stale = tmp_path / ".art.tmp-999999999-deadbeef"
    (stale / "tensors").mkdir(parents=True)
    (stale / "tensors" / "big").write_bytes(b"\0" * 1000)
    live = tmp_path / f".art.tmp-{os.getpid()}-0badf00d"  # a live process's temp stays
    live.mkdir()
    convert(str(base / "src"), out, progress=False)
    assert not stale.exists() and live.is_dir()


def test_chat_template_is_bounded(base, tmp_path, monkeypatch):
    from pact.formats import PactError
    from pact.runtime import data
    from pact.runtime.trainer import train

    art = _copy(base, tmp_path)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    (art / "hf" / "chat_template.jinja").write_text(loop)
    rehash_artifact(art)
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "yo"}]}) + "\n")
    monkeypatch.setattr(data, "TEMPLATE_SECONDS", 1)
    with pytest.raises(PactError, match=r"chat.jsonl:1: rendering the chat template took over 1 s"):
        train(_cfg(base, tmp_path, artifact=str(art), data=str(f)), progress=False)


# ---- one clear error per bad input, before anything loads


@pytest.mark.parametrize("flag,value,match", [
    ("lr", -1.0, "--lr must be a finite number > 0"), ("lr", float("nan"), "--lr must be"), ("lr", 0.0, "--lr must be"),
    ("weight_decay", -5.0, "--weight-decay must be"), ("lora_alpha", 0.0, "--lora-alpha must be > 0"),
    ("max_grad_norm", 0.0, "--max-grad-norm must be > 0"), ("max_grad_norm", -1.0, "--max-grad-norm must be"),
    ("save_every", -1, "--save-every must be >= 0"), ("max_len", 1, "--max-len must be >= 2"),
    ("lora_r", 0, "--lora-r must be"), ("lora_dropout", 1.0, "--lora-dropout must be"),
])
def test_bad_train_flags(base, tmp_path, flag, value, match):
    from pact.formats import PactError

    with pytest.raises(PactError, match=match):
        _cfg(base, tmp_path, **{flag: value})


def test_bad_device_is_one_error_before_anything_loads(base, tmp_path):
    from pact.formats import PactError
    from pact.runtime.trainer import check_inputs

    with pytest.raises(PactError, match="--device 'gpu': not a device name"):
        check_inputs(_cfg(base, tmp_path, device="gpu"))


def test_bad_flags_on_the_cli_are_one_line(base, tmp_path):
    from click.testing import CliRunner

    from pact.pipelines.eval import main as eval_cli
    from pact.pipelines.train import main as train_cli

    data = _data(tmp_path)
    for cli, args, match in (
        (train_cli, ["--out", str(tmp_path / "r"), "--lr", "-1"], "--lr must be"),
        (train_cli, ["--out", str(tmp_path / "r"), "--max-grad-norm", "0"], "--max-grad-norm must be"),
        (eval_cli, ["--batch-size", "0"], "--batch-size must be >= 1"),
        (eval_cli, ["--max-len", "0"], "--max-len must be >= 2"),
    ):
        r = CliRunner().invoke(cli, [str(base / "art"), "--data", str(data), *args])
        assert r.exit_code == 1 and match in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("damage,match", [
    (lambda m: m.pop("tensors"), "manifest has no 'tensors'"),
    (lambda m: next(iter(m["tensors"].values())).pop("arrays"), "has no 'arrays'"),
    (lambda m: next(iter(next(iter(m["tensors"].values()))["arrays"].values())).update(dtype="int64"),
     "has dtype 'int64'"),
    (lambda m: next(iter(next(iter(m["tensors"].values()))["arrays"].values())).pop("sha256"), "has no 'sha256'"),
])
def test_damaged_manifest_is_one_error(base, tmp_path, damage, match):
    art = _copy(base, tmp_path)
    edit_manifest(art, damage)
    with pytest.raises(ArtifactError, match=match):
        open_artifact(art)


def test_non_utf8_data_names_the_line(base, tmp_path):
    from pact.formats import PactError
    from pact.runtime.trainer import train

    f = tmp_path / "latin1.jsonl"
    f.write_bytes(json.dumps({"prompt": "a", "completion": " b"}).encode() + b"\n"
                  + '{"prompt": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(PactError, match=r"latin1.jsonl:2: not UTF-8"):
        train(_cfg(base, tmp_path, data=str(f)), progress=False)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.pop("r"), "'r' is missing or invalid"),
    (lambda c: c.update(lora_alpha=0), "'lora_alpha' is missing or invalid"),
    (lambda c: c.update(lora_alpha=float("inf")), "'lora_alpha' is missing or invalid"),
    (lambda c: c.update(use_dora=True), "pact applies plain LoRA only"),
    (lambda c: c.update(lora_dropout="x"), "'lora_dropout' is invalid"),
    (lambda c: c.update(notes=functools.reduce(lambda a, _: [a], range(100), [])), "nested deeper"),
    ("link", "adapter_config.json: a symbolic link"),
    (lambda c: c.update(lora_alpha=1e30), r"--adapter .*run: the model computes non-finite values .*lora_alpha / r"),
    ("empty", "adapter_model.safetensors: holds no LoRA A/B weights"),
    ("rank", r"rank r=200 in its adapter_config.json, more than any projection of .* has \(64\)"),
    # integer weights (a quantized or damaged adapter) were cast to floats silently
    ("int8", r"adapter_model.safetensors: .*: LoRA weights of dtype torch.int8 / torch.int8, not a float type"),
    # weights the config does not name: dropped by scoring and merged by pact-export before, two models
    (lambda c: c.update(target_modules=["q_proj"]), r"adapter_model.safetensors: holds LoRA weights for "
     r"'.*' and \d+ more, which adapter_config.json's target_modules \(q_proj\) does not name"),
    (lambda c: c.update(layers_to_transform=[0]), r"adapter holds LoRA weights for \d+ module\(s\) this model has "
     r"no adapter on, e.g. model.layers.1."),
])
def test_bad_adapter_config(base, tmp_path, edit, match):
    from pact.formats import PactError
    from pact.runtime.evaluate import evaluate_artifact
    from pact.runtime.trainer import train

    train(_cfg(base, tmp_path), progress=False)
    f = tmp_path / "run" / "adapter_config.json"
    c = json.loads(f.read_text())
    if edit == "link":  # the file itself elsewhere: a link out of the adapter's folder is not followed
        f.rename(tmp_path / "elsewhere.json")
        os.symlink(tmp_path / "elsewhere.json", f)
    elif edit == "empty":  # (its r alone would size the LoRA modules)
        save_file({}, tmp_path / "run" / "adapter_model.safetensors")
    elif edit == "int8":
        w = tmp_path / "run" / "adapter_model.safetensors"
        save_file({k: t.to(torch.int8) for k, t in load_file(w).items()}, w)
    elif edit == "rank":  # consistent tensors of a rank no projection of this model has room for
        w = tmp_path / "run" / "adapter_model.safetensors"
        save_file({k: torch.zeros(200, t.shape[1]) if ".lora_A." in k else torch.zeros(t.shape[0], 200)
                   for k, t in load_file(w).items()}, w)
        f.write_text(json.dumps({**c, "r": 200}))
    else:
        edit(c)
        f.write_text(json.dumps(c))
    with pytest.raises(PactError, match=match):
        evaluate_artifact(str(base / "art"), str(_data(tmp_path)), adapter=str(tmp_path / "run"), max_len=32)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.pop("hidden_size"), "'hidden_size' is missing"),
    (lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1), "num_hidden_layers is 3 but the weights hold"),
    (lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] - 1), "num_hidden_layers is 1 but the weights hold"),
    (lambda c: c.update(vocab_size=c["vocab_size"] // 4), "but the config's vocab_size, hidden_size give"),
])
def test_config_that_does_not_fit_the_weights(base, tmp_path, edit, match):
    from pact.formats import PactError
    from pact.runtime.trainer import train

    src = tmp_path / "src"
    shutil.copytree(base / "src", src, symlinks=True)
    c = json.loads((src / "config.json").read_text())
    edit(c)
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(PactError, match=match):
        convert(str(src), tmp_path / "art", progress=False)
    art = _copy(base, tmp_path / "b")  # the same config inside an artifact (consistent checksums)
    (art / "hf" / "config.json").write_text(json.dumps(c))
    rehash_artifact(art)
    with pytest.raises(PactError, match=match):
        train(_cfg(base, tmp_path, artifact=str(art)), progress=False)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(rope_parameters={"rope_type": "nonsense", "rope_theta": 10000.0}), "RoPE settings"),
    (lambda c: c.update(dtype="nonsense"), "config.json"),
    ("tokenizer", "the tokenizer cannot be loaded"),
    # values of the wrong JSON type (transformers' strict config dataclasses), a tokenizer field of the wrong
    # type (the tokenizers library's bare Exception): one error each, where each was a traceback
    (lambda c: c.update(hidden_act=["silu"]), "config.json"),
    (lambda c: c.update(use_cache="yes"), "config.json"),
    ("added_token_id", "the tokenizer cannot be loaded"),
    ("max_length", r"tokenizer_config.json: 'model_max_length' is 'x', not a number"),
])
def test_config_transformers_cannot_use_is_one_error(base, tmp_path, edit, match):
    """Values transformers fails on with a KeyError or AttributeError deep inside (an unknown RoPE type, a
    dtype torch lacks, a tokenizer.json that is JSON but no tokenizer): one error naming the artifact."""
    from pact.formats import PactError
    from pact.runtime.trainer import train

    art = _copy(base, tmp_path)
    if edit == "tokenizer":
        (art / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    elif edit == "added_token_id":
        tj = json.loads((art / "hf" / "tokenizer.json").read_text())
        tj["added_tokens"][0]["id"] = str(tj["added_tokens"][0]["id"])
        (art / "hf" / "tokenizer.json").write_text(json.dumps(tj))
    elif edit == "max_length":
        tc = json.loads((art / "hf" / "tokenizer_config.json").read_text())
        (art / "hf" / "tokenizer_config.json").write_text(json.dumps({**tc, "model_max_length": "x"}))
    else:
        c = json.loads((art / "hf" / "config.json").read_text())
        edit(c)
        (art / "hf" / "config.json").write_text(json.dumps(c))
    rehash_artifact(art)
    with pytest.raises(PactError, match=match):
        train(_cfg(base, tmp_path, artifact=str(art)), progress=False)


def test_truncated_gguf_says_truncated(tmp_path):
    from conftest import make_gguf
    from pact.formats import PactError

    f = tmp_path / "m.gguf"
    make_gguf(f)
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])
    with pytest.raises(PactError, match=r"m.gguf: truncated \(\d+ bytes"):
        convert(str(f), tmp_path / "art", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_unwritable_output_fails_before_work(base, tmp_path):
    from pact.formats import PactError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(PactError, match=r"cannot write in .*file"):
        convert(str(base / "src"), blocker / "art", progress=False)


def test_full_disk_during_convert_is_one_error(base, tmp_path, monkeypatch):
    import errno

    from pact.formats import PactError
    from pact.formats.artifact import ArtifactWriter

    real = ArtifactWriter._array
    calls = []

    def full(self, *a, **kw):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.tmp / "tensors"))
        return real(self, *a, **kw)

    monkeypatch.setattr(ArtifactWriter, "_array", full)
    with pytest.raises(PactError, match=r"could not write \(the disk is full\).*nothing was written to"):
        convert(str(base / "src"), tmp_path / "art", progress=False)
    assert list(tmp_path.iterdir()) == []  # no temp folder, no half artifact


def test_full_disk_in_a_background_chunk_write_is_one_error(base, tmp_path, monkeypatch):
    """Chunk files are written by the writer's threads: a failure there surfaces as the same one
    error, and neither the temp folder nor a half artifact is left."""
    from pact.formats import PactError
    from pact.formats import artifact as A

    real, calls = A._write_chunk, []

    def full(chunk, data):
        calls.append(chunk)
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(chunk))
        return real(chunk, data)

    monkeypatch.setattr(A, "_write_chunk", full)
    with pytest.raises(PactError, match=r"could not write \(the disk is full\).*nothing was written to"):
        convert(str(base / "src"), tmp_path / "art", progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # the same conversion without the fault: every chunk's sha256 in the manifest matches its file
    art = open_artifact(convert(str(base / "src"), tmp_path / "art", progress=False))
    art.verify()


def test_calibrate_checks_its_output_before_work(base, tmp_path):
    from pact.calibrate import calibrate
    from pact.formats import PactError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    prompts = tmp_path / "p.txt"
    prompts.write_text("some text\n\nmore text\n")
    with pytest.raises(PactError, match=r"cannot write in .*file"):
        calibrate(str(base / "art"), prompts, blocker / "cal", progress=False)


def test_hub_cache_snapshot_links_are_followed(base, tmp_path):
    """A Hugging Face cache snapshot holds links into its repo's blobs/: those are the model's own
    files and are copied; a link elsewhere is refused."""
    from pact.convert.sources import open_source
    from pact.formats import PactError

    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (base / "src").iterdir():
        if f.is_file() and not f.is_symlink():
            blob = repo / "blobs" / f.name
            shutil.copyfile(f, blob)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    names = {p.name for p in open_source(str(snap)).side_files()}
    assert {"config.json", "tokenizer.json"} <= names
    os.symlink("/etc/hostname", snap / "special_tokens_map.json")  # a link elsewhere is refused, naming it
    with pytest.raises(PactError, match="special_tokens_map.json: a link to /etc/hostname, outside the model folder"):
        open_source(str(snap)).side_files()


@pytest.mark.parametrize("factor", [0.0, 1e-300])
def test_rope_settings_giving_non_finite_frequencies_are_refused(base, tmp_path, factor):
    """A RoPE scaling factor transformers only warns about (0, or one whose inverse overflows) gives inf
    frequencies: refused as one line before a model computes NaN."""
    from pact.formats import PactError
    from pact.runtime.session import open_session

    art = _copy(base, tmp_path)
    c = json.loads((art / "hf" / "config.json").read_text())
    c["rope_parameters"] = {"rope_type": "linear", "factor": factor, "rope_theta": 10000.0}
    (art / "hf" / "config.json").write_text(json.dumps(c))
    rehash_artifact(art)
    with pytest.raises(PactError, match="config.json: its RoPE settings .* give non-finite rotary frequencies"):
        open_session(str(art), device="cpu", tool="test").model(None, backward=False)
