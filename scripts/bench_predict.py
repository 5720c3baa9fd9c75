"""Inference over a collection on XLA:CPU, three ways: packed torchattn (python -m train predict), transformers'
pipeline with sdpa in padded batches, and torchattn in padded batches without packing. Writes
docs/bench/predict-xla-cpu.csv and prints it as a table.

    PJRT_DEVICE=CPU .venv/bin/python scripts/bench_predict.py                 # the subsets below, ~15 min
    PJRT_DEVICE=CPU .venv/bin/python scripts/bench_predict.py --bbc 425 --paragraphs 300 --addresses 30
    PJRT_DEVICE=CPU .venv/bin/python scripts/bench_predict.py --ways "packed torchattn" --out /tmp/packed.csv

Collections (a subset each, by default, to keep the run short; the CSV says which):
- bbc: the first --bbc articles of BBC News' held-out split (train/build.py's load_splits, seed 0), classified by
  MiniLM with a new 5-label head (random, seed 0: the labels mean nothing, the work is a classifier's), 512 tokens
  at most;
- sotu-skewed: --paragraphs State of the Union paragraphs mixed (seed 0) with --addresses whole addresses, scored
  by SmolLM2-135M (log-likelihood), 1024 tokens at most (an address is cut there: every way reads the same tokens).

Each (collection, way) runs in a process of its own, timed from the first document in to the last result out
(tokenizing, packing or padding, compiling, running, reading the results back; not loading the model), so
compilations count where they happen: the pipeline pads each batch of --batch-size documents to its longest and
XLA compiles every new length; unpacked torchattn pads to power-of-two buckets (as training does); packed rows
(--batch-tokens in SETTINGS) have one shape. tokens/s counts the documents' tokens; padding share is
the padding among all tokens run. diff_vs_packed: the largest difference of a document's result from the packed
run's (classification: probability; sotu-skewed: relative log-likelihood). tiles_visited (packed way): the share of
the attention's (query block, key block) tiles over the packed rows that the run's kernels compute, at the blocks a
call with segment ids takes off a TPU (BlockSizes.PACKED_OFF_TPU); the others pair different documents, or lie
outside the causal band, and are skipped. It is the documents' mask block density (torchattn.aot.documents, from
the documents' intervals), which the kernels' visited tiles equal (tests/test_aot_documents.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WAYS = ("packed torchattn", "pipeline sdpa", "unpacked torchattn")
FIELDS = ("collection", "model", "way", "documents", "tokens", "tokens_run", "padding_share", "seconds",
          "tokens_per_s", "compiles", "compiles_after_first_batch", "tiles_visited", "diff_vs_packed", "subset")
# Packed rows: twice MiniLM's longest document (articles of 200-500 tokens pack two to four a row); SmolLM2's longest
# (an address fills a row, paragraphs pack around each other; attention on XLA:CPU costs the row's length squared).
SETTINGS = {"bbc": dict(model="minilm", task="classification", max_length=512, batch_tokens=1024),
            "sotu-skewed": dict(model="smollm2-135m", task="lm", max_length=1024, batch_tokens=1024)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bbc", type=int, default=64, help="BBC News held-out articles")
    parser.add_argument("--paragraphs", type=int, default=40, help="State of the Union paragraphs")
    parser.add_argument("--addresses", type=int, default=4, help="whole State of the Union addresses")
    parser.add_argument("--batch-size", type=int, default=8, help="documents per padded batch")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), metavar="WAY",
                        help=f"the ways to run, of {', '.join(map(repr, WAYS))} (default: all; the packed way is "
                             "the others' reference, diff_vs_packed)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "predict-xla-cpu.csv"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # collection, way, scratch folder
    args = parser.parse_args(argv)
    if args.child:
        return _child(args, *args.child)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_predict-") as scratch:
        for collection in SETTINGS:
            _write_collection(args, collection, scratch)
            for way in args.ways:
                result = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", collection, way, scratch],
                                        cwd=ROOT, capture_output=True, text=True)
                if result.returncode != 0:
                    sys.exit(f"{collection}, {way} failed:\n{result.stderr[-3000:]}")
                rows.append(json.loads(result.stdout.splitlines()[-1]))
                print(_line(rows[-1]), flush=True)
            if WAYS[0] in args.ways:
                _compare(rows[-len(args.ways):], scratch, collection)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print("\n".join(_line(row) for row in rows))
    print(f"written: {args.out}")
    return 0


def _write_collection(args, collection: str, scratch: str) -> None:
    """The collection's documents as <scratch>/<collection>.jsonl (id, text), and its subset's description."""
    from train.build import load_splits
    from train.data import sources

    if collection == "bbc":
        held_out = load_splits("bbc-news", task="classification", text_column=None, label_column=None,
                               eval_fraction=0.2, seed=0)["eval"]
        documents = [{"id": i, "text": text} for i, text in enumerate(held_out["text"][:args.bbc])]
        subset = f"first {len(documents)} of the {len(held_out)} held-out articles"
    else:
        speeches = sources.open_source("sotu")["train"]
        order = list(range(len(speeches)))
        rng = random.Random(0)
        rng.shuffle(order)
        documents = [{"id": speeches["fileid"][i], "text": speeches["text"][i]} for i in order[:args.addresses]]
        paragraphs = [{"id": f"{speeches['fileid'][i]}#{k}", "text": text} for i in order[args.addresses:]
                      for k, text in enumerate(p for p in speeches["text"][i].split("\n\n") if p.strip())]
        documents += paragraphs[:args.paragraphs]
        rng.shuffle(documents)
        subset = f"{args.paragraphs} paragraphs and {args.addresses} whole addresses, shuffled (seed 0)"
    with open(os.path.join(scratch, f"{collection}.jsonl"), "w") as f:
        f.writelines(json.dumps(document) + "\n" for document in documents)
    with open(os.path.join(scratch, f"{collection}.subset"), "w") as f:
        f.write(subset)


def _model_folder(collection: str, scratch: str) -> str:
    """The model the collection runs: MiniLM saved with a new 5-label head (seed 0), or SmolLM2 itself."""
    if collection != "bbc":
        return SETTINGS[collection]["model"]
    folder = os.path.join(scratch, "minilm-5-labels")
    if not os.path.isdir(folder):
        import torch

        from train import models

        torch.manual_seed(0)
        model, tokenizer = models.load_model("minilm", task="classification", num_labels=5, attn="eager",
                                             label_names=["a", "b", "c", "d", "e"])
        models.save_model(model, tokenizer, folder)
    return folder


def _child(args, collection: str, way: str, scratch: str) -> int:
    from train.runtime import compile_count

    settings = SETTINGS[collection]
    source = os.path.join(scratch, f"{collection}.jsonl")
    with open(source) as f:
        texts = [json.loads(line)["text"] for line in f]
    model = _model_folder(collection, scratch)
    runner = {"packed torchattn": _packed, "pipeline sdpa": _pipeline, "unpacked torchattn": _unpacked}[way]
    before = compile_count()
    measured = runner(model, settings, texts, source, args.batch_size, os.path.join(scratch, f"{collection}-{way}"))
    with open(os.path.join(scratch, f"{collection}.subset")) as f:
        subset = f.read()
    tokens, run = measured["tokens"], measured["tokens_run"]
    print(json.dumps({"collection": collection, "model": settings["model"], "way": way, "documents": len(texts),
                      "tokens": tokens, "tokens_run": run, "padding_share": round(1 - tokens / run, 4),
                      "seconds": round(measured["seconds"], 1), "tokens_per_s": round(tokens / measured["seconds"], 1),
                      "compiles": compile_count() - before, "compiles_after_first_batch": measured["compiles_after"],
                      "tiles_visited": measured.get("tiles_visited", ""), "diff_vs_packed": "", "subset": subset}))
    return 0


def _packed(model: str, settings: dict, texts: list[str], source: str, batch_size: int, out: str) -> dict:
    """python -m train predict's own run (train/predict/job.py), on one device."""
    from train.predict.config import PredictConfig
    from train.predict.job import Job

    job = Job(PredictConfig(model=model, input=source, output=f"{out}.jsonl", task=settings["task"],
                            max_length=settings["max_length"], batch_tokens=settings["batch_tokens"], mesh=None))
    compiled = []  # graphs each step compiled (the run's own CompileWatch)
    watch = job.runner.compiles.after
    job.runner.compiles.after = lambda *step: compiled.append(watch(*step)) or compiled[-1]
    positions = []  # each step's packed rows, as the runner gets them
    run = job.runner.run

    def recorded(steps):
        for key, batch in steps:
            positions.append(batch["position_ids"])
            yield key, batch
    job.runner.run = lambda steps: run(recorded(steps))
    started = time.perf_counter()
    try:
        summary = job.run()
    finally:
        job.close()
    seconds = time.perf_counter() - started
    _save_results(out, [_value(row, settings["task"]) for row in _jsonl(f"{out}.jsonl")])
    return {"seconds": seconds, "tokens": summary["tokens"], "compiles_after": sum(compiled[1:]),
            "tokens_run": round(summary["tokens"] / (1 - summary["padding_share"])),
            "tiles_visited": round(_tiles_visited(np.concatenate(positions), job.runner.causal,
                                                  job.runner.model.config), 4)}


