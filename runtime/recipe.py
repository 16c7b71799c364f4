"""The precision recipe: per quantization site, what the frozen GEMM reads, what the LoRA branch
reads and what is saved for backward, and the backend the frozen GEMMs run on. Built once from
`--activations` and `--compute`, handed to `runtime.ops.get_ops`, and recorded in the run folder.

Sites (one decoder layer):
    qkv      RMSNorm output -> q|k|v       (saved: for dA of q,k,v and the RMSNorm backward)
    o        attention output -> o_proj    (saved: for dA of o)
    gate_up  RMSNorm output -> gate|up     (saved: for dA of gate, up and the RMSNorm backward)
    down     silu(gate) * up -> down_proj  (saved: gate and up, for the SiLU-mul backward and the
                                            h that dA of down reads)

Per site, each of ``gemm``, ``lora`` and ``saved`` is "nvfp4" (one NVFP4 copy of the rows) or "bf16"
(the unquantized values); ``saved`` may also be "fp8" (E4M3 rows, one fp32 scale per row: K + 4
bytes a row) or "nvfp4-sr" (NVFP4 rows with stochastically rounded elements: unbiased). A frozen GEMM fed
bf16 rows computes with them as its backend does: the exact bf16 x NVFP4 product on `bf16-decode`, E4M3
rows encoded straight from the bf16 values on
`fp8` (no detour through E2M1), and NVFP4 rows made on the fly on `nvfp4-native`.

Beside the sites, ``dgrad`` says what the input-gradient GEMMs (dY @ W) read: "auto" (the compute
backend's own: E4M3 dY on `fp8`, NVFP4 dY on `nvfp4-native`, bf16 on `bf16-decode`), "bf16"
(dY unquantized, multiplied with the decoded NVFP4 weight: the bf16-decode GEMM on any backend) or
"fp8" (the `fp8` backend's GEMM for the input gradients only: dY and the backward layout re-encoded as
E4M3 rows; the forward GEMMs stay the compute backend's, so the model trained through is the artifact's).

`--activations` takes a preset name, optionally followed by overrides:
``nvfp4,qkv.saved=bf16,down.gemm=bf16,dgrad=bf16`` (``*.field=value`` sets a field on every site).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pact.formats import PactError

SITES = ("qkv", "o", "gate_up", "down")
FIELDS = ("gemm", "lora", "saved")
PRECISIONS = ("nvfp4", "bf16")  # gemm and lora
SAVED = ("nvfp4", "nvfp4-sr", "fp8", "bf16")  # saved
DGRAD = ("auto", "bf16", "fp8")


@dataclass(frozen=True)
class Site:
    gemm: str = "nvfp4"  # the frozen GEMM's input
    lora: str = "nvfp4"  # the LoRA branch's input in forward (xa = x @ A^T)
    saved: str = "nvfp4"  # kept for backward (dA, RMSNorm / SiLU-mul backward)

    @property
    def quantized(self) -> bool:
        """Every use reads the one NVFP4 copy (the fused quantizing kernels' path)."""
        return self.gemm == self.lora == self.saved == "nvfp4"

    @property
    def needs_nvfp4(self) -> bool:
        """Some use reads the site's round-to-nearest NVFP4 copy."""
        return "nvfp4" in (self.gemm, self.lora, self.saved)


@dataclass(frozen=True)
class Recipe:
    qkv: Site = Site()
    o: Site = Site()
    gate_up: Site = Site()
    down: Site = Site()
    dgrad: str = "auto"  # the input-gradient GEMMs: the backend's own, bf16 dY, or the fp8 backend's GEMM
    compute: str = "bf16-decode"  # the frozen GEMMs' backend (`--compute`, resolved for the device)

    def site(self, name: str) -> Site:
        return getattr(self, name)

    def on(self, compute: str) -> "Recipe":
        """This recipe computed with backend ``compute`` (one of runtime/ops's COMPUTE)."""
        return dataclasses.replace(self, compute=compute)

    def spec(self) -> str:
        """The shortest `--activations` string that rebuilds this recipe's precisions (the backend
        is `--compute`'s)."""
        me = self.on(Recipe.compute)
        for name, preset in PRESETS.items():
            if preset == me:
                return name
        base = min(PRESETS, key=lambda n: len(_diff(PRESETS[n], me)))
        return ",".join([base, *_diff(PRESETS[base], me)])

    def forward_only(self) -> "Recipe":
        """This recipe for a forward no backward follows (scoring and generation under
        torch.no_grad): nothing is kept, so no site encodes a saved copy (its unquantized rows stand
        in, free); the GEMM and LoRA inputs, and so the outputs, are unchanged."""
        keep = {s: self.site(s) if self.site(s).quantized else dataclasses.replace(self.site(s), saved="bf16")
                for s in SITES}
        return dataclasses.replace(self, **keep)

    def as_json(self) -> dict:
        return {**{s: dataclasses.asdict(self.site(s)) for s in SITES}, "dgrad": self.dgrad, "compute": self.compute}


def _uniform(p: str) -> Recipe:
    return Recipe(*(Site(p, p, p) for _ in SITES))


PRESETS: dict[str, Recipe] = {
    # NVFP4 copies only where activations are stored for backward (the memory that buys the batch),
    # except the MLP's RMSNorm output, saved as E4M3 rows (K + 4 bytes a row): dA of gate and up reads
    # it, and its NVFP4 copy cost hard tasks points (BENCHMARKS.md, learning fidelity:
    # epistemic_reasoning -7.1 +- 2.5 against BF16 LoRA, 21 seeds); the frozen GEMMs and the LoRA
    # branch read the unquantized rows (E4M3 made straight from bf16 on the fp8 backend).
    "mixed": Recipe(*(Site("bf16", "bf16", "fp8" if s == "gate_up" else "nvfp4") for s in SITES)),
    # every saved copy NVFP4: the least memory.
    # Quantized GEMM inputs bend the LoRA gradient (cosine ~0.72 to the bf16 reference, norm ~0.69);
    # saved copies barely move the gradient's cosine, yet cost hard tasks accuracy.
    "nvfp4-saved": Recipe(*(Site("bf16", "bf16", "nvfp4") for _ in SITES)),
    # PACT's all-NVFP4 data flow: one NVFP4 copy per site, read by the GEMM, the LoRA branch
    # and backward (the Blackwell FP4 GEMMs' natural input).
    "nvfp4": _uniform("nvfp4"),
    # no activation quantization at all (weights stay NVFP4): the reference the others are measured on
    "bf16": _uniform("bf16"),
}


def _diff(a: Recipe, b: Recipe) -> list[str]:
    return [f"{s}.{f}={getattr(b.site(s), f)}" for s in SITES for f in FIELDS
            if getattr(a.site(s), f) != getattr(b.site(s), f)] + ([f"dgrad={b.dgrad}"] if a.dgrad != b.dgrad else [])


def parse_recipe(spec: str | Recipe | None, flag: str = "--activations") -> Recipe:
    """A recipe from ``preset[,site.field=value...]`` (None: the default preset)."""
    if isinstance(spec, Recipe):
        return spec
    spec = spec or DEFAULT
    head, *overrides = [p.strip() for p in spec.split(",") if p.strip()]
    if head not in PRESETS:
        raise PactError(f"{flag} {spec!r}: starts with {head!r}, not a preset ({', '.join(PRESETS)})")
    sites = {s: PRESETS[head].site(s) for s in SITES}
    dgrad = PRESETS[head].dgrad
    for item in overrides:
        key, eq, value = item.partition("=")
        if key == "dgrad":
            if value not in DGRAD:
                raise PactError(f"{flag} {spec!r}: dgrad must be one of {', '.join(DGRAD)}, got {value!r}")
            dgrad = value
            continue
        site, dot, fld = key.partition(".")
        if (not eq or not dot or (site != "*" and site not in SITES) or fld not in FIELDS
                or value not in (SAVED if fld == "saved" else PRECISIONS)):
            raise PactError(f"{flag} {spec!r}: {item!r} is not SITE.FIELD=VALUE with SITE in *, {', '.join(SITES)}; "
                            f"FIELD in {', '.join(FIELDS)}; VALUE in {', '.join(PRECISIONS)} (saved also "
                            f"{', '.join(v for v in SAVED if v not in PRECISIONS)}); or dgrad=auto|bf16|fp8")
        for s in SITES if site == "*" else (site,):
            sites[s] = dataclasses.replace(sites[s], **{fld: value})
    return Recipe(**sites, dgrad=dgrad)


# the default: `mixed` with the attention output saved as E4M3 rows too (dA of o_proj reads it; with
# its NVFP4 copy arithmetic at lr 1e-3 ended 6.4 +- 2.7 points lower, 13 paired seeds, for +0.22 GiB
# at 1B bs 16: BENCHMARKS.md, learning fidelity)
DEFAULT = "mixed,o.saved=fp8"
HELP = (
    "Precision recipe of the activations (weights stay NVFP4): a preset, 'mixed' (NVFP4 copies saved for "
    "backward, E4M3 for the MLP's RMSNorm output; GEMMs and LoRA read unquantized rows), 'nvfp4-saved' "
    "(every saved copy NVFP4: least memory), 'nvfp4' (every use reads the NVFP4 copy) or 'bf16' (nothing "
    "quantized: the reference), optionally followed by SITE.FIELD=VALUE overrides, e.g. "
    "'nvfp4,down.saved=bf16' (SITE: qkv, o, gate_up, down or *; FIELD: gemm, lora, saved; VALUE: nvfp4, bf16, "
    "and for saved also fp8 or nvfp4-sr); 'dgrad=bf16' runs the input-gradient GEMMs on unquantized dY, "
    "'dgrad=fp8' runs them alone on FP8 tensor cores (sm_89 or newer; not with --compute fp8 or "
    "--backward-weights forward). "
    "'auto' or 'auto:F': a probe at the start of training picks each site's saved copy (NVFP4, E4M3 or bf16) "
    "from the LoRA gradient's error, within F times the default's saved-copy memory (F = 1). "
    f"Default: '{DEFAULT}' (the attention output's copy E4M3 too). See README, Train, 'Precision recipe'."
)
