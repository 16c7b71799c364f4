"""The PACT decoder against transformers + PEFT on the same dequantized weights."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, make_realistic
from pact.convert import convert
from pact.formats import PactError, open_artifact
from pact.formats.peft import ALL_TARGETS, LoraConfig
from pact.runtime.functions import saved_bytes_per_token
from pact.runtime.model import PactModel
from pact.runtime.recipe import parse_recipe

R, ALPHA = 4, 8.0


def _artifact(tmp_path, family):
    make_model(tmp_path / "src", family)
    # 2d + amax: forward and backward read the same weights, so autograd through transformers on
    # the dequantized weights is the exact reference (the claim these tests make)
    return open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False, scaling="2d",
                                 block_scales="amax"))


def _hf_peft(art, src, model, dtype=torch.bfloat16):
    """transformers model with the artifact's dequantized weights, PEFT LoRA = pact's adapters; in bf16
    as users run it, or in fp32 (``dtype``): the exact product of those weights, no bf16 rounding anywhere."""
    import peft
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.load_state_dict({n: art.dequantize(n) for n in art.names()}, strict=False)
    pm = peft.get_peft_model(hf.to(dtype),
                             peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(ALL_TARGETS)))
    mods = dict(pm.named_modules())
    pairs = {}
    for name, lo in model.adapters.items():
        mod = mods["base_model.model." + name.removesuffix(".weight")]
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        a.data, b.data = lo.A.detach().clone(), lo.B.detach().clone()  # fp32 adapters, as pact keeps them
        pairs[name] = ((lo.A, a), (lo.B, b))
    return pm, pairs


def _batch(vocab=256, b=4, s=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :7] = -100  # a prompt whose tokens are not targets
    return ids, labels


def _random_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.lora_params.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)  # B != 0 so every gradient is non-trivial


def _cosines(pairs):
    out = {}
    for name, ((a, ra), (b, rb)) in pairs.items():
        for which, ours, ref in (("A", a, ra), ("B", b, rb)):
            out[f"{name}:{which}"] = F.cosine_similarity(ours.grad.flatten().double(), ref.grad.flatten().double(),
                                                         dim=0).item()
    return out


def _against_hf(art, src, model, dtype=torch.bfloat16):
    """(pact's mean loss, transformers + PEFT's, LoRA gradient cosines) on one batch, random adapters."""
    _random_adapters(model)
    ids, labels = _batch()
    loss, n = model(ids, labels)
    (loss / n).backward()
    pm, pairs = _hf_peft(art, src, model, dtype)
    ref = pm(input_ids=ids, labels=labels).loss
    ref.backward()
    return (loss / n).item(), ref.item(), _cosines(pairs)


def _compare(tmp_path, family, activations, compute=None):
    art = _artifact(tmp_path, family)
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations=activations, compute=compute)
    return _against_hf(art, tmp_path / "src", model)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_same_math_as_transformers(tmp_path, family):
    """With activations kept in bf16 the PACT path is transformers + PEFT, up to bf16 rounding."""
    ours, ref, cos = _compare(tmp_path, family, "bf16")
    assert ours == pytest.approx(ref, rel=2e-3)  # bf16 attention/MLP rounding in different places
    assert min(cos.values()) >= 0.999, min(cos.items(), key=lambda kv: kv[1])


def test_backward_weights_forward_is_the_exact_gradient(tmp_path):
    """The converter's default 1x16 artifact holds W^T rounded a second time along N for the input
    gradients, so its LoRA gradients are not quite those of the forward's weights. With
    `--backward-weights forward` they are (transformers + PEFT in fp32 on the forward layout's dequantized
    weights: the exact reference, which bf16 PEFT is not: its roundings fall elsewhere than pact's), and
    the backward layouts are never loaded."""
    make_model(tmp_path / "src", "llama", num_hidden_layers=4)
    make_realistic(tmp_path / "src")
    art = open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False))
    worst, mean = {}, {}
    for reads in ("layout", "forward"):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="bf16", backward_weights=reads)
        groups = [g for L in model.layers for g in (L.qkv, L.o, L.gate_up, L.down)]
        assert model.ops.dgrad_reads == reads
        assert all((g.weight_t is None) == (reads == "forward") for g in groups)
        ours, ref, cos = _against_hf(art, tmp_path / "src", model, torch.float32)
        assert ours == pytest.approx(ref, rel=2e-3)
        worst[reads] = 1 - min(cos.values())
        mean[reads] = 1 - sum(cos.values()) / len(cos)
    # pact's bf16 roundings only (other seeds of this batch and these adapters: worst 3e-4 to 2e-3, mean <= 5e-4)
    assert mean["forward"] <= 1e-3 and worst["forward"] <= 5e-3, (mean, worst)
    assert worst["layout"] > 10 * worst["forward"], worst  # the second rounding is visible here (~0.1)


def test_backward_weights_checked(tmp_path):
    art = _artifact(tmp_path, "llama")
    with pytest.raises(PactError, match="--backward-weights must be one of"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), backward_weights="transposed")
    with pytest.raises(PactError, match="nvfp4-native's FP4"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), compute="nvfp4-native", backward_weights="forward")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_dgrad_fp8_only_the_input_gradients(tmp_path, kernels):
    """`--activations ...,dgrad=fp8`: the input-gradient GEMMs are the fp8 backend's (dY and the backward
    layout as E4M3 rows), nothing else: the forward, so the loss, is bf16-decode's to the bit, and the
    LoRA gradients stay close to bf16-decode's (E4M3 keeps 3 mantissa bits of dY and of W^T)."""
    from pact.runtime.ops import reference
    from pact.runtime.ops.triton import fp8 as triton_fp8

    art = _artifact(tmp_path, "llama")
    ids, labels = _batch(b=2, s=24)
    out = []
    for spec in ("mixed", "mixed,dgrad=fp8"):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), kernels=kernels, activations=spec)
        assert model.compute == "bf16-decode"
        fp8_gemm = reference.nvfp4_gemm_fp8 if kernels == "torch" else triton_fp8.nvfp4_gemm_fp8
        assert (model.ops.dgrad_gemm is fp8_gemm) == spec.endswith("fp8")
        assert model.ops.nvfp4_gemm is not fp8_gemm
        _random_adapters(model)
        loss, n = model(ids, labels)
        (loss / n).backward()
        out.append((loss.item(), {k: p.grad.clone() for k, p in model.lora_params.items()}))
    assert out[0][0] == out[1][0]
    cos = sorted(F.cosine_similarity(out[0][1][k].flatten(), out[1][1][k].flatten(), dim=0).item() for k in out[0][1])
    # the top layer's adapters see no input gradient from above the loss: the same to the bit; below it, close
    assert cos[0] >= 0.995 and cos[-1] > 0.9999 and cos[len(cos) // 2] < 1, cos
    with pytest.raises(PactError, match="dgrad=fp8 re-encodes the backward layout.*use one of the two"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="mixed,dgrad=fp8", backward_weights="forward")
    with pytest.raises(PactError, match="dgrad=fp8 with --compute fp8"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="mixed,dgrad=fp8", compute="fp8")


def test_dgrad_fp8_needs_fp8_tensor_cores(tmp_path, monkeypatch):
    """Refused for training on a GPU without FP8 tensor cores; a forward-only model (pact-eval, generate, the
    merge on a run trained with dgrad=fp8) runs no input-gradient GEMM and takes the recorded recipe as it is."""
    from pact.runtime.ops import build

    monkeypatch.setattr(build, "_capability", lambda device: (8, 0))
    with pytest.raises(PactError, match=r"dgrad=fp8 needs FP8 tensor cores .* sm_80: drop dgrad=fp8"):
        build.check_dgrad("fp8", torch.device("cuda"))
    build.check_dgrad("auto", torch.device("cuda"))
    art = _artifact(tmp_path, "llama")
    with pytest.raises(PactError, match="sm_80: drop dgrad=fp8"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="mixed,dgrad=fp8")
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="mixed,dgrad=fp8", backward=False)
    assert model.recipe.dgrad == "auto" and model.ops.name == "torch/bf16-decode"
    monkeypatch.setattr(build, "_capability", lambda device: (9, 0))
    build.check_dgrad("fp8", torch.device("cuda"))
    monkeypatch.setattr(build, "_capability", lambda device: None)  # (the CPU) forward only beside --compute fp8 too
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="mixed,dgrad=fp8", compute="fp8", backward=False)
    assert model.recipe.dgrad == "auto" and model.ops.name == "torch/fp8"
    trains = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="mixed,dgrad=fp8")
    assert trains.ops.name == "torch/bf16-decode/dgrad-fp8"