def _tiles_visited(positions: np.ndarray, causal: bool, model_config) -> float:
    """The share of the (query block, key block) tiles of packed rows (their ``positions``) that hold a pair of one
    document inside the causal band, at the blocks a call with segment ids takes off a TPU."""
    import torch

    from patches.masks import document_ids
    from torchattn.aot import Attention, documents
    from torchattn.kernels.block_sizes import BlockSizes

    text_config = model_config.get_text_config()
    heads = text_config.num_attention_heads
    length = positions.shape[1]
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    attention = Attention(batch=1, q_heads=heads, kv_heads=heads, q_len=length, kv_len=length, head_dim=head_dim,
                          causal=causal, segments=True)
    blocks = BlockSizes.default(length, length, attention.head_dim, packed=True)
    shares = []
    for ids in document_ids(torch.from_numpy(positions)).numpy():
        lengths = np.diff(np.flatnonzero(np.diff(ids, prepend=-1, append=-1))).tolist()
        shares.append(documents.mask_block_density(attention, lengths, blocks.block_q, blocks.block_kv))
    return float(np.mean(shares))


def _pipeline(model: str, settings: dict, texts: list[str], source: str, batch_size: int, out: str) -> dict:
    """transformers' pipeline on the XLA device, sdpa, --batch-size documents padded to the longest of each batch."""
    import torch_xla
    import transformers

    from train import models

    config, where, load = models.pretrained_config(model)
    tokenizer = models.load_tokenizer(model, where, load)
    auto = transformers.AutoModelForSequenceClassification if settings["task"] == "classification" \
        else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(where, attn_implementation="sdpa", **load).eval()
    loaded.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"  # positions count from each document's first token, as packed
    counter = _BatchCounter(loaded, tokenizer, texts, settings["max_length"])
    arguments = dict(truncation=True, max_length=settings["max_length"])
    if settings["task"] == "classification":
        pipe = transformers.pipeline("text-classification", model=loaded, tokenizer=tokenizer,
                                     device=torch_xla.device(), top_k=None)
    else:
        pipe = _scoring_pipeline(loaded, tokenizer, torch_xla.device())
    started = time.perf_counter()
    results = list(pipe(texts, batch_size=batch_size, **arguments))
    seconds = time.perf_counter() - started
    if settings["task"] == "classification":
        labels = [config.id2label[i] for i in range(config.num_labels)]
        values = [[next(r["score"] for r in result if r["label"] == label) for label in labels] for result in results]
    else:
        values = [result["log_likelihood"] for result in results]
    _save_results(out, values)
    return {"seconds": seconds, **counter.totals()}


