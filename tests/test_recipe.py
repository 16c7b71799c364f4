"""The precision recipe (`--activations`): presets, overrides, canonical specs and bad input."""

import pytest

from pact.formats import PactError
from pact.runtime.recipe import DEFAULT, PRESETS, SITES, parse_recipe


def test_presets_and_overrides_round_trip():
    # the default: `mixed` with the attention output's saved copy E4M3 as well
    assert parse_recipe(None) == parse_recipe(DEFAULT) == parse_recipe("nvfp4-saved,gate_up.saved=fp8,o.saved=fp8")
    assert parse_recipe(None).spec() == DEFAULT == "mixed,o.saved=fp8"
    r = parse_recipe("nvfp4,qkv.saved=bf16,*.lora=bf16,dgrad=bf16")
    assert r.qkv.saved == "bf16" and all(r.site(s).lora == "bf16" for s in SITES) and r.dgrad == "bf16"
    assert r.o.gemm == "nvfp4" and r.o.saved == "nvfp4"
    assert parse_recipe(r.spec()) == r  # the recorded spec rebuilds the recipe
    assert parse_recipe("bf16,*.saved=nvfp4").spec() == "nvfp4-saved"  # canonical: the preset's name
    # the default: NVFP4 copies saved, the MLP's RMSNorm output as E4M3 rows
    assert parse_recipe("nvfp4-saved,gate_up.saved=fp8").spec() == "mixed"
    r = parse_recipe("mixed,dgrad=fp8")
    assert r.dgrad == "fp8" and r.gate_up == PRESETS["mixed"].gate_up and r.spec() == "mixed,dgrad=fp8"
    r = parse_recipe("mixed,*.saved=nvfp4-sr,o.saved=bf16")
    assert r.qkv.saved == "nvfp4-sr" and r.o.saved == "bf16" and parse_recipe(r.spec()) == r


@pytest.mark.parametrize("spec,match", [
    ("fp4", "not a preset"),
    ("nvfp4,qkv.gemm", "not SITE.FIELD=VALUE"),
    ("nvfp4,attn.gemm=bf16", "not SITE.FIELD=VALUE"),
    ("nvfp4,qkv.input=bf16", "not SITE.FIELD=VALUE"),
    ("nvfp4,qkv.gemm=fp8", "not SITE.FIELD=VALUE"),  # E4M3 / stochastic rounding: saved copies only
    ("nvfp4,o.lora=nvfp4-sr", "not SITE.FIELD=VALUE"),
    ("nvfp4,o.saved=fp4", "not SITE.FIELD=VALUE"),
    ("nvfp4,dgrad=e5m2", "dgrad must be one of auto, bf16, fp8"),
])
def test_bad_specs_one_clear_error(spec, match):
    with pytest.raises(PactError, match=match) as e:
        parse_recipe(spec)
    assert "--activations" in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_a_bad_recipe(tmp_path):
    from click.testing import CliRunner

    from pact.pipelines.train import main

    r = CliRunner().invoke(main, [str(tmp_path), "--data", "x.jsonl", "--out", str(tmp_path / "run"),
                                  "--activations", "nvfp4,qkv.gemm=fp8"])
    assert r.exit_code == 1 and "Error: --activations" in r.output and "Traceback" not in r.output
