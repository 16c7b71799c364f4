"""The setup every tool runs before its work: the device, the artifact (opened, its checksums
verified once per unchanged copy), its tokenizer, and the model over it. One helper for
pact-train, pact-eval and pact-calibrate."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pact.formats import Artifact, PactError, default_cache, open_artifact
from pact.formats.peft import LoraConfig

from .distributed import env_world
from .model import TRAINABLE_FAMILIES, PactModel
from .ops import resolve_device

log = logging.getLogger(__name__)


@dataclass
class Session:
    device: torch.device
    artifact: Artifact
    tokenizer: object  # a transformers tokenizer, from the artifact's hf/ folder

    def model(self, lora: LoraConfig | None, **kw) -> PactModel:
        """The model over this artifact (keywords: PactModel's), its embedding checked against the
        tokenizer."""
        model = PactModel(self.artifact, lora, device=self.device, **kw)
        vocab = model.embed.shape[0]
        if len(self.tokenizer) > vocab:
            raise PactError(f"{self.artifact.hf_dir}: tokenizer has {len(self.tokenizer)} tokens but the embedding has "
                            f"{vocab} rows: artifact and tokenizer do not match; "
                            "re-run pact-convert on the model folder")
        return model


def open_session(artifact: str | Artifact, *, device: str | None = None, tool: str = "pact-train",
                 flag: str | None = None) -> Session:
    """Device, verified artifact and tokenizer for ``tool``; ``artifact``: a path or URL, or one the
    caller opened already (its checks are the opening's). ``flag``: the option that named the
    artifact, prefixed to a failed verification."""
    if tool != "pact-train" and env_world() > 1:
        raise PactError(f"{tool} runs in one process (WORLD_SIZE={os.environ['WORLD_SIZE']}): run it without "
                        "torchrun; only pact-train is data-parallel")
    dev = resolve_device(device)
    if dev.type == "cpu" and tool == "pact-train":
        log.warning("no GPU: training on the CPU (correct, slow; fine for tiny models and tests)")
    art = artifact if isinstance(artifact, Artifact) else open_artifact(artifact)
    try:  # every checksum, once per unchanged artifact: a damaged one is never used
        art.verify_cached(default_cache())
    except PactError as e:
        raise PactError(f"{flag}: {e}" if flag else str(e)) from None
    if art.meta["family"] not in TRAINABLE_FAMILIES:
        raise PactError(f"{art.path}: {tool} supports {', '.join(TRAINABLE_FAMILIES)} artifacts; "
                        f"this one is {art.meta['family']}")
    return Session(dev, art, load_tokenizer(art))


def load_tokenizer(art: Artifact):
    """The artifact's tokenizer (never its code), or one error naming its folder: a tokenizer file that is
    valid JSON but not a tokenizer fails inside transformers with a KeyError or the like."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(art.hf_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise PactError(f"{art.hf_dir}: the tokenizer cannot be loaded from its files and config.json "
                        f"({type(e).__name__}: {e}): the artifact is damaged or crafted; re-copy it or re-run "
                        "pact-convert") from None
