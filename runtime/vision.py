"""Image inputs for the language model of Qwen2-VL / Qwen2.5-VL artifacts.

The vision tower stays dense (bf16) in the artifact and runs as transformers' own module; its
features replace the embeddings of the image-pad tokens, and every token gets an M-RoPE
position (temporal, height, width) as transformers' ``get_rope_index`` gives them for images:
text runs count up on all three components, an image's tokens take their grid coordinates
offset by the position reached, and the text after it resumes past the image's largest side.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from pact.formats import Artifact, PactError
from pact.formats.families import VISION_PREFIXES

TOWERS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
}


@dataclass
class ImageSample:
    """One prompt with images, as the processor made it: token ids [S] with one image-pad token
    per merged patch, pixel patches [P, C * T * p * p], and each image's (t, h, w) patch grid."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    source: str = ""

    def numel(self) -> int:
        return self.input_ids.numel()


class VisionTower:
    """transformers' vision tower of the artifact's family, with the artifact's dense weights."""

    def __init__(self, artifact: Artifact, device: torch.device | str):
        from transformers import AutoConfig

        family = artifact.meta["family"]
        if family not in TOWERS:
            raise PactError(f"{artifact.path}: a {family} artifact has no vision tower; image prompts need "
                            f"one of {', '.join(TOWERS)}")
        cfg = AutoConfig.from_pretrained(artifact.hf_dir, trust_remote_code=False)
        module, cls = TOWERS[family]
        tower = getattr(importlib.import_module(module), cls)._from_config(cfg.vision_config)
        state = {}
        for name in artifact.names():
            pre = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
            if pre is not None:
                state[name[len(pre):]] = artifact.dense(name)
        missing, unexpected = tower.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise PactError(f"{artifact.path}: vision tensors do not match {cls} ({len(missing)} missing, e.g. "
                            f"{(missing or ['-'])[0]}; {len(unexpected)} unexpected): re-run pact-convert")
        self.device = torch.device(device)
        self.module = tower.to(self.device, torch.bfloat16).eval()
        self.image_token_id = int(cfg.image_token_id)
        self.merge = int(cfg.vision_config.spatial_merge_size)

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged image features [tokens, hidden] bf16, images in order."""
        out = self.module(pixel_values.to(self.device, torch.bfloat16), grid_thw=grid_thw.to(self.device))
        return getattr(out, "pooler_output", out)  # transformers >= 5 wraps it in an output object


def mrope_positions(input_ids: torch.Tensor, grid_thw: torch.Tensor, image_token_id: int, merge: int) -> torch.Tensor:
    """M-RoPE positions [3, S] for token ids [S] holding images of the (t, h, w) patch grids."""
    S = input_ids.numel()
    pos = torch.empty(3, S, dtype=torch.long)
    is_image = (input_ids == image_token_id).cpu()
    i = cur = img = 0
    while i < S:
        if not is_image[i]:
            j = i + 1
            while j < S and not is_image[j]:
                j += 1
            pos[:, i:j] = torch.arange(j - i) + cur
            cur += j - i
            i = j
            continue
        if img >= len(grid_thw):
            raise PactError(f"more image-pad tokens than the {len(grid_thw)} image grid(s) account for")
        t, h, w = (int(v) for v in grid_thw[img])
        h, w = h // merge, w // merge
        n = t * h * w
        if i + n > S or not bool(is_image[i:i + n].all()):
            raise PactError(f"image {img}: its {t}x{h}x{w} grid needs {n} image-pad tokens in a row")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pos[:, i:i + n] = grid.reshape(3, n) + cur
        cur += max(t, h, w)
        i += n
        img += 1
    if img != len(grid_thw):
        raise PactError(f"{len(grid_thw)} image grid(s) but image-pad tokens for {img}")
    return pos


def image_inputs(model, tower: VisionTower, sample: ImageSample) -> tuple[torch.Tensor, torch.Tensor]:
    """Input embeddings [S, hidden] (image features at the image-pad tokens) and M-RoPE positions [3, S]
    for ``model`` (a PactModel)."""
    ids = sample.input_ids.to(model.device)
    x = model.embed_ids(ids)
    feats = tower.features(sample.pixel_values, sample.grid_thw)
    mask = ids == tower.image_token_id
    if int(mask.sum()) != feats.shape[0]:
        raise PactError(f"{sample.source}: {int(mask.sum())} image-pad tokens but {feats.shape[0]} image features")
    x = x.masked_scatter(mask[:, None], feats.to(x.dtype))
    return x, mrope_positions(sample.input_ids, sample.grid_thw, tower.image_token_id, tower.merge).to(model.device)