def test_mistral_sliding_window_as_transformers(tmp_path):
    """A Mistral whose sliding window (16) is shorter than the sequence (48): the loss and LoRA
    gradients are transformers' (which masks the same band); without the window they are not."""
    make_model(tmp_path / "src", "mistral", sliding_window=16)
    art = open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False, scaling="2d",
                                block_scales="amax"))
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="bf16")
    assert [L.window for L in model.layers] == [16, 16]
    ours, ref, cos = _against_hf(art, tmp_path / "src", model)
    assert ours == pytest.approx(ref, rel=2e-3) and min(cos.values()) >= 0.999
    for L in model.layers:  # the same weights attending to everything: another loss (the test can see the band)
        L.window = None
    with torch.no_grad():
        full, n = model(*_batch())
    assert abs((full / n).item() - ref) > 10 * abs(ours - ref)


@pytest.mark.parametrize("family,compute", [("llama", "bf16-decode"), ("qwen2", "bf16-decode"), ("llama", "fp8")])
def test_nvfp4_activations_gradients(tmp_path, family, compute):
    """The full PACT path (NVFP4 weights *and* NVFP4 activations) against the bf16 reference.

    Measured on this tiny random model (4 x 48 tokens): loss within 0.2%, adapter-gradient
    cosine median ~0.98, worst ~0.96. Every gap is NVFP4 activation error (~20 dB SQNR per
    quantized tensor): the same comparison with bf16 activations gives >= 0.999 (test above).
    The issue's target (>= 0.99 for every tensor) is not met; see the closing note.
    The `fp8` backend (E4M3 operands, its CPU twin here) stays within the same bounds.
    """
    ours, ref, cos = _compare(tmp_path, family, "nvfp4", compute)
    assert ours == pytest.approx(ref, rel=5e-3)
    values = sorted(cos.values())
    assert values[len(values) // 2] >= 0.97
    assert values[0] >= 0.93


@pytest.mark.parametrize("recipe", [None, "mixed,*.saved=fp8"])  # the default; every saved copy E4M3 rows
def test_triton_kernels_match_torch_ops(tmp_path, recipe):
    """The same model step with the Triton kernels (interpreter) and with the torch twins."""
    art = _artifact(tmp_path, "llama")
    ids, labels = _batch(b=2, s=24)
    results = []
    for kernels in ("torch", "triton"):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), kernels=kernels, activations=recipe)
        _random_adapters(model)
        loss, n = model(ids, labels)
        (loss / n).backward()
        results.append((loss.item() / n, {k: p.grad.clone() for k, p in model.lora_params.items()}))
    (l_t, g_t), (l_k, g_k) = results
    assert l_k == pytest.approx(l_t, rel=1e-3)  # rmsnorm/silu reductions in another order flip rare codes
    for k in g_t:
        assert F.cosine_similarity(g_t[k].flatten(), g_k[k].flatten(), dim=0) >= 0.995, k


