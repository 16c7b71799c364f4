import os
import tempfile

# Kernel tests run on the CPU under Triton's interpreter; it must be set before any
# kernel module (or triton itself) is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pact's cache (verified-artifact stamps, downloads) in a temp folder: tests never write the user's ~/.cache/pact
os.environ["PACT_CACHE"] = tempfile.mkdtemp(prefix="pact-test-cache-")

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# the tests of benchmarks/ import its scripts as modules (bench_fidelity, bench_train, ...)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_TEXT = [
    "the movie was fresh and bright",
    "a rotten plot with a tired cast",
    "quantized weights keep their scale",
    "sixteen values share one scale in every block",
    "low rank adapters learn the task",
] * 20


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(folder: Path, vocab_size: int = 256, vision: bool = False):
    """A byte-level BPE trained on the fly (no downloads), saved as an HF fast tokenizer (with
    ``vision``: Qwen2-VL's image tokens and a chat template that places images)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (VISION_TOKENS if vision else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TINY_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = VL_TEMPLATE if vision else (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


TEXT_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)


def make_model(folder: Path, family: str = "llama", seed: int = 0, dtype=torch.bfloat16, **overrides):
    """A tiny random HF model saved with save_pretrained (+ tokenizer) into ``folder``."""
    import transformers as tf

    torch.manual_seed(seed)
    dims = {**TEXT_DIMS, **overrides}
    if family == "llama":
        cfg = tf.LlamaConfig(**dims, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "mistral":
        cfg = tf.MistralConfig(**{"sliding_window": None, **dims}, tie_word_embeddings=False)
        model = tf.MistralForCausalLM(cfg)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**dims, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**dims, head_dim=16, tie_word_embeddings=True)
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "gemma3":  # a local layer (window 16) then a global one; a scale that is not head_dim's
        n = dims["num_hidden_layers"]
        cfg = tf.Gemma3TextConfig(**{"sliding_window": 16, **dims}, head_dim=16, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(n)])
        model = tf.Gemma3ForCausalLM(cfg)
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        # token ids of the vision specials as make_tokenizer(vision=True) assigns them (after 3 others)
        ids = dict(vision_start_token_id=3, vision_end_token_id=4, image_token_id=5, video_token_id=6)
        text = dict(**dims, rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]})  # sums to head_dim / 2
        if family == "qwen2_vl":
            cfg = tf.Qwen2VLConfig(text_config=text, **ids, vision_config=dict(
                depth=1, embed_dim=32, hidden_size=dims["hidden_size"], num_heads=2, mlp_ratio=2, spatial_merge_size=2))
            model = tf.Qwen2VLForConditionalGeneration(cfg)
        else:
            cfg = tf.Qwen2_5_VLConfig(text_config=text, **ids, vision_config=dict(
                depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=dims["hidden_size"],
                spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1]))
            model = tf.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    # Random init leaves norms at exactly 1 and biases at 0: perturb so tests see real values.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(folder)
    vision = family in ("qwen2_vl", "qwen2_5_vl")
    make_tokenizer(folder, vocab_size=256, vision=vision)
    if vision:  # small images: at most 16 image tokens each
        tf.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16).save_pretrained(folder)
    return model


def make_gguf(path: Path, seed=0, hidden=64, inter=128, layers=2, heads=4, kv=2):
    """A tiny random Llama as an F32 GGUF file (tensors + a gpt2-style BPE tokenizer)."""
    import json

    import gguf
    import numpy as np

    with tempfile.TemporaryDirectory() as tokdir:
        make_tokenizer(Path(tokdir))
        tj = json.loads((Path(tokdir) / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    g = torch.Generator().manual_seed(seed)
    def r(*shape): return (torch.randn(*shape, generator=g) * 0.05).numpy().astype(np.float32)
    w.add_tensor("token_embd.weight", r(len(tokens), hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + r(hidden))
        w.add_tensor(f"blk.{i}.attn_q.weight", r(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", r(kv * hidden // heads, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", r(kv * hidden // heads, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", r(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + r(hidden))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", r(inter, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", r(inter, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", r(hidden, inter))
    w.add_tensor("output_norm.weight", 1 + r(hidden))
    w.add_tensor("output.weight", r(len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_llama(tmp_path):
    folder = tmp_path / "llama"
    make_model(folder, "llama")
    return folder


@pytest.fixture
def tiny_qwen2(tmp_path):
    folder = tmp_path / "qwen2"
    make_model(folder, "qwen2")
    return folder


def make_realistic(folder: Path) -> None:
    """Heavy-tailed weights with a few outlier input channels, as trained LLMs have."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(f)
    g = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            w = torch.distributions.StudentT(3.0).sample(t.shape) * 0.02
            w[:, torch.randint(0, t.shape[1], (3,), generator=g)] *= 8
            tensors[name] = w.to(t.dtype)
    save_file(tensors, f, metadata={"format": "pt"})


