"""What an output was predicted from: the model, the documents and the settings that change a row.

``python -m train predict`` writes it once, as ``<output>.predict/manifest.json``, before the first
shard, and compares it with the run's own before anything else: the same output path with another
model, other documents or other settings is refused (one line, exit 2), the same one resumes.
"""

from __future__ import annotations

import hashlib
import json
import os

from ..checkpoint import durable
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
    changed = (_model_change(saved["model"], own["model"]) or _documents_change(saved["input"], own["input"])
               or _settings_change(saved["settings"], own["settings"]))
    if changed:
        raise ConfigError(f"--output: {output} {changed}; {start_over}")


def _model_change(saved: dict, own: dict) -> str | None:
    """How the output's model differs from --model, in words; None when it does not."""
    if saved["sha256"] == own["sha256"]:
        return None
    if saved["name"] == own["name"]:
        return f"holds predictions of --model {own['name']!r} as its files were: they changed since"
    return f"holds predictions of another model ({saved['name']!r}, not --model {own['name']!r})"


def _documents_change(saved: dict, own: dict) -> str | None:
    """How the output's documents differ from --input's, in words; None when they do not."""
    if saved["sha256"] == own["sha256"]:
        return None
    if saved["source"] != own["source"]:
        return (f"holds predictions for other documents ({saved['documents']} from {saved['source']!r}, not the "
                f"{own['documents']} of --input {own['source']!r})")
    if saved["documents"] != own["documents"]:
        return (f"holds predictions for --input {own['source']!r} as it was: it had {saved['documents']} documents, "
                f"it has {own['documents']} now")
    return (f"holds predictions for --input {own['source']!r} as it was: the texts or ids of its {own['documents']} "
            "documents changed since")


def _settings_change(saved: dict, own: dict) -> str | None:
    """The settings the output was written with and this run's, where they differ, in words; None when none do."""
    changed = [name for name in SETTINGS if saved.get(name) != own[name]]
    if not changed:
        return None

    def words(settings: dict) -> str:  # "--max-length 64"; "no --stride" for one not set (no windows cut)
        said = [(f"--{name.replace('_', '-')}", settings.get(name)) for name in changed]
        return " and ".join(f"no {flag}" if value is None else f"{flag} {value}" for flag, value in said)

    return f"is written with {words(saved)}, not {words(own)}"
