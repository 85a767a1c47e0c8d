"""NVFP4 (NVFP4A16 weights, and NVFP4's FP4 activations): quant/fp4.py against compressed-tensors'
own compressor and fake quantization, the Linear against dequantize-then-matmul, and `quantize
--scheme nvfp4a16 | nvfp4` end to end."""

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
    w[3, :16] = 0  # an all-zero group: CT stores FP8's 0.125 for its scale
    w[5, 5] = -1e-9  # a negative weight that rounds to zero: CT packs it as -0
    w[7, 20] = 0.9  # a tensor absmax far above the rest
    return w


def test_scales_and_packed_codes_are_compressed_tensors_own():
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = _weight()
    global_, scales = fp4.global_scale(w), None
    assert torch.equal(global_, generate_gparam(w.min(), w.max()).reshape(1).float())
    scales = fp4.group_scales(w, global_)
    groups = w.reshape(48, 8, 16)
    ct_scales, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), NVFP4A16["weights"], global_scale=global_)
    assert torch.equal(scales.float(), ct_scales.float().reshape(48, 8))
    scheme = ct_quant.QuantizationScheme(targets=["Linear"], **NVFP4A16)
    compressed = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scales.float(), "weight_global_scale": global_}, scheme)
    packed = fp4.pack(fp4.quantize(w, scales, global_))
    assert torch.equal(packed, compressed["weight_packed"])
    assert torch.equal(fp4.unpack(packed), fp4.quantize(w, scales, global_))
    ours = fp4.dequantize(packed, scales, global_)
    theirs = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_}, scheme)["weight"]
    torch.testing.assert_close(ours.to(theirs.dtype), theirs, rtol=2**-7, atol=0)  # CT decompresses in bf16
    assert (ours - w).abs().max() <= (fp4.effective_scales(scales, global_).max() * 1.0)  # half of E2M1's widest step


def test_rounding_is_nearest_e2m1_with_ties_to_even():
    scales = torch.full((1, 1), 1.0, dtype=torch.float32).to(torch.float8_e4m3fn)
    global_ = torch.ones(1)
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -1.74, 0.74, 5.01, -6.5, 0.0, 2.49, 3.51]])
    values = fp4.values(fp4.quantize(x, scales, global_))
    assert values.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -1.5, 0.5, 6.0, -6.0, 0.0, 2.0, 4.0]]


def test_the_linear_equals_dequantize_then_matmul_with_a_global_scale_per_shard():
    """Fused shards with their own global scales (as other writers may leave them) each dequantize
    exactly as fp4.dequantize; the int8 panel kernel's products equal dequantize-then-matmul."""
    from quant.linear import make_quantized_linear

    shards = [_weight()[:32], _weight()[16:] * 3]
    linear = make_quantized_linear(preset("nvfp4a16"), 128, [32, 32], bias=False, dtype=torch.float32)
    expected = []
    for i, w in enumerate(shards):
        global_ = fp4.global_scale(w)
        scales = fp4.group_scales(w, global_)
        packed = fp4.pack(fp4.quantize(w, scales, global_))
        linear.load_shard(i, {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_})
        expected.append(fp4.dequantize(packed, scales, global_))
    linear.finalize()
    weight = torch.cat(expected)
    assert torch.equal(linear.dequantized_weight(), weight)  # bit for bit
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(linear(x), x @ weight.T, atol=1e-5, rtol=1e-5)
    assert linear.kernel in ("int8panel", "dense")
    bad = make_quantized_linear(preset("nvfp4a16"), 128, [32], bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="'weight_global_scale': must be finite and positive"):
        bad.load_shard(0, {"weight_packed": packed[:32], "weight_scale": scales[:32],
                           "weight_global_scale": torch.zeros(1)})


def test_activations_are_rounded_as_compressed_tensors_does():
    """NVFP4 activations (W4A4): each token's groups of 16 scaled at run time under the global
    scale, bit for bit CT's own fake quantization with dynamic local scales."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4

    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)) * 3
    x[2, 16:32] = 0
    global_ = fp4.global_scale(x)
    args = NVFP4["input_activations"]
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module(), global_scale=global_)
    expected = fake_quantize(x=x, scale=scale, zero_point=zero_point, args=args, global_scale=global_)
    assert torch.equal(fp4.fake_quantize(x, global_), expected)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_the_w4a4_linear_rounds_its_inputs_first(device):
    from quant.linear import make_quantized_linear

    w = _weight()[:32]
    global_, inputs = fp4.global_scale(w), torch.tensor([448.0 * 6 / 4.0])
    scales = fp4.group_scales(w, global_)
    shard = {"weight_packed": fp4.pack(fp4.quantize(w, scales, global_)), "weight_scale": scales,
             "weight_global_scale": global_, "input_global_scale": inputs}
    with torch.device(device):  # a Linear's kernel is chosen for the device it is built on
        linear = make_quantized_linear(preset("nvfp4"), 128, [32], bias=False, dtype=torch.float32)
    linear.load_shard(0, shard)
    linear.finalize()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    expected = fp4.fake_quantize(x, inputs) @ linear.dequantized_weight().cpu().T
    torch.testing.assert_close(linear(x.to(device)).cpu(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(linear(x.to(device)).cpu(), x @ linear.dequantized_weight().cpu().T, atol=1e-3)
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


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    return _quantized(tmp_path_factory.mktemp("nvfp4a16"), "nvfp4a16")


def _reference(source, out):
    """HF's source model with the checkpoint's tensors and dequantized weights put in, and (W4A4)
    each quantized Linear's input rounded by compressed-tensors' own fake quantization."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from transformers import AutoModelForCausalLM

    tensors = load_file(out / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)

    def round_input(module, args):
        x, global_ = args[0], module.input_global_scale
        scale, zp = compute_dynamic_scales_and_zp(value=x, args=NVFP4["input_activations"], module=module,
                                                  global_scale=global_)
        return (fake_quantize(x=x, scale=scale, zero_point=zp, args=NVFP4["input_activations"], global_scale=global_),)

    with torch.no_grad():
        for name, param in reference.named_parameters():  # norms AWQ smoothed, and the rest as written
            if name in tensors:
                param.copy_(tensors[name])
        for name, module in reference.named_modules():
            if f"{name}.weight_packed" in tensors:
                module.weight.copy_(fp4.dequantize(tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"],
                                                   tensors[f"{name}.weight_global_scale"]))
                if f"{name}.input_global_scale" in tensors:
                    module.input_global_scale = tensors[f"{name}.input_global_scale"]
                    module.register_forward_pre_hook(round_input)
    return reference, tensors