def _unpacked(model: str, settings: dict, texts: list[str], source: str, batch_size: int, out: str) -> dict:
    """torchattn without packing: --batch-size documents padded to the smallest power-of-two bucket that holds the
    batch's longest (train/tasks/classification.py's buckets), with an attention mask."""
    import numpy as np
    import torch
    import torch_xla

    from train import models
    from train.models import model_outputs
    from train.tasks.classification import length_buckets

    loaded, tokenizer = models.load_model(model, task=settings["task"], num_labels=None if settings["task"] == "lm"
                                          else models.pretrained_config(model)[0].num_labels, attn="torchattn",
                                          label_names=None)
    device = torch_xla.device()
    loaded = loaded.eval().to(device)
    tokenizer.padding_side = "right"  # positions count from each document's first token, as packed
    counter = _BatchCounter(loaded, tokenizer, texts, settings["max_length"])
    buckets = length_buckets(settings["max_length"])
    started = time.perf_counter()
    values = []
    for first in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[first:first + batch_size], truncation=True, max_length=settings["max_length"])
        longest = max(map(len, encoded["input_ids"]))
        padded = tokenizer.pad(encoded, padding="max_length", max_length=next(b for b in buckets if b >= longest),
                               return_tensors="pt")
        inputs = {name: padded[name].to(device) for name in ("input_ids", "attention_mask")}
        with torch.no_grad():
            if settings["task"] == "classification":
                values += model_outputs(loaded, inputs).logits.float().softmax(-1).cpu().tolist()
            else:
                values += _log_likelihoods(loaded, inputs).cpu().tolist()
    seconds = time.perf_counter() - started
    _save_results(out, np.asarray(values).tolist())
    return {"seconds": seconds, **counter.totals()}


