"""Offline batch inference in vLLM's shape: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig
from engine.generation_config import sampling_defaults
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import EmbeddingOutput, EngineStats, PoolingRequestOutput, RequestOutput, ScoringOutput
from engine.pooling import (
    ClassificationOutput,
    ClassifierConfig,
    PoolingConfig,
    ScorePlan,
    classifier_config,
    pooling_config,
    score_pairs,
)
from engine.sampling_params import SamplingParams
from engine.tokenizer import render_chat

# one prompt, as vLLM takes it: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}
PromptInput = str | list[int] | dict


class LLM:
    """Loads a model folder once; generates for many prompts with continuous batching."""

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        # what generate() samples with when given no params: the model's generation_config.json, as in vLLM
        self.default_sampling_params = SamplingParams(**sampling_defaults(model))
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs' decoded_token

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (text, token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}); a bad prompt or parameter raises before anything runs.

        `priority` (one per prompt, lower first) needs `scheduling_policy="priority"`;
        `lora_request` (one for all, or one or None per prompt) needs `enable_lora=True`."""
        prompts = _prompt_batch(prompts)
        params = sampling_params if sampling_params is not None else self.default_sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        priority = [0] * len(prompts) if priority is None else list(priority)
        loras = [lora_request] * len(prompts) if not isinstance(lora_request, Sequence) else list(lora_request)
        if not len(params) == len(priority) == len(loras) == len(prompts):
            raise ValueError(f"got {len(params)} sampling params, {len(priority)} priorities and {len(loras)} "
                             f"LoRA requests for {len(prompts)} prompts")
        for lora in {r for r in loras if r is not None}:
            self.engine.add_lora(lora)
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priority, loras, strict=True):
                ids.append(self.engine.add_request(None, prompt, p, rank, None if lora is None else lora.lora_name))
        except BaseException:
            self._abort(ids)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptInput | Sequence[PromptInput], *, pooling: str | None = None,
              normalize: bool | None = None, dimensions: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[PoolingRequestOutput[EmbeddingOutput]]:
        """Embeddings of `prompts` (each output's `.outputs.embedding`), pooled and normalized as the
        model's sentence-transformers files say unless `pooling` / `normalize` are given;
        `dimensions` keeps the leading ones (Matryoshka models) before normalizing."""
        if self._classifier is not None:
            raise ValueError("this model is a sequence classifier: LLM.classify and LLM.score, not embed")
        config = self._pooling_config
        params = SamplingParams(max_tokens=1, pooling=pooling or config.pooling)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [PoolingRequestOutput(out.request_id, EmbeddingOutput(config.embedding(out.embedding, normalize, dimensions)),
                                     out.prompt_token_ids)
                for out in outputs]

    def classify(self, prompts: PromptInput | Sequence[PromptInput], *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """A sequence classifier's class logits and probabilities for each prompt (its last token
        through the score head), under each output's `.outputs`."""
        classifier = self._classifier
        if classifier is None:
            raise ValueError(f"LLM.classify needs a sequence classifier (*ForSequenceClassification); this model "
                             f"is {self.engine.hf_config['architectures'][0]}")
        outputs = self.generate(prompts, SamplingParams(max_tokens=1, pooling="last"), use_tqdm=use_tqdm,
                                lora_request=lora_request)
        results = []
        for out in outputs:
            probs = classifier.probabilities(out.embedding)
            classified = ClassificationOutput(out.embedding, probs, classifier.labels, classifier.most_probable(probs))
            results.append(PoolingRequestOutput(out.request_id, classified, out.prompt_token_ids))
        return results

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[PoolingRequestOutput[ScoringOutput]]:
        """vLLM's score: how well each pair matches (`.outputs.score`; engine.pooling.ScorePlan: a
        one-class classifier's sigmoid on the pair, or the cosine of an embedding model's two
        embeddings). One `text_1` pairs with every `text_2`; lists of equal length pair in order."""
        plan = ScorePlan.build(score_pairs(text_1, text_2), self.tokenizer, self._classifier, self._pooling_config)
        outputs = self.generate(plan.prompts, SamplingParams(max_tokens=1, pooling=plan.pooling), use_tqdm=use_tqdm,
                                lora_request=lora_request)
        scores = plan.scores([out.embedding for out in outputs])
        return [PoolingRequestOutput(f"score-{i}", ScoringOutput(score), ids)
                for i, (score, ids) in enumerate(zip(scores, plan.pair_token_ids(), strict=True))]

    @functools.cached_property
    def _classifier(self) -> ClassifierConfig | None:
        return classifier_config(self.engine.hf_config)

    @functools.cached_property
    def _pooling_config(self) -> PoolingConfig:
        """The model's pooling, read from its folder once (on the first embed call: a generative
        model's files are never read for it)."""
        return pooling_config(self.engine.config.model)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """Beam search (engine/beam_search.py) for each prompt, all prompts' beams batched in each
        step; each output's `.sequences` are its beam_width best hypotheses, best first (vLLM's shape)."""
        prompts = _prompt_batch(prompts)
        step = params.step_params()
        searches = [BeamSearch(self.engine.make_request("beam-check", p, step).prompt_token_ids, params,
                               self.engine.eos_token_ids, self.engine.max_model_len) for p in prompts]
        while live := [s for s in searches if not s.done]:
            outputs = iter(self.generate([seq for s in live for seq in s.pending()], step, use_tqdm=False,
                                         lora_request=lora_request))
            for search in live:
                search.advance([next(outputs).outputs[0].logprobs[0] for _ in search.beams])
        return [search.vllm_output(self.tokenizer) for search in searches]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (the model's, or `chat_template`), then
        generate; each output's `prompt` is the rendered text. Messages' content is text or
        OpenAI's list of text parts; `tools` (OpenAI function specs) go to the template."""
        batch = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [render_chat(self.tokenizer, [_text_message(m) for m in conversation], chat_template,
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message,
                             template_kwargs={**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})})
                 for conversation in batch]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text
        return outputs

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """One conversation's prompt token ids under the model's chat template."""
        text = render_chat(self.tokenizer, [_text_message(m) for m in messages],
                           add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's accessor)."""
        return self.tokenizer

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a failed step or Ctrl-C: the next call starts from an empty engine
            self._abort([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        for out in results.values():
            self._name_logprob_tokens(out)
        return [results[i] for i in ids]

    def _name_logprob_tokens(self, out: RequestOutput) -> None:
        """Each logprob entry's `decoded_token`, as vLLM's offline outputs carry it (the server
        names tokens its own way, so the engine leaves this to here)."""
        entries = [e for c in out.outputs for e in c.logprobs or ()] + [e for e in out.prompt_logprobs or () if e]
        texts, tokenizer = self._token_texts, self.tokenizer
        for entry in entries:
            for token_id, logprob in entry.items():
                if token_id not in texts:
                    texts[token_id] = tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(token_id)])
                logprob.decoded_token = texts[token_id]

    def _abort(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort_request(request_id)

    def score_full_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log p(· | tokens[:t+1]) over the whole vocabulary for every t: [T, vocab] fp32."""
        return self.engine.score(token_ids)

    def score_with_layer_states(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`score_full_logprobs` plus the residual stream after every decoder layer, [layers, T, hidden] fp32.

        For drift diagnosis: two checkpoints compared layer by layer show where their hidden
        states part (a damaged layer, or the layer a quantization scheme hurts most).
        """
        logprobs, states = zip(*self.score_chunks(token_ids, layer_states=True), strict=True)
        return torch.cat(logprobs), torch.cat(states, dim=1)

    def score_chunks(self, token_ids: list[int], *, layer_states: bool = False
                     ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """`score_full_logprobs` (with `score_with_layer_states`' states when asked) one prefill chunk
        at a time: ([n, vocab], [layers, n, hidden] or None) for consecutive rows, so two arms are
        compared over a long sequence holding a chunk of each."""
        if not layer_states:
            yield from ((rows, None) for rows in self.engine.score_chunks(token_ids))
            return
        layers = self.engine.model.model.layers
        captured: list[torch.Tensor | None] = [None] * len(layers)

        def capture(index: int):
            def hook(_module, _args, output: tuple[torch.Tensor, torch.Tensor]) -> None:
                hidden, residual = output  # a decoder layer's output is their sum (the norms fuse the add)
                captured[index] = (hidden + residual).float()
            return hook

        handles = [layer.register_forward_hook(capture(i)) for i, layer in enumerate(layers)]
        try:
            for rows in self.engine.score_chunks(token_ids):
                yield rows, torch.stack(captured)
        finally:
            for handle in handles:
                handle.remove()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's `LLM.reset_prefix_cache`), so a repeated run starts cold.

        Returns False, changing nothing, while a request still holds blocks.
        """
        return self.engine.block_manager.reset_prefix_cache()


def _prompt_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[str | list[int]]:
    """A prompt or a list of them, each as text or token ids."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_prompt_of(p) for p in prompts]


def _prompt_of(prompt: PromptInput) -> str | list[int]:
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")


def _text_message(message: dict) -> dict:
    """A chat message whose content is OpenAI's list of text parts, as one string (vLLM's "string"
    content format joins them with newlines)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
        raise ValueError("message content parts must be text ({'type': 'text', 'text': ...}); this engine reads no "
                         "images or audio")
    return {**message, "content": "\n".join(str(part.get("text", "")) for part in content)}
