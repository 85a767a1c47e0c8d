"""The serving engine's CPU weight layout (16-column panels, C kernel) computes the same Linear."""

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from engine import LLM
from engine.layers import panel_matmul
from engine.layers.linear import DenseLinear, describe_kernels, matmul_kernels
from engine.loader import load_model
from quant.checkpoint import write_checkpoint
from quant.config import QuantizationConfig
from quant.schemes import preset
from tests.helpers import (
    assert_rows_do_not_depend_on_the_batch,
    cpu_kernels_off,
    make_tiny_model_dir,
    quantized_tensors,
)

needs_kernel = pytest.mark.skipif(panel_matmul.pack(torch.zeros(16, 1)) is None, reason="no C compiler here")
needs_bf16_dot = pytest.mark.skipif(not panel_matmul.bf16_dot_available(),
                                    reason="the bf16 × bf16 kernel needs a C compiler and AVX-512 BF16")


def _layer(in_features: int, sizes: list[int], bias: bool, g: torch.Generator,
           bf16_values: bool = False) -> DenseLinear:
    layer = DenseLinear(in_features, sizes, bias, torch.float32)
    for i, n in enumerate(sizes):
        weight = torch.randn(n, in_features, generator=g)
        tensors = {"weight": weight.bfloat16().float() if bf16_values else weight}
        if bias:
            tensors["bias"] = torch.randn(n, generator=g)
        layer.load_shard(i, tensors)
    layer.finalize()
    return layer


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), in_features=st.sampled_from([1, 8, 37, 96]),
       sizes=st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3), bias=st.booleans(),
       seed=st.integers(0, 100), bf16_values=st.booleans())
