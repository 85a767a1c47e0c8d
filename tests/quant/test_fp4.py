"""FP4 weights and activations, NVFP4 and MXFP4: quant/fp4.py against compressed-tensors' own
compressors and fake quantization, the Linear against dequantize-then-matmul, and `quantize
--scheme nvfp4a16 | nvfp4 | mxfp4a16 | mxfp4` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quant import fp4
from quant.schemes import QuantScheme, preset
from tests.helpers import ON_CUDA, make_tiny_model_dir

ct_quant = pytest.importorskip("compressed_tensors.quantization")


def _weight() -> torch.Tensor:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, :32] = 0  # an all-zero group: CT stores FP8's 0.125 (NVFP4), or a power of two (MXFP4)
    w[5, 5] = -1e-9  # a negative weight that rounds to zero: CT packs it as -0
    w[7, 20] = 0.9  # a tensor absmax far above the rest
    w[9] *= torch.logspace(-30, 3, 128)  # MXFP4 group scales across most of E8M0's range
    return w


def _ct_scheme(name: str):
    from compressed_tensors.quantization import quant_scheme

    return getattr(quant_scheme, name.upper())


def _scaling(name: str, w: torch.Tensor) -> fp4.Scaling:
    return fp4.SCALINGS[preset(name).weights.fp4_kind].of(w)


def test_nvfp4_scales_and_packed_codes_are_compressed_tensors_own():
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = _weight()[10:]  # (row 9's range is beyond NVFP4's one global scale)
    scaling = fp4.Nvfp4.of(w)
    global_ = scaling.global_scale
    assert torch.equal(global_, generate_gparam(w.min(), w.max()).reshape(1).float())
    scales = scaling.group_scales(w)
    groups = w.reshape(len(w), 8, 16)
    args = _ct_scheme("nvfp4a16")["weights"]
    ct_scales, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_)
    assert torch.equal(scales.float(), ct_scales.float().reshape(len(w), 8))
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], **_ct_scheme("nvfp4a16"))
    compressed = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scales.float(), "weight_global_scale": global_}, scheme)
    packed = fp4.pack(fp4.quantize(w, scaling, scales))
    assert torch.equal(packed, compressed["weight_packed"])
    assert torch.equal(fp4.unpack(packed), fp4.quantize(w, scaling, scales))
    ours = fp4.dequantize(packed, scaling, scales)
    theirs = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_}, scheme)["weight"]
    torch.testing.assert_close(ours.to(theirs.dtype), theirs, rtol=2**-7, atol=0)  # CT decompresses in bf16
    assert (ours - w).abs().max() <= (scaling.effective(scales).max() * 1.0)  # half of E2M1's widest step


def test_mxfp4_scales_and_packed_codes_are_compressed_tensors_own():
    """E8M0 group exponents as CT's observer computes and stores them (rounded to a power of two
    from a mantissa of 1.75, minus E2M1's 2), codes as its MXFP4 compressor packs them, and the
    weights its decompressor gives back, exactly (E2M1 values times powers of two fit bf16)."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = _weight()
    scaling = fp4.Mxfp4()
    exponents = scaling.group_scales(w)
    groups = w.reshape(48, 4, 32)
    ct_scales, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), _ct_scheme("mxfp4a16")["weights"])
    ct_scales = ct_scales.reshape(48, 4)
    assert exponents.dtype == torch.uint8 and exponents[9].min() < 50 and exponents[9].max() > 127
    assert torch.equal(exponents, compress_mx_scale(ct_scales, torch.uint8))
    assert torch.equal(scaling.effective(exponents), ct_scales)
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], **_ct_scheme("mxfp4a16"))
    compressed = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": ct_scales}, scheme)
    packed = fp4.pack(fp4.quantize(w, scaling, exponents))
    assert torch.equal(packed, compressed["weight_packed"]) and torch.equal(exponents, compressed["weight_scale"])
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": exponents}, scheme)["weight"]
    ours = fp4.dequantize(packed, scaling, exponents)
    assert torch.equal(ours.to(theirs.dtype), theirs) and torch.equal(ours.to(theirs.dtype).float(), ours)
    # a group's largest value lands at 3.5 to 7 scales: rounding (or clamping to 6) moves any weight by at most one
    assert ((ours - w).abs() <= scaling.effective(exponents).repeat_interleave(32, 1) * 1.0).all()


