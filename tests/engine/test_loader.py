"""The loader streams: each Linear is built (and, for serving, laid out) as soon as its last
tensor is read, so a load holds one Linear's staging copies at a time, not the checkpoint's."""

import json
import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.layers import panel_matmul
from engine.layers.linear import DenseLinear
from engine.loader import load_model
from quant.checkpoint import write_checkpoint
from quant.config import QuantizationConfig
from quant.linear import QuantLinearBase
from quant.schemes import preset
from tests.helpers import make_tiny_model_dir, quantized_tensors


def _split_into_two_files(folder, second: set[str]) -> None:
    """Rewrite `folder`'s model.safetensors as two files with an index; names in `second` go to the second."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in second},
             "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k in second}}
    for name, part in files.items():
        save_file(part, folder / name, metadata={"format": "pt"})
    weight_map = {k: name for name, part in files.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def w4a16_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    source = make_tiny_model_dir(root / "source", dtype=torch.bfloat16)
    scheme = preset("w4a16")
    return write_checkpoint(root / "w4a16", source_dir=source, quant_config=QuantizationConfig.for_scheme(scheme),
                            tensors=quantized_tensors(source, scheme, kv=False))


def test_each_linear_is_built_before_the_next_one_is_read(w4a16_dir, tmp_path, monkeypatch):
    """Across two weight files, Linears' tensors split between them: each Linear is finalized
    right after its last shard (not all after the whole checkpoint), and the model equals the
    one-file load."""
    sharded = tmp_path / "sharded"
    shutil.copytree(w4a16_dir, sharded)
    _split_into_two_files(sharded, {"model.layers.0.self_attn.k_proj.weight_scale",
                                    "model.layers.1.mlp.up_proj.weight_packed", "model.norm.weight"})
    events = []
    load_shard, finalize = QuantLinearBase.load_shard, QuantLinearBase.finalize

    def logged_load_shard(self, shard_id, tensors):
        events.append((id(self), "load"))
        load_shard(self, shard_id, tensors)

    def logged_finalize(self):
        events.append((id(self), "finalize"))
        finalize(self)

    monkeypatch.setattr(QuantLinearBase, "load_shard", logged_load_shard)
    monkeypatch.setattr(QuantLinearBase, "finalize", logged_finalize)
    streamed, _ = load_model(sharded)
    monkeypatch.undo()
    last_load = {module: i for i, (module, kind) in enumerate(events) if kind == "load"}
    assert len(last_load) == 2 * 4  # qkv, o, gate_up, down in two layers
    assert all(events[i + 1] == (module, "finalize") for module, i in last_load.items())
    whole, _ = load_model(w4a16_dir)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.inference_mode():
        assert torch.equal(streamed.compute_logits(streamed(ids, torch.arange(8))),
                           whole.compute_logits(whole(ids, torch.arange(8))))


@pytest.mark.skipif(panel_matmul.pack(torch.zeros(16, 1)) is None, reason="no C compiler here")
def test_serving_load_frees_each_float32_weight_once_it_is_in_panels(tmp_path, monkeypatch):
    """With `prepack` a Linear's float32 weight is gone before the next Linear is loaded: the
    model is never held whole in float32 when it serves in bf16 panels."""
    folder = make_tiny_model_dir(tmp_path / "bf16", dtype=torch.bfloat16)
    packed_weights = []
    alive_at_load = []
    prepack, load_shard = DenseLinear.prepack, DenseLinear.load_shard

    def recording(self, bf16_activations=False):
        before, size = weakref.ref(self.weight), self.weight.numel() * 4
        freed = prepack(self, bf16_activations)
        assert self.weight.dim() == 3 and freed == size  # packed: the fp32 weight is no longer the module's
        packed_weights.append(before)
        return freed

    def checking(self, shard_id, tensors):
        alive_at_load.append(sum(ref() is not None for ref in packed_weights))
        load_shard(self, shard_id, tensors)

    monkeypatch.setattr(DenseLinear, "prepack", recording)
    monkeypatch.setattr(DenseLinear, "load_shard", checking)
    model, _ = load_model(folder, prepack=True)
    assert len(packed_weights) == 2 * 4 and alive_at_load and not any(alive_at_load)
    monkeypatch.undo()
    linears = [m for m in model.modules() if isinstance(m, DenseLinear)]
    panels = [m.weight for m in linears]
    model.prepack_for_cpu()  # the engine's pass after LoRA keeps them (packing panels again would scramble them)
    assert all(m.weight is p for m, p in zip(linears, panels, strict=True))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.o_proj.weight_scale", "model.norm.weight"])
def test_a_tensor_in_two_weight_files_is_an_error(w4a16_dir, tmp_path, name):
    sharded = tmp_path / "duplicated"
    shutil.copytree(w4a16_dir, sharded)
    _split_into_two_files(sharded, {name})
    first = sharded / "model-00001-of-00002.safetensors"
    tensors = load_file(first)
    tensors[name] = load_file(sharded / "model-00002-of-00002.safetensors")[name]
    save_file(tensors, first, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor '{name}' is in both model-00001-of-00002.safetensors and "
                                         "model-00002-of-00002.safetensors"):
        load_model(sharded, prepack=True)


def test_a_dense_shard_without_its_weight_is_an_error(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "qwen2", architecture="Qwen2ForCausalLM")  # q/k/v carry biases
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj shard 1: no 'weight' tensor for this shard"):
        load_model(folder)


@pytest.mark.skipif(panel_matmul.pack(torch.zeros(16, 1)) is None, reason="no C compiler here")
@pytest.mark.parametrize("tied", [True, False])
def test_serving_load_lays_the_table_out_from_the_checkpoint(tmp_path, tied):
    """A BF16 table served in fp32 is laid out as the loader reads it (the tied head's panels, or
    an untied table in bf16), never filled in as a float32 table first; its rows are the checkpoint's."""
    folder = make_tiny_model_dir(tmp_path / "bf16", dtype=torch.bfloat16, tie_word_embeddings=tied)
    table = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    model, _ = load_model(folder, prepack=True)
    assert model.table_laid_out and model.dtype == torch.float32
    embed = model.model.embed_tokens.weight
    assert embed.numel() == 0 if tied else (embed.dtype == torch.bfloat16 and torch.equal(embed, table))
    ids = torch.tensor([0, 5, table.shape[0] - 1])
    assert torch.equal(model.model.embed(ids), table[ids].float())
    plain, _ = load_model(folder)  # calibration's load keeps the float32 table
    assert not plain.table_laid_out and plain.model.embed_tokens.weight.dtype == torch.float32


def test_a_model_served_in_bf16_keeps_its_table_as_loaded(tmp_path):
    """Only a table served in fp32 is laid out from the checkpoint's tensor: a bf16 model's table
    stays its own (an fp32 checkpoint's table packed to fp32 panels would be the wrong dtype)."""
    folder = make_tiny_model_dir(tmp_path / "fp32")
    model, _ = load_model(folder, dtype="bfloat16", prepack=True)
    model.prepack_for_cpu()
    embed = model.model.embed_tokens.weight
    assert not model.table_laid_out and model.packed_embedding is None
    assert embed.dtype == torch.bfloat16 and embed.shape[0] == model.args.vocab_size
