"""How a model's pooled outputs become what clients get: embeddings, class probabilities, scores.

An embedding checkpoint saved by sentence-transformers lists its modules in `modules.json`
(a Pooling module with its `config.json`, Dense projections after it in some, often a Normalize
module); a model without them is pooled as vLLM pools decoder models by default: the last token's
final hidden state, L2-normalized. A module this engine would not apply is refused, not skipped.
A sequence classifier (`*ForSequenceClassification`) pools its last token through its score
head; its config.json names the classes and whether they exclude each other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))
# sentence-transformers' Dense activations, by the class name its config.json gives
_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": torch.tanh, "GELU": torch.nn.functional.gelu,
                "ReLU": torch.relu, "Sigmoid": torch.sigmoid}
_APPLIED_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")


@dataclass(frozen=True, slots=True)
class Dense:
    """A sentence-transformers Dense module: activation(W · pooled + b)."""

    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None
    activation: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        return _ACTIVATIONS[self.activation](y)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    pooling: str = "last"  # "last", "mean" or "cls"
    normalize: bool = True
    dense: tuple[Dense, ...] = ()  # projections of the pooled state, in order

    def width(self, pooled_width: int) -> int:
        """How many values an embedding has, from a pooled state of `pooled_width`."""
        return self.dense[-1].weight.shape[0] if self.dense else pooled_width

    def embedding(self, pooled: list[float], normalize: bool | None = None,
                  dimensions: int | None = None) -> list[float]:
        """The embedding a client gets: the pooled state through the Dense projections, its first
        `dimensions` values (Matryoshka models), then L2-normalized (as the model says unless
        `normalize` does)."""
        vector = torch.tensor(pooled, dtype=torch.float32)
        for layer in self.dense:
            vector = layer(vector)
        if dimensions:
            vector = vector[:dimensions]
        if self.normalize if normalize is None else normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()


def _read_json(path: Path, what: str) -> dict | list:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} ({what}) is not valid JSON: {exc}") from None
    except FileNotFoundError:
        raise ValueError(f"{path} ({what}) is missing") from None


def _dense(folder: Path) -> Dense:
    """One Dense module's weights and activation (model.safetensors, or pytorch_model.bin)."""
    config = _read_json(folder / "config.json", "sentence-transformers Dense")
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{folder}: a Dense activation {activation!r}; driftgate applies "
                         f"{', '.join(_ACTIVATIONS)}")
    from safetensors.torch import load_file

    files = [f for f in (folder / "model.safetensors", folder / "pytorch_model.bin") if f.is_file()]
    if not files:
        raise ValueError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")
    try:
        weights = (load_file(files[0]) if files[0].suffix == ".safetensors"
                   else torch.load(files[0], map_location="cpu", weights_only=True))
        bias = weights["linear.bias"].float() if config.get("bias", True) else None
        return Dense(weights["linear.weight"].float(), bias, activation)
    except Exception as exc:  # noqa: BLE001 — a damaged file fails in the reader's own way; say which file
        raise ValueError(f"{files[0]}: cannot read the Dense weights ({type(exc).__name__}: {exc})") from None


def pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The model's pooling (sentence-transformers' modules.json, its Pooling config and Dense
    modules), else last-token + normalize; a module or mode it would not apply is a ValueError."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig()
    from engine.loader import read_config

    modules = _read_json(modules_path, "sentence-transformers modules")
    pooling, dense, normalize = "last", [], False
    for module in modules:
        kind, folder = module.get("type", "").rsplit(".", 1)[-1], model_dir / module.get("path", "")
        if kind not in _APPLIED_MODULES:
            raise ValueError(f"{modules_path} lists a {kind or 'nameless'} module; driftgate applies "
                             f"{', '.join(_APPLIED_MODULES)} only, and would answer without it")
        if kind == "Pooling":
            pooling = _pooling_mode(folder, model_dir)
        elif kind == "Dense":
            dense.append(_dense(folder))
            takes = dense[-1].weight.shape[1]
            given = dense[-2].weight.shape[0] if len(dense) > 1 else read_config(model_dir).get("hidden_size")
            if given is not None and takes != given:
                raise ValueError(f"{folder}: a Dense module taking {takes} values where {given} come")
        elif kind == "Normalize":
            normalize = True
    return PoolingConfig(pooling, normalize, tuple(dense))


