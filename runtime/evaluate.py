"""Held-out evaluation: token loss; accuracy by label likelihood when completions are labels;
exact match and token F1 of greedy generations otherwise (``generate``)."""

from __future__ import annotations

import logging
import math
import re
import string
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from pact.formats import PactError
from pact.formats.files import read_json

from .autorecipe import parse_auto
from .checkpoints import CALIBRATED
from .data import IGNORE, Example, collate
from .matmul import mm
from .model import rmsnorm

log = logging.getLogger(__name__)


def _target_logprobs(model, hs: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """hs [m, H] final-normed hidden states, each predicting targets[i] for sequence rows[i]:
    sum of log p(target) per sequence [n] (the lm_head in chunks of ~16M logits)."""
    out = torch.zeros(n, dtype=torch.float32, device=hs.device)
    step = max(1, (1 << 24) // model.lm_head.shape[0])
    for i in range(0, hs.shape[0], step):
        logp = F.log_softmax(mm(hs[i : i + step], model.lm_head.t()).float(), dim=-1)
        out.index_add_(0, rows[i : i + step], logp.gather(1, targets[i : i + step, None]).squeeze(1))
    return out


@torch.no_grad()
def sequence_logprobs(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of log p(target) per sequence [B] (logits only at target positions)."""
    h = model.hidden_states(ids)
    targets = labels[:, 1:]
    sel = targets != IGNORE
    hs = rmsnorm(h[:, :-1][sel], model.final_norm, model.eps)
    return _target_logprobs(model, hs, targets[sel], torch.nonzero(sel)[:, 0], ids.shape[0])


def label_candidates(examples: list[Example], max_labels: int = 32, drop_eos: int | None = None
                     ) -> dict[str, list[int]] | None:
    """Completion text -> its token ids, when the completions look like class labels
    (between 2 and ``max_labels`` distinct values, each seen at least twice on average). The
    ids end with the end-of-sequence token tokenize() appends, unless ``drop_eos`` (its id) is given."""
    cands: dict[str, list[int]] = {}
    for e in examples:
        ids = e.ids[len(e.prompt_ids):]
        cands.setdefault(e.completion,
                         ids[:-1] if drop_eos is not None and len(ids) > 1 and ids[-1] == drop_eos else ids)
    if 2 <= len(cands) <= max_labels and len(cands) * 2 <= len(examples):
        return cands
    return None


def candidate_batches(examples: list[Example], cands: dict[str, list[int]], batch_size: int, pad_id: int, device):
    """Per chunk of ``batch_size`` examples: (chunk, ids, labels) holding every (example,
    candidate) sequence, candidates in ``cands`` order, only the candidate's tokens labelled."""
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        seqs = [Example(e.prompt_ids + cands[c], [IGNORE] * len(e.prompt_ids) + cands[c], c, e.prompt_ids)
                for e in chunk for c in cands]
        yield (chunk, *collate(seqs, list(range(len(seqs))), pad_id, device))


def shared_prefix_batches(examples: list[Example], cands: dict[str, list[int]], batch_size: int, pad_id: int,
                          device):
    """Per chunk of ``batch_size`` examples: (chunk, ids [B, S], positions [B, S], mask [B, 1, S, S],
    src, tgt, seg). Row b holds example b's prompt once, then every candidate (in ``cands`` order),
    each placed at the positions right after the prompt and attending to the prompt and to itself
    only: each candidate scores as prompt + candidate alone, while the prompt runs once instead of
    once per candidate. src [m]: the flat index (b * S + t) of the hidden state that predicts a
    candidate token, tgt [m] that token, seg [m] its (example, candidate) index b * C + c."""
    names = list(cands)
    C = len(names)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        B = len(chunk)
        S = max(len(e.prompt_ids) for e in chunk) + sum(len(t) for t in cands.values())
        ids = torch.full((B, S), pad_id, dtype=torch.long)
        pos = torch.zeros(B, S, dtype=torch.long)
        mask = torch.zeros(B, S, S, dtype=torch.bool)
        src: list[int] = []
        tgt: list[int] = []
        seg: list[int] = []
        for b, e in enumerate(chunk):
            P = len(e.prompt_ids)
            ids[b, :P] = torch.tensor(e.prompt_ids, dtype=torch.long)
            pos[b, :P] = torch.arange(P)
            mask[b, :P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
            at = P
            for c, name in enumerate(names):
                t = cands[name]
                n = len(t)
                ids[b, at : at + n] = torch.tensor(t, dtype=torch.long)
                pos[b, at : at + n] = torch.arange(P, P + n)
                mask[b, at : at + n, :P] = True
                mask[b, at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
                for m in range(n):  # token m is predicted by the prompt's last token, then by token m - 1
                    prev = P - 1 if m == 0 else at + m - 1
                    if prev >= 0:
                        src.append(b * S + prev)
                        tgt.append(t[m])
                        seg.append(b * C + c)
                at += n
            rest = torch.arange(at, S)
            mask[b, rest, rest] = True  # padding sees itself (no empty attention rows)
        yield (chunk, ids.to(device), pos.to(device), mask[:, None].to(device), torch.tensor(src, device=device),
               torch.tensor(tgt, device=device), torch.tensor(seg, device=device))


@torch.no_grad()
def candidate_logprobs(model, examples: list[Example], cands: dict[str, list[int]], batch_size: int, pad_id: int):
    """Per chunk: (chunk, log-likelihood [len(chunk), C] of every candidate after each prompt)."""
    for chunk, ids, pos, mask, src, tgt, seg in shared_prefix_batches(examples, cands, batch_size, pad_id,
                                                                      model.device):
        h = model.hidden_states(ids, pos, mask).reshape(-1, model.hidden)[src]
        hs = rmsnorm(h, model.final_norm, model.eps)
        yield chunk, _target_logprobs(model, hs, tgt, seg, len(chunk) * len(cands)).view(len(chunk), len(cands))


@torch.no_grad()
def evaluate(model, examples: list[Example], *, batch_size: int, pad_id: int, progress: bool = False,
             drop_eos: int | None = None) -> dict:
    """{"eval_loss", "eval_tokens", and for label-style data "eval_accuracy", "eval_labels",
    "eval_predicted" (how many examples each label was the best-scored one for: a run that collapsed
    onto one label shows it there, whatever its accuracy; `collapse_note`) and "eval_answers" (how
    many examples each label is the answer of)}.

    Label-style data is scored in one pass: each example's prompt runs once with every candidate
    after it (`shared_prefix_batches`), ``batch_size`` examples per batch; the true candidate's
    log-likelihood gives the loss.
    A candidate's likelihood includes the end-of-sequence token after it (as training targets
    it), unless ``drop_eos`` names that token's id. ``progress``: a bar over the batches.
    """
    from tqdm.auto import tqdm

    device = model.device
    cands = label_candidates(examples, drop_eos=drop_eos)
    total, count = 0.0, 0
    bar = tqdm(total=len(examples), desc="scoring", unit="ex", disable=not progress)
    if cands is None:
        for i in range(0, len(examples), batch_size):
            bar.update(min(batch_size, len(examples) - i))
            ids, labels = collate(examples, list(range(i, min(i + batch_size, len(examples)))), pad_id, device)
            loss, n = model(ids, labels)
            total, count = total + float(loss), count + n
        return {"eval_loss": total / max(count, 1), "eval_tokens": count}
    names = list(cands)
    correct = 0
    predicted = dict.fromkeys(names, 0)
    answers = dict(Counter(e.completion for e in examples))  # (cands' keys are these completions, in this order)
    for chunk, logp in candidate_logprobs(model, examples, cands, batch_size, pad_id):
        bar.update(len(chunk))
        for e, row in zip(chunk, logp):
            best = names[int(row.argmax())]
            correct += best == e.completion
            predicted[best] += 1
            total -= float(row[names.index(e.completion)])
            count += len(cands[e.completion])
    return {"eval_loss": total / max(count, 1), "eval_tokens": count, "eval_accuracy": correct / len(examples),
            "eval_labels": names, "eval_predicted": predicted, "eval_answers": answers}


def collapse_note(result: dict, share: float = 0.95) -> str | None:
    """A line for the user when one label won at least ``share`` of the examples while it is the
    answer of fewer (a model collapsed onto one label scores that label's share, and no more); None
    otherwise, and for results without label counts."""
    predicted, answers = result.get("eval_predicted"), result.get("eval_answers")
    if not predicted or not answers:
        return None
    n = sum(predicted.values())
    label = max(predicted, key=predicted.get)
    if n < 20 or predicted[label] < share * n or answers.get(label, 0) >= share * n:
        return None
    return (f"note: {label!r} was the likeliest label for {predicted[label] / n:.0%} of the {n} examples and is "
            f"the answer of {answers.get(label, 0) / n:.0%}: the model has collapsed onto one label (more steps, "
            "another learning rate or more data usually move it)")


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy continuation of one prompt (with a key/value cache: runtime/generate.py). Stops at a
    token in ``stop_ids``, which is not returned."""
    from .generate import generate

    return generate(model, prompt_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids)


_PUNCTUATION = set(string.punctuation)


def _normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(_normalize(prediction) == _normalize(reference))


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = _normalize(prediction).split(), _normalize(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def evaluate_generation(model, examples: list[Example], tokenizer, *, max_new_tokens: int | None = None) -> dict:
    """Greedy generation per example against its completion: {"eval_exact_match", "eval_f1"}.
    ``max_new_tokens`` defaults to the longest reference completion (in tokens) plus 8."""
    if max_new_tokens is None:
        max_new_tokens = max(len(e.ids) - len(e.prompt_ids) for e in examples) + 8
    stop = {t for t in (tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)) if t is not None}
    em = f1 = 0.0
    for e in examples:
        text = tokenizer.decode(greedy_generate(model, e.prompt_ids, max_new_tokens, stop), skip_special_tokens=True)
        em += exact_match(text, e.completion)
        f1 += token_f1(text, e.completion)
    n = max(len(examples), 1)
    return {"eval_exact_match": em / n, "eval_f1": f1 / n, "eval_generated": len(examples)}


def run_record(adapter: str) -> dict:
    """A pact-train run's train_config.json ({} when there is none; an unreadable one is said once and
    read as none: an adapter folder copied without it, or damaged, still loads)."""
    f = Path(adapter) / "train_config.json"
    if f.is_symlink():
        record = PactError("a symbolic link (a run's record is read from its folder only)")
    elif not f.is_file():
        return {}
    else:
        try:
            record = read_json(f, "its recorded settings are not used", PactError)
        except PactError as e:
            record = e
    if not isinstance(record, dict):
        log.warning("%s: unreadable (%s); the run's recorded settings are not used", f,
                    record if isinstance(record, Exception) else "not a JSON object")
        return {}
    return record


def trained_on_own_calibrated(record: dict) -> bool:
    """By its run record, the run trained on its own RUN/calibrated/ (pact-train's calibration), wherever
    the run folder is now (the record names the folder it was written in)."""
    where, was = record.get("artifact"), record.get("out")
    return isinstance(where, str) and isinstance(was, str) and where == str(Path(was) / CALIBRATED)


def run_folder(adapter: str) -> Path:
    """The pact-train run an adapter folder belongs to: itself, or the run holding it (RUN/best/,
    RUN/checkpoints/step-N/)."""
    a = Path(adapter)
    if (a / "train_config.json").is_file():
        return a
    for run, inside in ((a.parent, a.name == "best"), (a.parent.parent, a.parent.name == "checkpoints")):
        if inside and (run / "train_config.json").is_file():
            return run
    return a


def own_weights(artifact: str, adapter: str | None) -> str:
    """The artifact an adapter learned on, when ``artifact`` is the one its run calibrated into its own
    RUN/calibrated/ (pact-train's default): that calibrated/, said once; otherwise ``artifact``."""
    if not adapter:
        return artifact
    run = run_folder(adapter)
    if not trained_on_own_calibrated(run_record(str(run))):
        return artifact
    from pact.formats import PactError, open_artifact

    own = run / CALIBRATED
    try:
        made_from = open_artifact(own).meta["provenance"]["calibration"]["for_run"]["artifact_fingerprint"]
        if made_from != open_artifact(artifact).fingerprint():
            return artifact  # other weights: warn_other_weights says so
    except (PactError, OSError, KeyError, ValueError, TypeError):
        return artifact  # (a calibrated/ gone or unreadable, or a bad artifact: said where it is opened)
    log.info("%s learned on %s, calibrated from %s by its run: using it", adapter, own, artifact)
    return str(own)


def warn_other_weights(adapter: str, artifact, tool: str) -> None:
    """A warning when the run in ``adapter`` trained on other weights than the open ``artifact``'s
    (e.g. a run pact-train calibrated for, whose weights are its OUT/calibrated/)."""
    run = run_folder(adapter)
    record = run_record(str(run))
    inputs = record.get("inputs_sha256")
    trained_on = inputs.get("artifact") if isinstance(inputs, dict) else None
    if trained_on and trained_on != artifact.fingerprint():
        where = record.get("artifact")
        if trained_on_own_calibrated(record):
            where = str(run.resolve() / CALIBRATED)  # its own calibrated/, wherever the run folder is now
            if not Path(where).is_dir():
                log.warning("%s was trained on its run's calibrated weights, %s, which are gone: %s runs it on %s, "
                            "other weights than it learned on (pact-calibrate the artifact with the run's --data "
                            "and --max-len into that folder for close ones, or train again)", adapter, where, tool,
                            artifact.path)
                return
        log.warning("%s was trained on %s, whose weights differ from %s: give %s that artifact to use the weights "
                    "the adapter learned on", adapter, where if isinstance(where, str) else "another artifact",
                    artifact.path, tool)


def load_adapted(artifact: str, adapter: str | None, *, device: str | None = None, activations: str | None = None,
                 compute: str | None = None, tool: str = "pact-eval"):
    """(model, tokenizer): the verified artifact with a PEFT adapter folder loaded (or none).
    ``activations`` None: the recipe the adapter's run recorded (its train_config.json), else the default."""
    from pact.formats.peft import load_peft_adapter

    from .session import open_session

    artifact = own_weights(artifact, adapter)  # a run's own calibrated/, given the artifact it was made from
    lora_cfg, weights = load_peft_adapter(adapter) if adapter else (None, None)  # (a bad one said before "loading")
    log.info("loading %s%s (its checksums are verified on first use)", artifact, f" with {adapter}" if adapter else "")
    ses = open_session(artifact, device=device, tool=tool)  # a damaged artifact never runs
    if lora_cfg is not None:  # (the LoRA modules are sized by r before the adapter's tensors are compared)
        widest = max(min(e["shape"]) for e in ses.artifact.meta["tensors"].values() if len(e["shape"]) == 2)
        if lora_cfg.r > widest:
            raise PactError(f"--adapter {adapter}: rank r={lora_cfg.r} in its adapter_config.json, more than any "
                            f"projection of {ses.artifact.path} has ({widest}): not an adapter of this model; give "
                            "the artifact it was trained on")
    if activations is None and adapter:  # the recipe the adapter was trained with
        recorded = run_record(str(run_folder(adapter))).get("activations")  # (RUN/best/: the run's)
        if recorded is not None and not isinstance(recorded, str):
            log.warning("%s/train_config.json: activations %r is not a recipe; the default is used", adapter, recorded)
            recorded = None
        activations = recorded
    if adapter:
        warn_other_weights(adapter, ses.artifact, tool)
    if parse_auto(activations) is not None:  # auto picks saved copies only, which no forward pass reads:
        activations = None  # its GEMM and LoRA inputs are the default's
    # scoring and generation never run a backward: the backward layouts stay on disk (half the frozen weights)
    model = ses.model(lora_cfg, activations=activations, compute=compute, backward=False)
    if weights is not None:
        model.load_adapter_state(weights)
    return model, ses.tokenizer


def evaluate_artifact(artifact: str, data: str, *, adapter: str | None = None, max_len: int = 1024, batch_size: int = 8,
                      device: str | None = None, activations: str | None = None, generate: bool | None = None,
                      max_new_tokens: int | None = None, compute: str | None = None, progress: bool = False,
                      score_eos: bool = True, split: str | None = None) -> dict:
    """Held-out loss (and label accuracy) of an artifact, with a PEFT adapter folder or zero-shot.
    ``generate`` (default: when completions are not class labels) adds exact match / token F1.
    ``activations`` None: the recipe the adapter's run recorded (its train_config.json), else the default.
    ``score_eos``: a label's likelihood includes the end-of-sequence token after it (training's target).
    ``split``: of a datasets folder (default: test, else validation)."""
    from pact.formats import PactError

    from .data import DEFAULT_SPLITS, pad_id, read_records, tokenize

    for flag, value, low in (("--batch-size", batch_size, 1), ("--max-len", max_len, 2)):
        if value < low:
            raise PactError(f"{flag} must be >= {low}, got {value}")
    model, tokenizer = load_adapted(artifact, adapter, device=device, activations=activations, compute=compute,
                                    tool="pact-eval")
    records = read_records(data, "--data", split, default_splits=DEFAULT_SPLITS["--eval-data"])
    examples = tokenize(records, tokenizer, max_len=max_len, vocab_size=model.embed.shape[0])
    prompted = [e for e in examples if e.prompt_ids]  # plain {"text"} records, empty prompts: a loss only
    if generate and not prompted:
        raise PactError(f"--data {data}: no record has a prompt to generate from (plain {{\"text\"}} records or "
                        "empty prompts); drop --generate (the loss is measured without it)")
    result = {"adapter": adapter, **evaluate(model, examples, batch_size=batch_size, pad_id=pad_id(tokenizer),
                                             progress=progress, drop_eos=None if score_eos else tokenizer.eos_token_id)}
    if not math.isfinite(result["eval_loss"]):  # a score of NaN is no score: said, not printed
        raise PactError(f"{f'--adapter {adapter}' if adapter else artifact}: the model computes non-finite values "
                        "(NaN or inf) on --data: "
                        + ("the adapter is not usable (check lora_alpha / r in its adapter_config.json: the update "
                           "is scaled by their ratio), or retrain it" if adapter else
                           "the artifact is damaged or crafted; re-copy it or re-run pact-convert"))
    if prompted and (generate or (generate is None and "eval_accuracy" not in result)):
        if len(prompted) < len(examples):
            log.info("generation scored on the %d of %d examples with a prompt", len(prompted), len(examples))
        result.update(evaluate_generation(model, prompted, tokenizer, max_new_tokens=max_new_tokens))
    return result
