"""`pact generate ARTIFACT [--adapter RUN] --prompt TEXT` and `pact chat ARTIFACT [--adapter RUN]`:
text from the NVFP4 model (with a trained adapter), a key/value cache, greedy unless
--temperature > 0. On a CPU they run on the PyTorch twins."""

from __future__ import annotations

import functools
import sys

import click

from pact.formats import PactError
from pact.runtime.trainer import TrainConfig

from .common import ADAPTER, ARTIFACT, SCORING_HELPS, cli_errors, config_options


def _sampling(fn):
    for opt in reversed((
        click.option("--adapter", default=None, type=ADAPTER,
                     help="A pact-train run folder, or its best/ (PEFT adapter); none = the base model."),
        click.option("--max-new-tokens", type=int, default=256, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0: greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling (temperature > 0)."),
        click.option("--seed", type=int, default=None, help="Sampling seed (default: a fresh one)."),
    )):
        fn = opt(fn)
    return config_options(TrainConfig, only=("activations", "compute", "device"), helps=SCORING_HELPS)(fn)


class _Printer:
    """Prints generated tokens as they come, decoding a few tokens at a time (the whole reply each time
    would cost its length per token: quadratic): the text of the tokens since ``start``, past what the
    tokens from ``start`` to ``shown`` gave, is what is new (as vLLM streams). A token that completes a
    character only with the next one is held back until it does."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.start, self.shown = tokenizer, [], 0, 0

    def __call__(self, token: int, last: bool = False) -> None:
        if token is not None:
            self.ids.append(token)
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        before = decode(self.ids[self.start:self.shown])  # (the window's first tokens give its context:
        text = decode(self.ids[self.start:])               # a leading space a tokenizer strips, strips in both)
        if len(text) > len(before) and (last or not text.endswith("\ufffd")):
            click.echo(text[len(before):], nl=False)
            sys.stdout.flush()
            self.start, self.shown = self.shown, len(self.ids)

    def finish(self) -> None:
        """What is still held back (a reply that ends mid-character: --max-new-tokens, or a stop after a
        character's first bytes), printed as it decodes."""
        self(None, last=True)


def _checked_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode (undecodable input bytes reach Python as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PactError(f"{what} is not UTF-8 text (character {e.start + 1}): give text, not binary data") from None
    return text


def _stops(tokenizer) -> set[int]:
    stops = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):  # chat templates' end-of-turn tokens
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            stops.add(tid)
    return stops


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.option("--prompt", required=True, help="The text to continue ('-': read it from standard input).")
@click.option("--chat", "use_chat", is_flag=True,
              help="Wrap --prompt as a user message in the artifact's chat template (as pact-train renders messages).")
@_sampling
@cli_errors
def generate_cmd(artifact, prompt, use_chat, adapter, max_new_tokens, temperature, top_p, seed, activations, compute,
                 device) -> None:
    """Continue --prompt with ARTIFACT (and --adapter), printing tokens as they come."""
    from pact.runtime.evaluate import load_adapted
    from pact.runtime.generate import generate

    text = _checked_text(sys.stdin.read() if prompt == "-" else prompt, "--prompt")
    model, tok = load_adapted(artifact, adapter, device=device, activations=activations, compute=compute,
                              tool="pact generate")
    if use_chat:
        ids = _chat_ids(tok, [{"role": "user", "content": text}])
    else:
        ids = tok(text, add_special_tokens=True)["input_ids"]
    generate(model, ids, max_new_tokens=max_new_tokens, stop_ids=_stops(tok), temperature=temperature, top_p=top_p,
             seed=seed, on_token=(printer := _Printer(tok)))
    printer.finish()
    click.echo()


def _chat_ids(tok, messages: list[dict], command: str = "pact generate --chat") -> list[int]:
    from pact.runtime.data import render_chat

    if not getattr(tok, "chat_template", None):
        raise PactError(f"{command} needs a chat template, and the artifact's tokenizer has none: continue plain "
                        "text with pact generate --prompt (no --chat)")
    return tok(render_chat(tok, messages, "chat", add_generation_prompt=True), add_special_tokens=False)["input_ids"]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.option("--system", default=None, help="A system message first.")
@_sampling
@cli_errors
def chat_cmd(artifact, system, adapter, max_new_tokens, temperature, top_p, seed, activations, compute,
             device) -> None:
    """Talk with ARTIFACT (and --adapter) through its chat template. Each turn reuses the cached
    keys and values of the conversation so far; when it outgrows the model's context the oldest
    exchanges are dropped. /reset starts over, /exit (or end of input) ends."""
    from pact.runtime.evaluate import load_adapted
    from pact.runtime.generate import generate, truncate

    model, tok = load_adapted(artifact, adapter, device=device, activations=activations, compute=compute,
                              tool="pact chat")
    _chat_ids(tok, [{"role": "user", "content": "check"}], "pact chat")  # no template: fails now, not at a turn
    history = [{"role": "system", "content": system}] if system else []
    window = int(getattr(model.cfg, "max_position_embeddings", 0) or 0)
    if system and window:  # a system message the context cannot hold leaves no room for any turn
        n = len(_chat_ids(tok, history + [{"role": "user", "content": "hi"}]))
        if n >= window:
            raise PactError(f"--system takes {n} tokens with one short turn; the model's context is {window}: "
                            "shorten it")
    cache, cached = None, []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history, cache, cached = history[:1] if system else [], None, []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": _checked_text(line.rstrip("\n"), "the chat input")})
        ids = _chat_ids(tok, history)
        first, dropped = (1 if system else 0), False  # the system message stays
        while window and len(ids) + min(max_new_tokens, 64) > window and len(history) > first + 1:
            del history[first : first + 2]  # the oldest exchange goes: the conversation fits the context again
            ids, dropped = _chat_ids(tok, history), True
        if dropped and len(ids) < window:  # (a message too long alone is said by generate, the turn dropped)
            click.echo("(earlier turns dropped to fit the model's context)", err=True)
        keep = 0  # the cached tokens this rendering starts with
        while keep < min(len(cached), len(ids) - 1) and cached[keep] == ids[keep]:
            keep += 1
        if cache is not None:
            truncate(cache, keep)
        else:
            cache = [None] * len(model.layers)
        printer = _Printer(tok)
        try:
            out = generate(model, ids[keep:], max_new_tokens=max_new_tokens, stop_ids=_stops(tok),
                           temperature=temperature, top_p=top_p, seed=seed, on_token=printer, cache=cache, pos=keep)
        except PactError as e:  # (the conversation outgrew the context): said, the turn dropped, the chat goes on
            click.echo(f"Error: {e}", err=True)
            history.pop()
            truncate(cache, keep)
            continue
        printer.finish()
        click.echo()
        cached = ids + out
        history.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})