def test_packed_linear_equals_plain(rows, in_features, sizes, bias, seed, bf16_values):
    """Every row count crosses the kernel's row tiles and their leftovers (tiles of 4 or 8).
    Weights that are all bf16 values (a BF16 checkpoint) pack as bf16 and give the very same
    floats as fp32 panels."""
    g = torch.Generator().manual_seed(seed)
    layer = _layer(in_features, sizes, bias, g, bf16_values)
    weight, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    x = torch.randn(rows, in_features, generator=g)
    assert layer.kernel == "linear"
    layer.prepack()
    assert layer.weight.shape == (sum(sizes) // 16, in_features, 16)
    assert layer.weight.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    assert layer.kernel == ("panel-bf16" if bf16_values else "panel-f32")
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    if bf16_values:
        assert torch.equal(layer(x), panel_matmul.matmul(x, panel_matmul.pack(weight, narrow=False), b))
    x3d = torch.randn(2, 3, in_features, generator=g)
    torch.testing.assert_close(layer(x3d), F.linear(x3d, weight, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(in_features, rows, generator=g).t()  # not contiguous: copied for the kernel
    torch.testing.assert_close(layer(strided), F.linear(strided, weight, b), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bf16_values", [False, True])
def test_a_rows_products_do_not_depend_on_the_other_rows(bf16_values):
    """Each row's floats are the same alone and in batches of any size (the engine's greedy
    outputs must not depend on the batch): whole row tiles and every leftover count, fp32 and
    bf16 panels, and every batch is the plain Linear's product."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 100, generator=g), torch.randn(48, generator=g)
    if bf16_values:
        weight = weight.bfloat16().float()
    panels = panel_matmul.pack(weight)
    assert panels.dtype == (torch.bfloat16 if bf16_values else torch.float32)
    x = torch.randn(110, 100, generator=g)
    torch.testing.assert_close(panel_matmul.matmul(x, panels, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert_rows_do_not_depend_on_the_batch(panel_matmul.matmul, x, (1, 7, 8, 15, 16, 17, 24, 35, 47, 48, 61, 100),
                                           panels, bias)


@needs_bf16_dot
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), in_features=st.sampled_from([1, 7, 8, 37, 96]),
       sizes=st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3), bias=st.booleans(),
       seed=st.integers(0, 100))
def test_bf16_pairs_multiply_inputs_rounded_to_bf16(rows, in_features, sizes, bias, seed):
    """Rows cross the 16-row tile and its leftovers; an odd in_features pads its last pair. The
    products of bf16 values are exact in float32, so only the order of the sums differs."""
    g = torch.Generator().manual_seed(seed)
    layer = _layer(in_features, sizes, bias, g, bf16_values=True)
    weight, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    layer.prepack(bf16_activations=True)
    assert layer.weight.shape == (sum(sizes) // 16, (in_features + 1) // 2, 16, 2) and layer.kernel == "bf16dot"
    x = torch.randn(rows, in_features, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x.bfloat16().float(), weight, b), rtol=1e-5, atol=1e-5)
    x3d = torch.randn(2, 3, in_features, generator=g)
    torch.testing.assert_close(layer(x3d), F.linear(x3d.bfloat16().float(), weight, b), rtol=1e-5, atol=1e-5)


@needs_bf16_dot
def test_bf16_pairs_reject_inputs_of_another_width():
    panels = panel_matmul.pack_bf16_pairs(torch.ones(16, 7))
    with pytest.raises(ValueError, match="x has 9 columns; these bf16 pair panels take 7 or 8"):
        panel_matmul.matmul(torch.ones(2, 9), panels)


@needs_bf16_dot
def test_weights_that_are_not_bf16_values_keep_float32_inputs():
    layer = _layer(8, [16], False, torch.Generator().manual_seed(0))
    layer.prepack(bf16_activations=True)
    assert layer.weight.shape == (1, 8, 16) and layer.weight.dtype == torch.float32


@needs_bf16_dot
@pytest.mark.parametrize("tied", [True, False])
def test_only_a_quantized_checkpoint_rounds_its_lm_head_inputs(tmp_path, tied):
    """W8A16 Linears, the lm_head left unquantized: its bf16 weights meet bf16-rounded inputs. The
    same model unquantized keeps float32 inputs (the HF oracle's arithmetic)."""
    source = make_tiny_model_dir(tmp_path / "source", dtype=torch.bfloat16, tie_word_embeddings=tied)
    scheme = preset("w8a16")
    quantized = write_checkpoint(tmp_path / "w8a16", source_dir=source,
                                 quant_config=QuantizationConfig.for_scheme(scheme),
                                 tensors=quantized_tensors(source, scheme, kv=False))
    plain, model = LLM(str(source)).engine.model, LLM(str(quantized)).engine.model
    head = (lambda m: m.packed_embedding) if tied else (lambda m: m.lm_head.weight)
    assert head(plain).dim() == 3 and head(model).dim() == 4
    layers = len(model.model.layers) * 4  # qkv, o, gate_up, down
    assert matmul_kernels(plain) == {"panel-bf16": layers + (not tied)}  # a tied head is the embedding's panels
    assert matmul_kernels(model) == {"int8panel": layers, **({} if tied else {"bf16dot": 1})}
    weight = (load_file(source / "model.safetensors")["model.embed_tokens.weight"] if tied
              else plain.lm_head.weight.transpose(1, 2).flatten(0, 1))
    hidden = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(plain.compute_logits(hidden), hidden @ weight.float().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(hidden), hidden.bfloat16().float() @ weight.float().T,
                               rtol=1e-5, atol=1e-5)


def test_bf16_values_are_checked_in_every_chunk():
    weight = torch.randn(4096, 1024).bfloat16().float()  # 16 MB, checked 4 MB at a time
    assert panel_matmul.holds_bf16_values(weight)
    weight[-1, -1] = 1 + 2**-20  # a float32 value between two bf16 ones, in the last chunk
    assert not panel_matmul.holds_bf16_values(weight)


def test_weights_the_kernel_cannot_take_stay_plain():
    assert panel_matmul.pack(torch.randn(16, 8, dtype=torch.bfloat16)) is None
    assert panel_matmul.pack(torch.randn(24, 8)) is None  # not whole panels
    if torch.cuda.is_available():
        assert panel_matmul.pack(torch.randn(16, 8, device="cuda")) is None
    with cpu_kernels_off():
        layer = _layer(8, [16], True, torch.Generator().manual_seed(0))
        weight = layer.weight.clone()
        layer.prepack()
        assert torch.equal(layer.weight, weight) and layer.kernel == "linear"  # no kernel: the plain layout, F.linear


@needs_kernel
def test_engine_packs_its_weights_and_scores_like_the_plain_model(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        llm = LLM(str(tiny_model_dir))
    model = llm.engine.model
    kernels = matmul_kernels(model)
    assert sum(kernels.values()) == len(model.model.layers) * 4 + (model.lm_head is not None)
    assert f"matmul kernels: {describe_kernels(kernels)}" in caplog.messages
    assert model.model.layers[0].mlp.down_proj.weight.dim() == 3
    assert model.model.embedding_panels is model.packed_embedding  # lookups read the tied head's panels
    plain, _ = load_model(tiny_model_dir)  # what calibration uses: never packed
    assert plain.model.layers[0].mlp.down_proj.weight.dim() == 2
    ids = torch.tensor([5, 17, 42, 99, 3, 250, 7])
    with torch.inference_mode():
        expected = plain.compute_logits(plain(ids, torch.arange(len(ids))))
        got = model.compute_logits(model(ids, torch.arange(len(ids))))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_kernel_line_counts_the_linears_and_says_when_batches_take_amx_tiles():
    assert describe_kernels({"panel-f32": 2}) == "panel-f32 x2"  # fp32 products never take the tiles
    line = describe_kernels({"bf16dot": 1, "fp8dot": 120})
    assert line.startswith("fp8dot x120, bf16dot x1")
    assert ("AMX tiles" in line) == panel_matmul.use_amx()


@needs_kernel
@pytest.mark.parametrize("tied", [True, False])
def test_an_embedding_table_is_held_once_and_narrow(tmp_path, tied):
    """Served on the CPU, a tied table's lookups read the rows of the lm_head's panels, and the
    table itself is dropped; an untied BF16 table served in fp32 (read only by lookups) is held in
    bf16. Either way every looked-up row is the checkpoint's row in fp32, and a table of other
    values keeps fp32."""
    source = make_tiny_model_dir(tmp_path / "bf16", dtype=torch.bfloat16, tie_word_embeddings=tied)
    table = load_file(source / "model.safetensors")["model.embed_tokens.weight"].float()
    engine = LLM(str(source)).engine
    model = engine.model
    assert model.dtype == engine.kv_cache.dtype == torch.float32  # a narrower table is not the model's dtype
    if tied:
        assert model.model.embedding_panels is model.packed_embedding
        assert model.model.embed_tokens.weight.numel() == 0
    else:
        assert model.model.embedding_panels is None and model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.tensor([0, 17, 5, table.shape[0] - 1, 17])
    rows = model.model.embed(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, table[ids])
    with cpu_kernels_off():  # no panels: a tied head multiplies by the table itself
        assert LLM(str(source)).engine.model.model.embed_tokens.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    fp32 = make_tiny_model_dir(tmp_path / "fp32", tie_word_embeddings=tied)
    plain = LLM(str(fp32)).engine.model.model
    assert (plain.embedding_panels is not None) if tied else plain.embed_tokens.weight.dtype == torch.float32


@needs_kernel
@needs_bf16_dot
@pytest.mark.parametrize("k", [63, 64])
def test_panel_rows_are_the_weights_rows(k):
    """Rows read back from every panel layout `pack` makes (fp32, bf16, bf16 pairs of an odd or
    even width) are the weight's rows."""
    weight = torch.randn(48, k, generator=torch.Generator().manual_seed(k)).bfloat16().float()
    ids = torch.tensor([47, 0, 16, 15, 16])
    for panels in (panel_matmul.pack(weight, narrow=False), panel_matmul.pack(weight),
                   panel_matmul.pack_bf16_pairs(weight)):
        assert torch.equal(panel_matmul.panel_rows(panels, ids, k).float(), weight[ids])
        for bad in (-1, 48):  # as nn.Embedding, an id outside the table is an error, not a wrapped row
            with pytest.raises(IndexError, match="token ids must be in"):
                panel_matmul.panel_rows(panels, torch.tensor([0, bad]), k)
