"""What an output was predicted from: the model, the documents and the settings that change a row.

``python -m train predict`` writes it once, as ``<output>.predict/manifest.json``, before the first
shard, and compares it with the run's own before anything else: the same output path with another
model, other documents or other settings is refused (one line, exit 2), the same one resumes.
"""

from __future__ import annotations

import hashlib
import json
import os

from .. import durable
from ..config import ConfigError

FILE = "manifest.json"
VERSION = 1
# Settings that change what a row says; the others (--batch-tokens, --mesh, --attn) only how fast it comes.
SETTINGS = ("task", "max_length", "long", "stride", "text_column", "shard_size")


def model_fingerprint(model: str, where: str, load: dict) -> str:
    """SHA-256 of the model's files: a .gguf file, or every file of a local folder (names and contents); for a
    hub id, the id itself (its files are the hub's)."""
    if load.get("gguf_file"):
        files = [os.path.join(where, load["gguf_file"])]
    elif os.path.isdir(where):
        files = sorted(os.path.join(where, name) for name in os.listdir(where)
                       if os.path.isfile(os.path.join(where, name)))
    else:
        return f"hub:{model}"
    digest = hashlib.sha256()
    for path in files:
        digest.update(os.path.basename(path).encode() + b"\0" + durable.sha256_file(path).digest())
    return digest.hexdigest()


def manifest(*, model: str, model_sha256: str, source: str, documents: int, input_sha256: str, settings: dict,
             shards: int) -> dict:
    """The manifest of a run (``settings``: SETTINGS' values)."""
    return {"version": VERSION, "model": {"name": model, "sha256": model_sha256},
            "input": {"source": source, "documents": documents, "sha256": input_sha256},
            "settings": {name: settings[name] for name in SETTINGS}, "shards": shards}


def read(folder: str) -> dict | None:
    """The manifest in ``folder``, or None when there is none."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--output: cannot read {path}: {error}") from None


def write(folder: str, content: dict) -> None:
    """Writes the manifest into ``folder`` (made if missing), whole or not at all."""
    durable.write_text(os.path.join(folder, FILE), json.dumps(content, indent=2) + "\n")


def check(saved: dict, own: dict, output: str) -> None:
    """ConfigError (one line) unless ``saved`` (the output's manifest) was written for the run ``own`` is."""
    folder = f"{output}.predict"
    start_over = f"pick another --output, or remove {output} and {folder} to start over"
    if saved.get("version") != VERSION:
        raise ConfigError(f"--output: {folder} was written by another version of python -m train predict; "
                          + start_over)
    if saved["model"]["sha256"] != own["model"]["sha256"]:
        raise ConfigError(f"--output: {output} holds predictions of another model ({saved['model']['name']!r}, not "
                          f"--model {own['model']['name']!r}); " + start_over)
    if saved["input"]["sha256"] != own["input"]["sha256"]:
        raise ConfigError(f"--output: {output} holds predictions for other documents ({saved['input']['documents']} "
                          f"from {saved['input']['source']!r}, not the {own['input']['documents']} of --input "
                          f"{own['input']['source']!r}); " + start_over)
    changed = [name for name in SETTINGS if saved["settings"].get(name) != own["settings"][name]]
    if changed:
        raise ConfigError("--output: " + "; ".join(
            f"--{name.replace('_', '-')} {own['settings'][name]!r} differs from the {saved['settings'].get(name)!r} "
            f"{output} is written with" for name in changed) + "; " + start_over)
