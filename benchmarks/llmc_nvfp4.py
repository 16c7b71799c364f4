"""The peer calibration: llm-compressor's NVFP4 GPTQ (or round-to-nearest) of an HF model on a
.jsonl of texts, saved compressed (compressed-tensors nvfp4-pack-quantized) for `pact-convert` to
import. Runs in its own venv (llm-compressor pins transformers):

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch llmcompressor
    /tmp/llmc/bin/python benchmarks/llmc_nvfp4.py HF_FOLDER prompts.jsonl OUT gptq|rtn
    pact-convert OUT OUT-artifact
"""

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

hf, prompts, out, kind = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
tok = AutoTokenizer.from_pretrained(hf)
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
texts = [json.loads(line)["text"] for line in open(prompts)]
ds = Dataset.from_dict(tok(texts, truncation=True, max_length=128))
Modifier = GPTQModifier if kind == "gptq" else QuantizationModifier
t = time.perf_counter()
oneshot(model=model, processor=tok, dataset=ds, recipe=Modifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"]),
        max_seq_length=128, num_calibration_samples=len(texts))
print(f"llm-compressor {kind}: {time.perf_counter() - t:.0f} s on {torch.get_num_threads()} CPU threads")
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