def test_logits_match_transformers_without_adapters(tmp_path):
    art = _artifact(tmp_path, "qwen3")
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="bf16")
    ids, _ = _batch(b=2, s=16)
    pm, _ = _hf_peft(art, tmp_path / "src", model)  # B = 0: the adapters add nothing
    with torch.no_grad():
        ref = pm(input_ids=ids).logits.float()
    ours = model.logits(ids)
    cos = F.cosine_similarity(ours.flatten(), ref.flatten(), dim=0)
    assert cos >= 0.9999 and (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("recipe", [None, "nvfp4-saved", "bf16,*.saved=fp8", "nvfp4-saved,down.saved=bf16"])
def test_saved_activation_bytes_per_token(tmp_path, recipe):
    """What the layer Functions keep for backward, counted through autograd's saved-tensor hooks."""
    art = _artifact(tmp_path, "llama")
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations=recipe)
    ids, labels = _batch(b=2, s=32)
    T = ids.numel()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    layer = model.layers[0]
    x = torch.randn(T, model.hidden, dtype=torch.bfloat16)
    from pact.runtime.functions import MlpFn, NormProjectionFn, ProjectionFn

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r = model.recipe
        NormProjectionFn.apply(x, layer.attn_norm, model.eps, layer.qkv, model.ops, r.qkv, *layer.qkv.lora_params())
        ProjectionFn.apply(x, layer.o, model.ops, r.o, *layer.o.lora_params())
        MlpFn.apply(x, layer.mlp_norm, model.eps, layer.gate_up, layer.down, model.ops, (r.gate_up, r.down), "silu",
                    *layer.gate_up.lora_params(), *layer.down.lora_params())
    measured = sum(t.numel() * t.element_size() for t in saved)
    H, A, N = model.hidden, model.n_heads * model.head_dim, model.cfg.intermediate_size  # N: the MLP's width
    formula = saved_bytes_per_token(H, A, N, {t: R for t in ALL_TARGETS}, recipe)
    assert measured == formula * T
    # vs bf16 activations as PEFT keeps them (x, norm outs, o input, gate, up, h): at least 2.5x less
    # by default (3x with every copy NVFP4)
    bf16_saved = 2 * (2 * H + A + 3 * N) + 2 * R * 7
    assert bf16_saved >= {None: 2.5, "nvfp4-saved": 3}.get(recipe, 1) * formula


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("seq,path", [(48, "fused"), (128, "cublas"), (128, "fp8")])
@pytest.mark.parametrize("recipe", ["nvfp4-saved", "nvfp4", "nvfp4-saved,*.saved=fp8", "mixed,dgrad=fp8"])
def test_gpu_triton_matches_torch_twins(tmp_path, family, seq, path, recipe):
    """The whole model on the GPU: Triton kernels against the torch twins (same GPU, same SDPA).

    4 x 48 tokens stay under CUBLAS_MIN_ROWS: every GEMM is the register-decoding kernel, the
    exact NVFP4 product, so only rare code flips (rmsnorm/silu reduction order) separate the
    two. 4 x 128 tokens take the cuBLAS path, whose forward multiplies the bf16-rounded
    dequantized input (2^-9 relative): those roundings also move activations across NVFP4
    midpoints in the next layer, so the bound is on the median and the worst tensor is looser.
    GPU against CPU is not compared for the same reason (SDPA and matmuls round differently).
    `fp8`: identical E4M3 operands on both sides (tested bit-exact), cuBLAS FP8 vs an fp32
    product of them: summation order and the bf16 output rounding only, bounded as cuBLAS.
    """
    if path == "fp8" and "dgrad=fp8" in recipe:
        pytest.skip("dgrad=fp8 beside --compute fp8 is refused (test_dgrad_fp8_only_the_input_gradients)")
    art = _artifact(tmp_path, family)
    ids, labels = _batch(b=4, s=seq)
    out = []
    for kernels in ("torch", "triton"):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), device="cuda", kernels=kernels,
                          compute="fp8" if path == "fp8" else "bf16-decode", activations=recipe)
        _random_adapters(model)
        loss, n = model(ids.cuda(), labels.cuda())
        (loss / n).backward()
        out.append((loss.item() / n, {k: p.grad.cpu() for k, p in model.lora_params.items()}))
    (l_t, g_t), (l_k, g_k) = out
    assert l_k == pytest.approx(l_t, rel=2e-3)
    cos = sorted(F.cosine_similarity(g_t[k].flatten(), g_k[k].flatten(), dim=0).item() for k in g_t)
    if path == "fused":
        assert cos[0] >= 0.99, cos[:3]
    else:
        assert cos[len(cos) // 2] >= 0.99 and cos[0] >= 0.95, (cos[:3], cos[len(cos) // 2])


def test_checkpointing_gives_the_same_gradients(tmp_path):
    art = _artifact(tmp_path, "llama")
    ids, labels = _batch(b=2, s=24)
    grads = []
    for checkpoint in (False, True):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA, dropout=0.1), checkpoint=checkpoint)
        _random_adapters(model)
        torch.manual_seed(3)  # dropout seeds drawn in forward: recomputation must draw the same
        loss, n = model(ids, labels)
        (loss / n).backward()
        grads.append({k: p.grad.clone() for k, p in model.lora_params.items()})
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_lora_dropout_only_while_training(tmp_path):
    """An adapter with dropout (a trained one's adapter_config.json may say 0.3): scoring and generation (no grad)
    give the same logits every call, those of the same adapter without dropout; a training step draws masks (its
    loss differs from the no-dropout one), and its backward follows the forward it had."""
    art = _artifact(tmp_path, "llama")
    ids, labels = _batch(b=2, s=24)
    models = {}
    for p in (0.0, 0.3):
        models[p] = PactModel(art, LoraConfig(r=R, alpha=ALPHA, dropout=p))
        _random_adapters(models[p])
    ref = models[0.0].logits(ids)
    for _ in range(2):
        assert torch.equal(models[0.3].logits(ids), ref)
        with torch.no_grad():
            assert models[0.3](ids, labels)[0].item() == models[0.0](ids, labels)[0].item()
    torch.manual_seed(0)
    loss, n = models[0.3](ids, labels)
    assert loss.item() != models[0.0](ids, labels)[0].item()
    (loss / n).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in models[0.3].lora_params.values())