def test_rounding_is_nearest_e2m1_with_ties_to_even():
    scaling = fp4.Nvfp4(torch.ones(1))
    scales = torch.full((1, 1), 1.0, dtype=torch.float32).to(torch.float8_e4m3fn)
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -1.74, 0.74, 5.01, -6.5, 0.0, 2.49, 3.51]])
    values = fp4.values(fp4.quantize(x, scaling, scales))
    assert values.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -1.5, 0.5, 6.0, -6.0, 0.0, 2.0, 4.0]]


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_the_linear_equals_dequantize_then_matmul(scheme):
    """Fused shards (NVFP4: each with its own global scale, as other writers may leave them) each
    dequantize exactly as fp4.dequantize; the int8 panel kernel's products equal
    dequantize-then-matmul."""
    from quant.linear import make_quantized_linear

    shards = [_weight()[10:42], _weight()[16:48] * 3]
    linear = make_quantized_linear(preset(scheme), 128, [32, 32], bias=False, dtype=torch.float32)
    expected = []
    for i, w in enumerate(shards):
        scaling = _scaling(scheme, w)
        scales = scaling.group_scales(w)
        packed = fp4.pack(fp4.quantize(w, scaling, scales))
        extra = {"weight_global_scale": scaling.global_scale} if scheme == "nvfp4a16" else {}
        linear.load_shard(i, {"weight_packed": packed, "weight_scale": scales, **extra})
        expected.append(fp4.dequantize(packed, scaling, scales))
    linear.finalize()
    weight = torch.cat(expected)
    assert torch.equal(linear.dequantized_weight(), weight)  # bit for bit
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(linear(x), x @ weight.T, atol=1e-5, rtol=1e-5)
    assert linear.kernel in ("int8panel", "dense")
    bad = make_quantized_linear(preset(scheme), 128, [32], bias=False, dtype=torch.float32)
    if scheme == "nvfp4a16":
        with pytest.raises(ValueError, match="'weight_global_scale': must be finite and positive"):
            bad.load_shard(0, {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": torch.zeros(1)})
    else:
        with pytest.raises(ValueError, match="'weight_scale'.*uint8"):
            bad.load_shard(0, {"weight_packed": packed, "weight_scale": scales.float()})


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_activations_are_rounded_as_compressed_tensors_does(scheme):
    """FP4 activations (W4A4): each token's groups scaled at run time (NVFP4: under the global
    scale), bit for bit CT's own fake quantization with dynamic scales."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize

    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)) * 3
    x[2, :32] = 0
    x[4] *= torch.logspace(-8, 4, 64)
    scaling = _scaling(scheme, x)
    global_ = scaling.global_scale if scheme == "nvfp4" else None
    args = _ct_scheme(scheme)["input_activations"]
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module(), global_scale=global_)
    expected = fake_quantize(x=x, scale=scale, zero_point=zero_point, args=args, global_scale=global_)
    assert torch.equal(fp4.fake_quantize(x, scaling), expected)


def _w4a4_shard(scheme: str, w: torch.Tensor, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    scaling = _scaling(scheme, w)
    scales = scaling.group_scales(w)
    shard = {"weight_packed": fp4.pack(fp4.quantize(w, scaling, scales)), "weight_scale": scales}
    if scheme == "nvfp4":
        shard |= {"weight_global_scale": scaling.global_scale, "input_global_scale": inputs}
    return shard


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_the_w4a4_linear_rounds_its_inputs_first(device, scheme):
    from quant.linear import make_quantized_linear

    inputs = torch.tensor([448.0 * 6 / 4.0])
    shard = _w4a4_shard(scheme, _weight()[10:42], inputs)
    with torch.device(device):  # a Linear's kernel is chosen for the device it is built on
        linear = make_quantized_linear(preset(scheme), 128, [32], bias=False, dtype=torch.float32)
    linear.load_shard(0, shard)
    linear.finalize()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    rounded = fp4.fake_quantize(x, fp4.Nvfp4(inputs) if scheme == "nvfp4" else fp4.Mxfp4())
    expected = rounded @ linear.dequantized_weight().cpu().T
    torch.testing.assert_close(linear(x.to(device)).cpu(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(linear(x.to(device)).cpu(), x @ linear.dequantized_weight().cpu().T, atol=1e-3)
    if scheme == "nvfp4":
        fused = make_quantized_linear(preset("nvfp4"), 128, [32, 32], bias=False, dtype=torch.float32)
        fused.load_shard(0, shard)
        fused.load_shard(1, {**shard, "input_global_scale": inputs * 2})
        with pytest.raises(ValueError, match="different input_global_scale"):
            fused.finalize()


def _quantized(root, options: str):
    from calibration.cli import main
    from tests.calibration.factories import write_calib_file

    source = make_tiny_model_dir(root / "source")
    out = root / "quantized"
    assert main([str(source), "--calib", str(write_calib_file(root / "calib.jsonl", 12)), "-o", str(out),
                 "--scheme", *options.split(), "--num-samples", "8", "--num-heldout", "4"]) == 0
    return source, out


@pytest.fixture(scope="module", params=["nvfp4a16", "mxfp4a16"])
def fp4_checkpoint(request, tmp_path_factory):
    return request.param, *_quantized(tmp_path_factory.mktemp(request.param), request.param)


def _round_inputs_as_ct(scheme: str):
    """A forward pre-hook rounding a Linear's input by compressed-tensors' own fake quantization."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize

    args = _ct_scheme(scheme)["input_activations"]

    def round_input(module, inputs):
        x, global_ = inputs[0], getattr(module, "input_global_scale", None)
        scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=module, global_scale=global_)
        return (fake_quantize(x=x, scale=scale, zero_point=zp, args=args, global_scale=global_),)
    return round_input


def _reference(scheme, source, out):
    """HF's source model with the checkpoint's tensors and dequantized weights put in, and (W4A4)
    each quantized Linear's input rounded by compressed-tensors' own fake quantization."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(out / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for name, param in reference.named_parameters():  # norms AWQ smoothed, and the rest as written
            if name in tensors:
                param.copy_(tensors[name])
        for name, module in reference.named_modules():
            if f"{name}.weight_packed" not in tensors:
                continue
            if scheme.startswith("nvfp4"):
                scaling = fp4.Nvfp4(tensors[f"{name}.weight_global_scale"])
            else:
                scaling = fp4.Mxfp4()
            module.weight.copy_(fp4.dequantize(tensors[f"{name}.weight_packed"], scaling, tensors[f"{name}.weight_scale"]))
            if f"{name}.input_global_scale" in tensors:
                module.input_global_scale = tensors[f"{name}.input_global_scale"]
            if scheme in ("nvfp4", "mxfp4"):
                module.register_forward_pre_hook(_round_inputs_as_ct(scheme))
    return reference, tensors


@pytest.mark.parametrize("options", ["", " --algo gptq", " --algo awq", "w4a4"])
def test_quantize_writes_fp4_that_serves_as_compressed_tensors_computes_it(fp4_checkpoint, tmp_path, options):
    """The config is CT's NVFP4A16 / NVFP4 / MXFP4A16 / MXFP4; NVFP4's fused q/k/v and gate/up
    share one global scale (vLLM loads them so), and under W4A4 one input global scale; the
    engine's logits equal HF's model with the dequantized weights put in and, under W4A4, CT
    rounding each Linear's input (1e-4)."""
    from engine import LLM, SamplingParams
    from engine.loader import load_model

    a16, source, out = fp4_checkpoint
    scheme = a16.removesuffix("a16") if options == "w4a4" else a16
    if options:
        source, out = _quantized(tmp_path, scheme + options.removeprefix("w4a4"))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    kind = scheme.removesuffix("a16")
    assert config["format"] == f"{kind}-pack-quantized"
    group = config["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == ("tensor_group" if kind == "nvfp4" else "group")
    acts = (group["input_activations"] or {}).get("dynamic")
    assert acts == (None if scheme == a16 else "local" if kind == "nvfp4" else True)
    reference, tensors = _reference(scheme, source, out)
    if kind == "nvfp4":
        for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            for name in ("weight_global_scale", "input_global_scale")[:2 if scheme == "nvfp4" else 1]:
                shared = {tensors[f"model.layers.0.{'self_attn' if fused[0] == 'q_proj' else 'mlp'}.{proj}.{name}"]
                          .item() for proj in fused}
                assert len(shared) == 1, (fused, name)
    else:
        assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.uint8
        assert not any(name.endswith("global_scale") for name in tensors)
    ids = torch.randint(3, 380, (30,), generator=torch.Generator().manual_seed(9))
    model, _ = load_model(out, "float32")
    model.prepack_for_cpu()
    assert (model.fused_decode is None) == (scheme == kind)  # W4A4 inputs are rounded in torch
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(30)))
        torch.testing.assert_close(ours, reference(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)
    outs = LLM(str(out)).generate([ids.tolist()], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8


def test_hf_transformers_loads_the_checkpoint_and_answers_as_we_do(fp4_checkpoint):
    """compressed-tensors in HF transformers decompresses FP4 in bf16: its logits stay within
    bf16's reach of ours and its greedy tokens are ours."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.loader import load_model
    from tests.oracle import hf_greedy

    _, _, out = fp4_checkpoint
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = torch.randint(3, 380, (30,), generator=torch.Generator().manual_seed(9))
    model, _ = load_model(out, "float32")
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(30)))
        theirs = hf(ids.unsqueeze(0)).logits[0].float()
    assert (ours - theirs).abs().mean() < 0.02
    tokens, _ = hf_greedy(hf, ids.tolist(), 6)
    ours_tokens = LLM(str(out)).generate([ids.tolist()], SamplingParams(temperature=0.0, max_tokens=6,
                                                                        ignore_eos=True), use_tqdm=False)
    assert list(ours_tokens[0].outputs[0].token_ids) == tokens


def test_fp4_is_refused_where_it_cannot_run(tmp_path, capsys):
    from calibration.cli import main
    from quant.schemes import QuantArgs
    from tests.calibration.factories import write_calib_file

    source = make_tiny_model_dir(tmp_path / "source")
    calib = write_calib_file(tmp_path / "calib.jsonl", 8)
    assert main([str(source), "--calib", str(calib), "-o", str(tmp_path / "q"), "--scheme", "nvfp4a16",
                 "--smoothquant", "0.5"]) == 2
    assert "--smoothquant applies to w8a8-int8" in capsys.readouterr().err
    assert main([str(source), "--calib", str(calib), "-o", str(tmp_path / "q"), "--scheme", "mxfp4a16",
                 "--group-size", "64"]) == 2
    assert "--group-size applies to w4a16, w4a16-asym, w4a8; mxfp4a16 does not" in capsys.readouterr().err
    odd = make_tiny_model_dir(tmp_path / "odd", hidden_size=72)  # q/k/v and gate/up read 72 columns
    for scheme, group in (("nvfp4a16", 16), ("nvfp4", 16), ("mxfp4a16", 32), ("mxfp4", 32)):
        assert main([str(odd), "--calib", str(calib), "-o", str(tmp_path / "q"), "--scheme", scheme]) == 2
        assert f"{scheme} groups input columns by {group}; model.layers.0.self_attn.q_proj" in capsys.readouterr().err
    for strategy, group in (("group", 16), ("tensor_group", 32), ("channel", None)):
        with pytest.raises(ValueError, match="4-bit floats are NVFP4"):
            QuantArgs(type="float", num_bits=4, strategy=strategy, group_size=group)
    with pytest.raises(ValueError, match="tensor_group strategy is NVFP4's"):
        QuantArgs(type="int", num_bits=4, strategy="tensor_group", group_size=16)
    w4a4 = {"weights": preset("nvfp4a16").weights.to_dict(), "targets": ["Linear"],
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                  "dynamic": "local"}}
    assert QuantScheme.from_dict(w4a4, fmt="nvfp4-pack-quantized", what="group_0") == preset("nvfp4")
    w4a4["input_activations"]["dynamic"] = True
    with pytest.raises(ValueError, match="run-time scales are 'local'"):
        QuantScheme.from_dict(w4a4, fmt="nvfp4-pack-quantized", what="group_0")
    mx = {"weights": preset("mxfp4a16").weights.to_dict(), "targets": ["Linear"],
          "input_activations": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "dynamic": True}}
    assert QuantScheme.from_dict(mx, fmt="mxfp4-pack-quantized", what="group_0") == preset("mxfp4")
    with pytest.raises(ValueError, match="mxfp4-pack-quantized \\(MXFP4\\), and only they"):
        QuantScheme.from_dict(mx, fmt="nvfp4-pack-quantized", what="group_0")
    mx["input_activations"] = w4a4["input_activations"] | {"dynamic": "local"}
    with pytest.raises(ValueError, match="do not pair with weights"):  # NVFP4 activations on MXFP4 weights
        QuantScheme.from_dict(mx, fmt="mxfp4-pack-quantized", what="group_0")
    int8_groups = {"weights": preset("w8a8-int8").weights.to_dict(), "targets": ["Linear"],
                   "input_activations": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32,
                                         "dynamic": True}}
    with pytest.raises(ValueError, match="groups: FP4's, and block FP8's"):
        QuantScheme.from_dict(int8_groups, fmt="int-quantized", what="group_0")
    with pytest.raises(ValueError, match="NVFP4 needs input sizes that are multiples of 16"):
        fp4.Nvfp4(torch.ones(1)).group_scales(torch.ones(4, 24))
    with pytest.raises(ValueError, match="MXFP4 needs input sizes that are multiples of 32"):
        fp4.Mxfp4().group_scales(torch.ones(4, 48))