def _pooling_mode(folder: Path, model_dir: Path) -> str:
    config = _read_json(folder / "config.json", "sentence-transformers pooling")
    chosen = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    modes = dict(_MODES)
    if len(chosen) != 1 or chosen[0] not in modes:
        raise ValueError(f"{model_dir}: pooling config asks for {chosen or 'no mode'}; driftgate pools by "
                         "exactly one of lasttoken, mean_tokens, cls_token")
    if config.get("include_prompt") is False:
        raise ValueError(f"{model_dir}: pooling config leaves the prompt out of the pooled tokens "
                         "(include_prompt false), which driftgate does not do")
    return modes[chosen[0]]


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    labels: tuple[str, ...]  # class names, in the score head's row order
    multi_label: bool = False  # HF's problem_type "multi_label_classification": classes do not exclude each other

    def probabilities(self, logits: list[float]) -> list[float]:
        """Class probabilities, as HF's text-classification pipeline and vLLM give them: a softmax
        over exclusive classes, a sigmoid each for one class (a cross-encoder's relevance) or multi-label."""
        values = torch.tensor(logits, dtype=torch.float32)
        if self.multi_label or len(self.labels) == 1:
            return torch.sigmoid(values).tolist()
        return torch.softmax(values, dim=0).tolist()

    def most_probable(self, probs: list[float]) -> str:
        return self.labels[max(range(len(probs)), key=probs.__getitem__)]


@dataclass(slots=True)
class ClassificationOutput:
    """One prompt's classification: its class logits and probabilities (LLM.classify's `.outputs`)."""

    logits: list[float]
    probs: list[float]
    labels: tuple[str, ...]
    label: str  # the most probable class

    @property
    def num_classes(self) -> int:
        return len(self.probs)


def classifier_config(hf_config: dict) -> ClassifierConfig | None:
    """The classes of a sequence classifier's config.json, None for any other model."""
    from engine.models.llama import classifier_labels

    labels = classifier_labels(hf_config)
    return ClassifierConfig(labels, hf_config.get("problem_type") == "multi_label_classification") if labels else None


def pair_token_ids(tokenizer, first: str, second: str) -> list[int]:
    """A cross-encoder's input for a text pair: the tokenizer's own pair encoding (its special
    tokens and separators), as sentence-transformers' CrossEncoder and vLLM's score API build it."""
    return tokenizer(first, second)["input_ids"]


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one first text (or a list of one) pairs with every second; lists of
    equal length pair in order."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
                         "or as many as text_2")
    return list(zip(first, second, strict=True))


@dataclass(slots=True)
class ScorePlan:
    """How text pairs are scored, as vLLM's score API does: a one-class sequence classifier (a
    cross-encoder reranker) reads each pair as one input and its sigmoid is the score; an embedding
    model embeds each distinct text once and scores a pair by the cosine of its two embeddings."""

    prompts: list[list[int]]  # the token ids to pool, each with `pooling`
    pooling: str
    pair_rows: list[tuple[int, int]] | None  # embedding models: each pair's rows of `prompts`
    classifier: ClassifierConfig | None
    embedder: PoolingConfig | None = None  # embedding models: how a pooled state becomes an embedding

    @classmethod
    def build(cls, pairs: list[tuple[str, str]], tokenizer, classifier: ClassifierConfig | None,
              pooling: PoolingConfig) -> ScorePlan:
        if classifier is not None:
            if len(classifier.labels) != 1:
                raise ValueError(f"scoring needs a one-class classifier (a cross-encoder); this one has "
                                 f"{len(classifier.labels)} classes: classify instead")
            return cls([pair_token_ids(tokenizer, a, b) for a, b in pairs], "last", None, classifier)
        texts = sorted({text for pair in pairs for text in pair})
        row = {text: i for i, text in enumerate(texts)}
        return cls([tokenizer.encode(text) for text in texts], pooling.pooling,
                   [(row[a], row[b]) for a, b in pairs], None, pooling)

    def pair_token_ids(self) -> list[list[int]]:
        """What each pair was scored from: the cross-encoder's input, or the two texts' ids."""
        if self.pair_rows is None:
            return self.prompts
        return [self.prompts[a] + self.prompts[b] for a, b in self.pair_rows]

    def scores(self, pooled: list[list[float]]) -> list[float]:
        """One score per pair, from the pooled outputs of `prompts` in order."""
        if self.classifier is not None:
            return [self.classifier.probabilities(logits)[0] for logits in pooled]
        vectors = torch.tensor([self.embedder.embedding(p, normalize=False) for p in pooled])
        return [torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0).item()
                for a, b in self.pair_rows]