def _log_likelihoods(model, inputs):
    """(batch,) each padded row's log-likelihood: the packed run's per-token log-probabilities (train/tasks/lm.py's
    Head) summed over the row's real tokens (the first token's is 0)."""
    from train.tasks.lm import Head

    return (Head(model.config).outputs(model, inputs) * inputs["attention_mask"]).sum(-1)


class _BatchCounter:
    """The documents' tokens (counted on the host, before the clock starts), the tokens a model is run on (its
    inputs' shapes) and the graphs compiled after its first batch (counted at its second call: the pipeline and
    the loop above both read a batch's results before they run the next)."""

    def __init__(self, model, tokenizer, texts: list[str], max_length: int):
        from train.runtime import compile_count

        self.tokens = sum(map(len, tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]))
        self.run = 0
        self.first = None

        def before(module, args, kwargs):
            if self.run and self.first is None:
                self.first = compile_count()
            self.run += kwargs["input_ids"].numel()

        model.register_forward_pre_hook(before, with_kwargs=True)

    def totals(self) -> dict:
        from train.runtime import compile_count

        return {"tokens": self.tokens, "tokens_run": self.run,
                "compiles_after": compile_count() - (self.first if self.first is not None else compile_count())}


def _scoring_pipeline(model, tokenizer, device):
    """A pipeline of a causal LM's log-likelihood of each text, in transformers' own pipeline machinery (its
    batching and padding): transformers has no scoring pipeline."""
    import transformers

    class ScoringPipeline(transformers.Pipeline):
        def _sanitize_parameters(self, truncation=None, max_length=None, **kwargs):
            return {"truncation": truncation, "max_length": max_length}, {}, {}

        def preprocess(self, text, truncation=None, max_length=None):
            return self.tokenizer(text, truncation=truncation, max_length=max_length, return_tensors="pt")

        def _forward(self, inputs):
            return {"log_likelihood": _log_likelihoods(self.model, inputs)}

        def postprocess(self, outputs):
            return {"log_likelihood": float(outputs["log_likelihood"].reshape(-1)[0])}

    return ScoringPipeline(model=model, tokenizer=tokenizer, device=device)


def _value(row: dict, task: str):
    return list(row["probabilities"].values()) if task == "classification" else row["log_likelihood"]


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _save_results(out: str, values: list) -> None:
    with open(f"{out}.values.json", "w") as f:
        json.dump(values, f)


def _compare(rows: list[dict], scratch: str, collection: str) -> None:
    """diff_vs_packed of each way's row: its results against the packed run's."""
    import numpy as np

    def values(way):
        with open(os.path.join(scratch, f"{collection}-{way}.values.json")) as f:
            return np.asarray(json.load(f), dtype=np.float64)

    packed = values(WAYS[0])
    for row in rows:
        other = values(row["way"])
        difference = np.abs(other - packed) if collection == "bbc" else np.abs(other - packed) / np.abs(packed)
        row["diff_vs_packed"] = f"{difference.max():.1e}"


def _line(row: dict) -> str:
    return (f"{row['collection']:<12} {row['way']:<19} {row['documents']:>4} docs {row['tokens']:>7} tokens "
            f"padding {row['padding_share']:>6.1%} {row['seconds']:>7.1f} s {row['tokens_per_s']:>8.1f} tokens/s "
            f"compiles {row['compiles']:>3} (after the first batch {row['compiles_after_first_batch']:>3}) "
            f"diff {row['diff_vs_packed'] or '-'}"
            + (f" tiles visited {row['tiles_visited']:.1%}" if row["tiles_visited"] != "" else ""))


if __name__ == "__main__":
    sys.exit(main())
