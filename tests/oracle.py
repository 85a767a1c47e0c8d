"""HF transformers as the oracle: greedy generations and logits on the same fp32 weights."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4


@dataclass
class Divergence:
    position: int
    ours: int
    theirs: int
    gap_ours: float  # |logprob(ours) − logprob(theirs)| in our run
    gap_theirs: float  # the same in HF's run

    @property
    def is_near_tie(self) -> bool:
        return self.gap_ours < NEAR_TIE and self.gap_theirs < NEAR_TIE


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step log-probs from transformers' own generate.

    EOS neither stops nor is masked (min_new_tokens would mask it to -inf, which our
    ignore_eos does not do): generation runs exactly max_new_tokens on the raw distribution.
    """
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []  # None falls back to the model's EOS; an empty list disables stopping
    config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
    config.max_new_tokens, config.pad_token_id = max_new_tokens, 0
    config.output_scores, config.return_dict_in_generate = True, True
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():  # the mask: without one, generate masks every prompt token equal to the pad id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, [s[0].float().log_softmax(-1) for s in out.scores]


def assert_quantized_answers_as_hf(source, out, *, weights_only: bool, max_drift: float) -> None:
    """A quantized checkpoint `out` of `source`: HF transformers (with compressed-tensors) loads it
    and greedily answers as this engine does; weights-only schemes give HF's logits within 1e-4
    (the same dequantized arithmetic); and the logits stay within `max_drift` (mean absolute
    difference) of the unquantized model's."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.loader import load_model

    ids = torch.randint(3, 380, (30,), generator=torch.Generator().manual_seed(9))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens, _ = hf_greedy(hf, ids.tolist(), 12)
    ours = LLM(str(out), dtype="float32").generate([ids.tolist()], SamplingParams(temperature=0.0, max_tokens=12,
                                                                                 ignore_eos=True), use_tqdm=False)
    assert list(ours[0].outputs[0].token_ids) == tokens
    model, _ = load_model(out, "float32")
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(30)))
        if weights_only:
            torch.testing.assert_close(logits, hf(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)
        original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(ids.unsqueeze(0)).logits[0]
    drift = (logits - original).abs().mean()
    assert drift < max_drift, drift


def first_divergence(ours: list[int], our_logprobs: list[dict[int, float]], theirs: list[int],
                     their_logprobs: list[torch.Tensor]) -> Divergence | None:
    """None if the sequences agree; else where and how close the two choices were in each run."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            lp = our_logprobs[i]
            gap_ours = abs(lp[a] - lp[b]) if b in lp else float("inf")
            gap_theirs = abs(their_logprobs[i][a].item() - their_logprobs[i][b].item())
            return Divergence(i, a, b, gap_ours, gap_theirs)
    return None


def assert_matches_hf(ours: list[int], our_logprobs, theirs: list[int], their_logprobs, label: str) -> str | None:
    """Fail on a real divergence; return a report line for a genuine near-tie (the test prints it)."""
    div = first_divergence(ours, our_logprobs, theirs, their_logprobs)
    if div is None:
        assert len(ours) == len(theirs), f"{label}: {len(ours)} tokens vs HF's {len(theirs)}"
        return None
    assert div.is_near_tie, (f"{label}: diverged from HF at token {div.position}: ours {div.ours} vs HF {div.theirs} "
                             f"(logprob gap {div.gap_ours:.2e} ours, {div.gap_theirs:.2e} HF; not a near-tie)")
    return f"{label}: near-tie at token {div.position} (gaps {div.gap_ours:.1e} / {div.gap_theirs:.1e})"


def assert_outputs_match_hf(outputs, reference, label: str) -> None:
    """Every RequestOutput against its HF (tokens, logprobs) reference; prints accepted near-ties."""
    ties = []
    for i, out in enumerate(outputs):
        theirs, their_lp = reference[i]
        tie = assert_matches_hf(out.outputs[0].token_ids, out.outputs[0].logprobs, theirs, their_lp, f"{label}/{i}")
        if tie:
            ties.append(tie)
    if ties:
        print("near-ties (accepted, both runs within 1e-4):\n" + "\n".join(ties))