@pytest.mark.parametrize("compute", ["nvfp4-native", "fp8"])
def test_compute_twins_train(tmp_path, compute):
    """Each `--compute` backend's torch twin (what it runs on the CPU) against bf16-decode.
    nvfp4-native: same forward (the exact NVFP4 product), dY quantized to NVFP4 in backward.
    fp8: both operands re-encoded as E4M3 rows, forward and backward. Its small forward change
    moves values across NVFP4 rounding midpoints downstream (the saved gate/up, the next
    layer's norm output), so against bf16-decode it differs by about NVFP4's own error; against
    the bf16 reference it is as close as bf16-decode (test_nvfp4_activations_gradients).
    Under the 'nvfp4' recipe, where every backend's GEMMs read the same NVFP4 inputs."""
    art = _artifact(tmp_path, "llama")
    ids, labels = _batch(b=2, s=24)
    out = []
    for name in ("bf16-decode", compute):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), compute=name, activations="nvfp4")
        assert model.compute == name
        _random_adapters(model)
        loss, n = model(ids, labels)
        (loss / n).backward()
        out.append((loss.item(), {k: p.grad.clone() for k, p in model.lora_params.items()}))
    cos = sorted(F.cosine_similarity(out[0][1][k].flatten(), out[1][1][k].flatten(), dim=0).item() for k in out[0][1])
    if compute == "nvfp4-native":
        assert out[0][0] == out[1][0]
        assert cos[len(cos) // 2] >= 0.95  # only the backward differs: dY quantized to NVFP4 (~20 dB)
    else:
        assert out[1][0] == pytest.approx(out[0][0], rel=2e-3)
        assert cos[len(cos) // 2] >= 0.97 and cos[0] >= 0.93, cos


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_resident_fp8_weights_change_nothing(tmp_path, kernels):
    """`--fp8-weights resident` multiplies the E4M3 copies made once at binding: the same bytes
    the fp8 backend re-encodes per call, so loss and gradients are bit-identical; other
    backends refuse the flag."""
    from pact.runtime.ops import NVFP4TensorFP8

    art = _artifact(tmp_path, "llama")
    ids, labels = _batch(b=1, s=16)
    out = []
    for fp8_weights in ("per-call", "resident"):
        model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), kernels=kernels, compute="fp8", fp8_weights=fp8_weights)
        resident = isinstance(model.layers[0].qkv.weight, NVFP4TensorFP8)
        assert resident == (fp8_weights == "resident") and resident == isinstance(model.layers[0].down.weight_t,
                                                                                  NVFP4TensorFP8)
        _random_adapters(model)
        loss, n = model(ids, labels)
        (loss / n).backward()
        out.append((loss.item(), {k: p.grad.clone() for k, p in model.lora_params.items()}))
    assert out[0][0] == out[1][0]
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k
    with pytest.raises(PactError, match="--fp8-weights resident .* add --compute fp8"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), compute="bf16-decode", fp8_weights="resident")
    with pytest.raises(PactError, match="--fp8-weights must be one of"):
        PactModel(art, LoraConfig(r=R, alpha=ALPHA), compute="fp8", fp8_weights="always")


