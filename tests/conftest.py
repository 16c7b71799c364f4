import os

# Kernel tests run on the CPU under Triton's interpreter; it must be set before any
# kernel module (or triton itself) is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_TEXT = [
    "the movie was fresh and bright",
    "a rotten plot with a tired cast",
    "quantized weights keep their scale",
    "sixteen values share one scale in every block",
    "low rank adapters learn the task",
] * 20


def make_tokenizer(folder: Path, vocab_size: int = 256):
    """A byte-level BPE trained on the fly (no downloads), saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TINY_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
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
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**dims, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**dims, head_dim=16, tie_word_embeddings=True)
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(
            text_config=dict(**dims, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, spatial_merge_size=2),
        )
        model = tf.Qwen2VLForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    # Random init leaves norms at exactly 1 and biases at 0: perturb so tests see real values.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(folder)
    make_tokenizer(folder, vocab_size=256)
    return model


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
