"""Writes DIR/modelopt_nvfp4 (tests/data/ holds its output): a tiny Llama (tests/conftest.py make_model)
quantized to NVFP4 by nvidia-modelopt and exported with its export_hf_checkpoint, plus ref.safetensors:
modelopt's own dequantization (NVFP4QTensor.dequantize) of every projection it exported.

    python tests/data/make_modelopt_nvfp4.py tests/data      # in a venv with nvidia-modelopt
"""
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import make_model

src, dst = Path(sys.argv[1]) / "src", Path(sys.argv[1]) / "modelopt_nvfp4"
shutil.rmtree(src, ignore_errors=True)
shutil.rmtree(dst, ignore_errors=True)
make_model(src, "llama")
import modelopt  # noqa: E402  (the script runs in steps: modelopt's after the model is written)
import modelopt.torch.quantization as mtq  # noqa: E402  (the script runs in steps: modelopt's after the model is written)
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402  (the script runs in steps: modelopt's after the model is written)
from safetensors.torch import save_file  # noqa: E402  (the script runs in steps: modelopt's after the model is written)
from transformers import AutoModelForCausalLM  # noqa: E402  (the script runs in steps: modelopt's after the model is written)

model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop=lambda m: m(ids))
export_hf_checkpoint(model, export_dir=dst)
from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: E402  (read back after the export)
from safetensors.torch import load_file  # noqa: E402  (read back after the export)

sd = load_file(dst / "model.safetensors")
ref = {}
for k, t in sd.items():  # modelopt's own dequantization of what it exported
    if k.endswith(".weight") and t.dtype == torch.uint8:
        base = k[: -len(".weight")]
        shape = torch.Size([t.shape[0], t.shape[1] * 2])
        q = NVFP4QTensor(shape, torch.float32, t)
        ref[k] = q.dequantize(dtype=torch.float32, scale=sd[base + ".weight_scale"],
                              double_scale=sd[base + ".weight_scale_2"], block_sizes={-1: 16}).float().contiguous()
for f in src.iterdir():
    if f.name.startswith("tokenizer"):
        shutil.copy(f, dst / f.name)
save_file(ref, dst / "ref.safetensors")
(dst / "WRITTEN_BY").write_text(f"nvidia-modelopt {modelopt.__version__}, torch {torch.__version__}; "
                                "tests/data/make_modelopt_nvfp4.py\n")
print(len(ref), sorted(p.name for p in dst.iterdir()))