def _recipe_grads(art, ids, labels, spec, compute="bf16-decode"):
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations=spec, compute=compute)
    _random_adapters(model)
    loss, n = model(ids, labels)
    (loss / n).backward()
    return {k: p.grad.flatten() for k, p in model.lora_params.items()}


@pytest.mark.parametrize("compute", ["bf16-decode", "fp8"])
def test_default_recipe_keeps_the_lora_gradient(tmp_path, compute):
    """The learning-fidelity regression check, as a gradient diagnostic: against the bf16-activation
    reference on the same NVFP4 weights (heavy-tailed, outlier channels), the default recipe's LoRA
    gradient keeps its direction and size better than the all-NVFP4 data flow, whose quantized
    GEMM inputs shrink and bend it (SmolLM2: cosine 0.72, norm 0.69; BENCHMARKS.md)."""
    make_model(tmp_path / "src", "llama", num_hidden_layers=4)
    make_realistic(tmp_path / "src")
    art = open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False, scaling="2d",
                                block_scales="amax"))
    ids, labels = _batch(b=4, s=48)
    ref = _recipe_grads(art, ids, labels, "bf16")

    def fidelity(spec):
        got = _recipe_grads(art, ids, labels, spec, compute)
        cos = torch.tensor([F.cosine_similarity(got[k], ref[k], dim=0) for k in ref])
        norm = torch.tensor([got[k].norm() / ref[k].norm() for k in ref])
        return cos.median().item(), norm.median().item()

    (c_new, n_new), (c_old, n_old) = fidelity(parse_recipe(None)), fidelity("nvfp4")
    assert c_new >= 0.97 and abs(1 - n_new) <= 0.06, (c_new, n_new)
    assert c_new > c_old and abs(1 - n_new) < abs(1 - n_old), ((c_new, n_new), (c_old, n_old))