POSITIVE = ["fresh", "bright", "keep", "learn", "share"]
NEGATIVE = ["rotten", "tired", "low", "plot", "cast"]


def make_sentiment_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    """A small learnable task: the verdict follows from which word list the review draws on."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            good = rng.random() < 0.5
            words = rng.sample(POSITIVE if good else NEGATIVE, 3) + rng.sample(["the", "a", "movie", "with", "and"], 2)
            rng.shuffle(words)
            f.write(json.dumps({"prompt": f"review: {' '.join(words)}\nverdict:",
                                "completion": " fresh" if good else " rotten"}) + "\n")
    return path


def make_sentiment_task(d: Path, n_train: int, n_test: int) -> Path:
    """A tiny Llama able to learn the sentiment task (a frozen random lm_head of std 0.02 cannot reach
    confident logits: initializer_range 0.15), its artifact in d/art, d/train.jsonl and d/test.jsonl."""
    from pact.convert import convert

    make_model(d / "src", "llama", initializer_range=0.15)
    convert(str(d / "src"), d / "art", progress=False)
    make_sentiment_jsonl(d / "train.jsonl", n_train, seed=0)
    make_sentiment_jsonl(d / "test.jsonl", n_test, seed=1)
    return d


def make_converted_llama(d: Path, n_examples: int) -> Path:
    """A tiny Llama in d/src, its artifact (the converter's defaults) in d/art and ``n_examples``
    sentiment examples in d/train.jsonl; returns d."""
    from pact.convert import convert

    make_model(d / "src", "llama")
    convert(str(d / "src"), d / "art", progress=False)
    make_sentiment_jsonl(d / "train.jsonl", n_examples)
    return d


def rehash_artifact(art: Path) -> None:
    """Re-record an edited artifact's checksums (files gone from hf/ leave the manifest, files added there join
    it): an artifact consistent with its manifest, as a faulty converter would write it, so the check under test
    is reached rather than verification's checksum mismatch or its unlisted-file refusal."""
    from pact.formats.artifact import sha256_file

    f = art / "zarr.json"
    root = json.loads(f.read_text())
    meta = root["attributes"]["pact"]
    hf = art / "hf"
    present = sorted(p.relative_to(hf).as_posix() for p in hf.rglob("*")
                     if p.is_file() and not p.is_symlink() and p.relative_to(hf).as_posix() != "zarr.json")
    meta["files"] = {rel: sha256_file(hf / rel) for rel in present}
    for e in meta["tensors"].values():
        for spec in e["arrays"].values():
            spec["sha256"] = sha256_file(art.joinpath(spec["path"], "c", *["0"] * len(spec["shape"])))
    f.write_text(json.dumps(root))


def edit_manifest(art: Path, edit) -> None:
    """Apply ``edit`` to an artifact's manifest (the ``pact`` attributes of its zarr.json) in place."""
    f = art / "zarr.json"
    root = json.loads(f.read_text())
    edit(root["attributes"]["pact"])
    f.write_text(json.dumps(root))
