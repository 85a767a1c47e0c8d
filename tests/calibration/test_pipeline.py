"""The sequential pipeline on a tiny random Llama: statistics over the whole set, layer order, errors."""

from __future__ import annotations

import pytest
import torch

from calibration.pipeline import calibrate
from calibration.targets import TargetError, layer_linears, resolve_group_size, select_targets


@pytest.fixture()
def tiny_model(tiny_model_dir):
    from engine.loader import load_model

    model, _ = load_model(tiny_model_dir, dtype=torch.float32)
    return model


def _samples(num: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (int(torch.randint(3, 24, (1,), generator=g)),), generator=g) for _ in range(num)]


@pytest.mark.parametrize("max_batch_tokens", [1, 30, 2048])  # one sample per call, a few, all at once
def test_kv_absmax_is_the_max_over_every_sample(tiny_model, max_batch_tokens):
    samples = _samples(7)
    per_sample: list[list[torch.Tensor]] = []  # [sample][layer] → [2, num_kv_heads]

    def record(layer_maxes):
        def hook(_module, args):
            _q, k, v = args[:3]
            layer_maxes.append(torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]))
        return hook

    for ids in samples:
        maxes: list[torch.Tensor] = []
        handles = [layer.self_attn.attn.register_forward_pre_hook(record(maxes)) for layer in tiny_model.model.layers]
        with torch.no_grad():
            tiny_model(ids, torch.arange(ids.numel()))
        for h in handles:
            h.remove()
        per_sample.append(maxes)

    result = calibrate(tiny_model, samples, [], [], None, observe_kv=True, max_batch_tokens=max_batch_tokens,
                       show_progress=False)
    for layer_idx, (k_absmax, v_absmax) in enumerate(result.kv_absmax):
        expected = torch.stack([s[layer_idx] for s in per_sample]).amax(0)
        torch.testing.assert_close(k_absmax, expected[0])
        torch.testing.assert_close(v_absmax, expected[1])
        # the max is not just the last sample's (the per-batch observer trap)
        assert not torch.equal(k_absmax, per_sample[-1][layer_idx][0])
    assert result.layers[0].k_absmax == result.kv_absmax[0][0].tolist()


@pytest.mark.parametrize("max_batch_tokens", [30, 2048])
def test_unquantized_pipeline_reproduces_the_model(tiny_model, max_batch_tokens):
    """Layer-by-layer with no quantizer must equal a plain forward: batching and stream bookkeeping are right."""
    samples = _samples(5, seed=1)
    last_layer = tiny_model.model.layers[-1]
    seen: list[torch.Tensor] = []
    handle = last_layer.register_forward_hook(lambda _m, _args, out: seen.append(out[0] + out[1]))
    with torch.no_grad():
        for ids in samples:
            tiny_model(ids, torch.arange(ids.numel()))
    expected, seen[:] = list(seen), []
    linears = select_targets(layer_linears(tiny_model), ("lm_head",))
    result = calibrate(tiny_model, samples, [], linears, None, observe_kv=True, max_batch_tokens=max_batch_tokens,
                       show_progress=False)
    handle.remove()
    # samples run batched (several causal sequences per call); they must match one-at-a-time forwards
    assert len(seen) < len(samples)
    torch.testing.assert_close(torch.cat(seen), torch.cat(expected))
    assert [r.output_error for r in result.layers] == [None, None]  # no held-out samples, no error to report
    assert set(result.layers[0].input_absmax) == {"self_attn.qkv_proj", "self_attn.o_proj",
                                                  "mlp.gate_up_proj", "mlp.down_proj"}


def test_targets_carry_checkpoint_names_and_ignore_is_all_or_none(tiny_model):
    linears = layer_linears(tiny_model)
    qkv = linears[0]
    assert qkv.prefixes == tuple(f"model.layers.0.self_attn.{n}_proj" for n in "qkv")
    assert qkv.output_sizes == (64, 32, 32) and qkv.input_size == 64
    kept = select_targets(linears, ("lm_head", "re:model\\.layers\\.1\\..*"))
    assert {t.layer_idx for t in kept} == {0}
    with pytest.raises(TargetError, match="all or none"):
        select_targets(linears, ("lm_head", "model.layers.0.self_attn.k_proj"))
    with pytest.raises(TargetError, match="matches no Linear"):
        select_targets(linears, ("lm_head", "model.layers.0.mlp.gate"))


def test_group_size_auto_and_explicit(tiny_model):
    targets = select_targets(layer_linears(tiny_model), ("lm_head",))  # input sizes 64 and 128
    assert resolve_group_size(targets, None, (128, 64, 32)) == 64
    assert resolve_group_size(targets, 32, (128, 64, 32)) == 32
    with pytest.raises(TargetError, match="--group-size 128 does not divide the input size 64"):
        resolve_group_size(targets, 128, (128, 64, 32))
