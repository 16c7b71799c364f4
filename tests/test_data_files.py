"""--data as a .parquet / .csv / .json table (datasets' loaders) besides JSONL; a hub dataset id
gets one line saying how to make it local."""

import json

import pytest

from conftest import make_converted_llama
from pact.formats import PactError
from pact.runtime.data import read_records
from pact.runtime.trainer import TrainConfig, train


def _plain(recs):
    return [{k: v for k, v in r.items() if k != "_where"} for r in recs]


def test_tables_read_as_jsonl(tmp_path):
    import datasets

    rows = [{"prompt": f"review {i}\nverdict:", "completion": " fresh" if i % 2 else " rotten"} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "d.json").write_text(json.dumps(rows))  # a JSON array
    want = _plain(read_records(tmp_path / "d.jsonl"))
    for suffix in ("parquet", "csv", "json"):
        got = read_records(tmp_path / f"d.{suffix}")
        assert _plain(got) == want, suffix
        assert got[2]["_where"].endswith(f"d.{suffix} row 2")
        head = read_records(tmp_path / f"d.{suffix}", limit=2)  # the head only (calibration's decision)
        assert _plain(head) == want[:2] and head[1]["_where"].endswith(f"d.{suffix} row 1"), suffix
        assert _plain(read_records(tmp_path / f"d.{suffix}", limit=50)) == want, suffix
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(PactError, match=r"--data .*bad.parquet: not a readable parquet table .*give JSONL"):
        read_records(tmp_path / "bad.parquet")
    with pytest.raises(PactError, match=r"tatsu-lab/alpaca: no such file or folder, and as a hub dataset id: .*"
                                        r"could not get it .*offline, save it once .*save_to_disk\(DIR\) and pass DIR"):
        read_records("tatsu-lab/alpaca")  # the tests run with HF_HUB_OFFLINE=1


def test_hub_dataset_id_online(monkeypatch):
    """With a network a hub id is read through datasets.load_dataset (here a stand-in for the hub):
    its train split, or the one --data-split names."""
    import datasets

    from pact.runtime import data
    from pact.runtime.data import read_records

    calls = []

    def fake(repo, split=None):
        calls.append((repo, split))
        dd = datasets.DatasetDict({s: datasets.Dataset.from_list([{"instruction": f"{s} q", "input": "",
                                                                   "output": " a"}]) for s in ("train", "test")})
        return dd[split] if split else dd

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(data, "_hub_unreachable", lambda: None)  # (the tests run offline)
    assert read_records("org/data")[0]["instruction"] == "train q"
    assert read_records("org/data", "--eval-data")[0]["instruction"] == "test q"
    assert read_records("org/data", "--data", "test")[0]["_where"] == "org/data row 0"
    assert calls == [("org/data", None), ("org/data", None), ("org/data", "test")]


def test_train_on_parquet(tmp_path):
    import datasets

    d = make_converted_llama(tmp_path, 16)
    rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(d / "train.parquet"))
    train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.parquet"), out=str(d / "run"), steps=2,
                      batch_size=4, max_len=64), progress=False)
    assert (d / "run" / "adapter_model.safetensors").is_file()
    assert len((d / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(PactError, match="a hub dataset id"):
        train(TrainConfig(artifact=str(d / "art"), data="org/some-dataset", out=str(d / "run2"), steps=1),
              progress=False)


# ---- splits of a datasets folder (--data-split, --eval-split, pact-eval --data-split)


def test_dataset_dict_splits(tmp_path):
    import datasets

    from pact.runtime.data import read_records

    def rows(tag, n):
        return datasets.Dataset.from_list([{"prompt": f"{tag} {i}", "completion": " x"} for i in range(n)])

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": rows("tr", 3), "validation": rows("va", 2), "test": rows("te", 1)}
                         ).save_to_disk(str(folder))
    assert [r["prompt"] for r in read_records(folder)] == ["tr 0", "tr 1", "tr 2"]  # --data: train
    assert [r["prompt"] for r in read_records(folder, limit=2)] == ["tr 0", "tr 1"]
    assert [r["prompt"] for r in read_records(folder, "--eval-data")] == ["te 0"]  # held out: test first
    assert [r["prompt"] for r in read_records(folder, "--data", "validation")] == ["va 0", "va 1"]
    with pytest.raises(PactError, match=r"--data .*dd: a DatasetDict without a 'dev' split \(it has 'train', "
                                        r"'validation', 'test'\): pass --data-split NAME"):
        read_records(folder, "--data", "dev")
    only = tmp_path / "only"
    datasets.DatasetDict({"validation": rows("va", 2)}).save_to_disk(str(only))
    assert len(read_records(only, "--eval-data")) == 2  # no test split: validation
    with pytest.raises(PactError, match=r"without a 'train' split .*pass --data-split NAME"):
        read_records(only, "--data")
    with pytest.raises(PactError, match=r"--eval-split x: .*a.jsonl is a file"):
        (tmp_path / "a.jsonl").write_text('{"prompt": "a", "completion": " b"}\n')
        read_records(tmp_path / "a.jsonl", "--eval-data", "x")
    single = tmp_path / "single"
    rows("s", 2).save_to_disk(str(single))
    with pytest.raises(PactError, match=r"--data-split train: .*single holds one dataset, not a DatasetDict"):
        read_records(single, "--data", "train")


def test_train_on_a_hub_id(tmp_path, monkeypatch):
    import datasets

    d = make_converted_llama(tmp_path, 16)
    rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
    from pact.runtime import data

    monkeypatch.setattr(data, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, split=None: datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows)}) if split is None else datasets.Dataset.from_list(rows))
    train(TrainConfig(artifact=str(d / "art"), data="org/sentiment", out=str(d / "run"), steps=2, batch_size=8,
                      max_len=64, lora_r=4, lora_alpha=8, kernels="torch"), progress=False)
    saved = json.loads((d / "run" / "train_config.json").read_text())
    assert saved["data"] == "org/sentiment" and len(saved["inputs_sha256"]["data"]) == 64


def test_missing_local_paths_are_not_hub_ids(tmp_path, monkeypatch):
    """A mistyped local path never goes to the hub: a data file's name, or a first part that is a
    folder here, is a missing file at once; offline, a hub id is refused before any retry."""
    from pact.runtime.data import looks_like_hub_id, read_records

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert looks_like_hub_id("tatsu-lab/alpaca") and not looks_like_hub_id("data/chats.jsonl")
    assert not looks_like_hub_id("data/chats") and not looks_like_hub_id("org/train.parquet")
    for p in ("data/chats.jsonl", "data/chats", "org/train.parquet"):
        with pytest.raises(PactError, match=rf"--data {p}: no such file or folder$"):
            read_records(p)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PactError, match=r"could not get it \(offline mode is set"):
        read_records("tatsu-lab/alpaca")