def test_no_saved_copies_without_backward(tmp_path, monkeypatch):
    """Under torch.no_grad (scoring, generation) nothing is kept for backward, so no saved copy
    is encoded; the forward's numbers are the same as with autograd on."""
    from pact.runtime.ops import reference

    art = _artifact(tmp_path, "llama")
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), kernels="torch")
    _random_adapters(model)
    ids, labels = _batch(b=2, s=24)
    calls = []
    for name in ("quantize_rows", "fp8_rows"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k))[1])
    loss, n = model(ids, labels)
    assert calls  # training keeps NVFP4 and E4M3 copies
    calls.clear()
    with torch.no_grad():
        loss2, _ = model(ids, labels)
    assert calls == [] and torch.equal(loss.detach(), loss2)


def test_gemma3_every_difference_is_needed(tmp_path):
    """Gemma 3 as transformers runs it (test_same_math_as_transformers), and each of what its spec
    adds moves the loss well past that agreement: the local layer's window, the attention scale,
    the embedding scale, the (1 + w) norms, the output norms and GeGLU."""
    make_model(tmp_path / "src", "gemma3")
    art = open_artifact(convert(str(tmp_path / "src"), tmp_path / "art", progress=False, scaling="2d",
                                block_scales="amax"))
    model = PactModel(art, LoraConfig(r=R, alpha=ALPHA), activations="bf16")
    assert [L.window for L in model.layers] == [16, None] and [L.rope for L in model.layers] == [1, 0]
    ours, ref, cos = _against_hf(art, tmp_path / "src", model)
    assert ours == pytest.approx(ref, rel=2e-3) and min(cos.values()) >= 0.999

    def loss():
        with torch.no_grad():
            total, n = model(*_batch())
        return (total / n).item()

    L0 = model.layers[0]
    changes = {
        "window": lambda: setattr(L0, "window", None),
        "attention scale": lambda: setattr(model, "attn_scale", None),
        "embedding scale": lambda: setattr(model, "embed_scale", None),
        "output norm": lambda: setattr(L0, "post_mlp_norm", None),
        "GeGLU": lambda: setattr(model, "spec", dataclasses.replace(model.spec, act="silu")),
        "(1 + w)": lambda: setattr(L0, "attn_norm", L0.attn_norm - 1),
    }
    for what, change in changes.items():
        kept = (L0.window, model.attn_scale, model.embed_scale, L0.post_mlp_norm, model.spec, L0.attn_norm)
        change()
        # past 10x the agreement with transformers (measured: 21x for the attention scale to 198x for
        # (1 + w)); SiLU for GeGLU moves this tiny random model's loss 8.8x (small gate pre-activations,
        # where the two functions nearly agree), so that one must pass 5x
        margin = 5 if what == "GeGLU" else 10
        assert abs(loss() - ref) > margin * abs(ours - ref), what
        L0.window, model.attn_scale, model.embed_scale, L0.post_mlp_norm, model.spec, L0.attn_norm = kept


def test_cpu_bf16_products_are_fp32_products_rounded_once():
    """runtime/matmul.py: on the CPU a bf16 product is the fp32 product of the same operands rounded once
    (what a GPU's bf16 GEMM computes), also in place into a column slice (a LoRA member's share of y)."""
    from pact.runtime.matmul import addmm_, mm

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).to(torch.bfloat16) for s in ((33, 48), (48, 20)))
    assert mm(a, b).dtype == torch.bfloat16
    assert torch.equal(mm(a, b), (a.float() @ b.float()).to(torch.bfloat16))
    y = torch.randn(33, 50, generator=g).to(torch.bfloat16)
    want = torch.addmm(y[:, 10:30].float(), a.float(), b.float(), alpha=0.5).to(torch.bfloat16)
    rest = y[:, 30:].clone()
    out = addmm_(y[:, 10:30], a, b, alpha=0.5)
    assert torch.equal(y[:, 10:30], want) and torch.equal(y[:, 30:], rest) and out.data_ptr() == y[:, 10:30].data_ptr()
    f32 = torch.randn(4, 48, generator=g)  # other dtypes: the plain product
    assert torch.equal(mm(f32, b.float()), f32 @ b.float())