@pytest.mark.parametrize("scheme", ["nvfp4a16", "nvfp4", "nvfp4 --algo gptq", "nvfp4a16 --algo awq"])
def test_quantize_writes_nvfp4_that_serves_as_compressed_tensors_computes_it(nvfp4_checkpoint, tmp_path, scheme):
    """The config is CT's NVFP4A16 / NVFP4; fused q/k/v and gate/up share one global scale (vLLM
    loads them so), and under W4A4 one input global scale; the engine's logits equal HF's model
    with the dequantized weights put in and, under W4A4, CT rounding each Linear's input (1e-4)."""
    from engine import LLM, SamplingParams
    from engine.loader import load_model

    source, out = nvfp4_checkpoint if scheme == "nvfp4a16" else _quantized(tmp_path, scheme)
    scheme = scheme.split()[0]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized"
    group = config["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor_group"
    assert (group["input_activations"] or {}).get("dynamic") == (None if scheme == "nvfp4a16" else "local")
    reference, tensors = _reference(source, out)
    for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        for kind in ("weight_global_scale", "input_global_scale")[:2 if scheme == "nvfp4" else 1]:
            shared = {tensors[f"model.layers.0.{'self_attn' if fused[0] == 'q_proj' else 'mlp'}.{name}.{kind}"]
                      .item() for name in fused}
            assert len(shared) == 1, (fused, kind)
    ids = torch.randint(3, 380, (30,), generator=torch.Generator().manual_seed(9))
    model, _ = load_model(out, "float32")
    model.prepack_for_cpu()
    assert (model.fused_decode is None) == (scheme == "nvfp4")  # W4A4 inputs are rounded in torch
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(30)))
        torch.testing.assert_close(ours, reference(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)
    outs = LLM(str(out)).generate([ids.tolist()], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                  use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8


def test_hf_transformers_loads_the_checkpoint_and_answers_as_we_do(nvfp4_checkpoint):
    """compressed-tensors in HF transformers decompresses NVFP4 in bf16: its logits stay within
    bf16's reach of ours and its greedy tokens are ours."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.loader import load_model
    from tests.oracle import hf_greedy

    _, out = nvfp4_checkpoint
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


def test_nvfp4_is_refused_where_it_cannot_run(tmp_path, capsys):
    from calibration.cli import main
    from quant.schemes import QuantArgs
    from tests.calibration.factories import write_calib_file

    source = make_tiny_model_dir(tmp_path / "source")
    calib = write_calib_file(tmp_path / "calib.jsonl", 8)
    assert main([str(source), "--calib", str(calib), "-o", str(tmp_path / "q"), "--scheme", "nvfp4a16",
                 "--smoothquant", "0.5"]) == 2
    assert "--smoothquant applies to w8a8-int8" in capsys.readouterr().err
    odd = make_tiny_model_dir(tmp_path / "odd", hidden_size=72)  # q/k/v and gate/up read 72 columns
    for scheme in ("nvfp4a16", "nvfp4"):
        assert main([str(odd), "--calib", str(calib), "-o", str(tmp_path / "q"), "--scheme", scheme]) == 2
        assert f"{scheme} groups input columns by 16; model.layers.0.self_attn.q_proj" in capsys.readouterr().err
    with pytest.raises(ValueError, match="NVFP4, and only they"):
        QuantArgs(type="float", num_bits=4, strategy="group", group_size=16)
    with pytest.raises(ValueError, match="NVFP4, and only they"):
        QuantArgs(type="int", num_bits=4, strategy="tensor_group", group_size=16)
    w4a4 = {"weights": preset("nvfp4a16").weights.to_dict(), "targets": ["Linear"],
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                  "dynamic": "local"}}
    assert QuantScheme.from_dict(w4a4, fmt="nvfp4-pack-quantized", what="group_0") == preset("nvfp4")
    w4a4["input_activations"]["dynamic"] = True
    with pytest.raises(ValueError, match="run-time scales are 'local'"):
        QuantScheme.from_dict(w4a4, fmt="nvfp4-pack-quantized", what="group_0")
    with pytest.raises(ValueError, match="multiples of 16"):
        fp4.group_scales(torch.ones(4, 24), torch.ones(1))
