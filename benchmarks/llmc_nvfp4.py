"""The peer calibration: llm-compressor's NVFP4 GPTQ (or round-to-nearest) of an HF model on a
.jsonl of texts, saved compressed (compressed-tensors nvfp4-pack-quantized) for `pact-convert` to
import. Runs in its own venv (llm-compressor pins transformers), or where its wheels are installed
(bench_fidelity.py's `+llmc-gptq` weights run it with its own python):

    python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch llmcompressor
    /tmp/llmc/bin/python benchmarks/llmc_nvfp4.py HF_FOLDER prompts.jsonl OUT gptq|rtn [SAMPLES [SEQ_LEN]]
    pact-convert OUT OUT-artifact

The texts are pact-calibrate's: the first SAMPLES (128) of the file, each cut to SEQ_LEN (128)
tokens by the same tokenizer call, those shorter than 2 tokens dropped; one text a batch, in order.
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
samples, seq_len = (int(sys.argv[i]) if len(sys.argv) > i else 128 for i in (5, 6))  # pact's CALIB_SAMPLES, CALIB_LEN
if kind not in ("gptq", "rtn"):
    sys.exit(f"KIND is gptq or rtn, not {kind!r}")
tok = AutoTokenizer.from_pretrained(hf)
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
texts = [json.loads(line)["text"] for line in open(prompts) if line.strip()][:samples]
ids = [x for x in tok(texts, truncation=True, max_length=seq_len)["input_ids"] if len(x) >= 2]
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
Modifier = GPTQModifier if kind == "gptq" else QuantizationModifier
t = time.perf_counter()
oneshot(model=model, processor=tok, dataset=ds, recipe=Modifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"]),
        max_seq_length=seq_len, num_calibration_samples=len(ids), shuffle_calibration_samples=False)
print(f"llm-compressor {kind}: {len(ids)} texts of <= {seq_len} tokens ({sum(map(len, ids))} in all), "
      f"{time.perf_counter() - t:.0f} s on {'cuda' if torch.cuda.is_available() else 'the CPU'}")
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
