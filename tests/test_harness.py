"""lm-evaluation-harness over pact (runtime/harness.py, `pact lm-eval`), offline, on a local task."""

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import make_converted_llama, make_sentiment_jsonl

lm_eval = pytest.importorskip("lm_eval")

from pact.pipelines.cli import main as pact_cli  # noqa: E402
from pact.runtime.evaluate import evaluate_artifact  # noqa: E402
from pact.runtime.trainer import TrainConfig, train  # noqa: E402

TASK = """task: pact_sentiment
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: [" fresh", " rotten"]
doc_to_target: "{{{{[' fresh', ' rotten'].index(completion)}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = make_converted_llama(tmp_path_factory.mktemp("harness"), 96)
    make_sentiment_jsonl(d / "test.jsonl", 24, seed=3)
    train(TrainConfig(artifact=str(d / "art"), data=str(d / "train.jsonl"), out=str(d / "run"), max_len=64,
                      batch_size=16, steps=8, lr=5e-3, lora_r=4, lora_alpha=8, kernels="torch"), progress=False)
    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "pact_sentiment.yaml").write_text(TASK.format(data=d / "test.jsonl"))
    return d


def test_lm_eval_accuracy_is_pact_evals(trained, tmp_path):
    """lm-eval's multiple-choice accuracy (log-likelihood of each choice after the prompt) equals
    pact-eval's label accuracy scored the same way (the labels' own tokens, no end-of-sequence)."""
    out = tmp_path / "results.json"
    r = CliRunner().invoke(pact_cli, ["lm-eval", str(trained / "art"), "--adapter", str(trained / "run"),
                                      "--tasks", "pact_sentiment", "--include-path", str(trained / "tasks"),
                                      "--batch-size", "4", "--output", str(out)])
    assert r.exit_code == 0, r.output
    acc = json.loads(out.read_text())["results"]["pact_sentiment"]["acc,none"]
    ours = evaluate_artifact(str(trained / "art"), str(trained / "test.jsonl"), adapter=str(trained / "run"),
                             max_len=64, score_eos=False)
    assert acc == pytest.approx(ours["eval_accuracy"]) and "pact_sentiment" in r.output


def test_rolling_loglikelihood_and_generation(trained):
    """loglikelihood_rolling of a text is minus pact's summed next-token loss over it (after the
    prefix token); generate_until stops at its stop string."""
    from lm_eval.api.instance import Instance

    from pact.runtime.harness import PactLM

    lm = PactLM(str(trained / "art"), adapter=str(trained / "run"), batch_size=2)
    text = "review: fresh bright keep the movie\nverdict: fresh"
    ids = [lm.prefix] + lm._encode(text)
    loss, n = lm.model(torch.tensor([ids]), torch.tensor([ids]))
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    assert n == len(ids) - 1 and got == pytest.approx(-float(loss.detach()), rel=2e-2)
    small = PactLM(str(trained / "art"), adapter=str(trained / "run"), max_length=8)  # windows of 8 tokens
    assert small.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0] < 0
    outs = lm.generate_until([Instance("generate_until", {}, ("review: the movie\nverdict:",
                                                               {"until": ["\n"], "max_gen_toks": 6}), 0)])
    assert len(outs) == 1 and "\n" not in outs[0]


def test_bad_tasks_are_one_line(trained):
    r = CliRunner().invoke(pact_cli, ["lm-eval", str(trained / "art"), "--tasks", "no_such_task_here",
                                      "--include-path", str(trained / "tasks")])
    assert r.exit_code == 1 and "Error: --tasks: unknown no_such_task_here" in r.output, r.output


def test_bad_numbers_are_one_line(trained):
    for args, msg in ((["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
                      (["--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
                      (["--limit", "0"], "--limit must be > 0"),
                      (["--limit", "-1"], "--limit must be > 0"),
                      (["--limit", "nan"], "--limit must be > 0"),
                      (["--num-fewshot", "-2"], "--num-fewshot must be >= 0, got -2"),
                      (["--max-length", "0"], "--max-length must be >= 2 (context tokens), got 0"),
                      (["--output", "/dev/null/x/res.json"], "--output /dev/null/x/res.json: cannot write in")):
        r = CliRunner().invoke(pact_cli, ["lm-eval", str(trained / "art"), "--tasks", "pact_sentiment",
                                          "--include-path", str(trained / "tasks"), *args])
        assert r.exit_code == 1 and f"Error: {msg}" in r.output, r.output


@pytest.mark.parametrize("error", ["offline", "not_cached"])
def test_a_task_whose_dataset_cannot_be_fetched_is_one_line(trained, monkeypatch, error):
    """A hub task without the network (HF_HUB_OFFLINE, or no route): one error naming --tasks and the fix, where
    lm-eval's traceback ended in huggingface_hub's or datasets' error."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    def fail(**kw):
        if error == "offline":
            raise OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled.")
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache")

    monkeypatch.setattr(lm_eval, "simple_evaluate", fail)
    r = CliRunner().invoke(pact_cli, ["lm-eval", str(trained / "art"), "--tasks", "pact_sentiment",
                                      "--include-path", str(trained / "tasks")])
    assert r.exit_code == 1 and r.output.startswith("Error: --tasks pact_sentiment: lm-eval could not fetch a task's "
                                                    "dataset ("), r.output
    assert "Traceback" not in r.output and "--include-path DIR" in r.output
