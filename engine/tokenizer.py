"""Tokenizer loading (HF fast tokenizers from the model folder, never from the hub)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The folder's tokenizer, loaded offline; a clear error when it has none."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json / tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError) as exc:  # a damaged tokenizer.json's JSON error names no file
        raise ValueError(f"cannot load the tokenizer in {path}: {exc}") from None


def render_chat(tokenizer, conversation: list[dict], chat_template: str | None = None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
    """A conversation as prompt text under `chat_template` (default: the tokenizer's). A template
    that refuses it (jinja's raise_exception: roles must alternate, and such) is a ValueError."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; give one, or prompt with plain text")
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja's errors and the template's own raise_exception
        raise ValueError(f"chat template failed: {exc}") from None
