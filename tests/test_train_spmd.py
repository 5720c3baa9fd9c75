"""python -m train --mesh: the trainer under torch_xla SPMD on 4 (and 2) virtual XLA:CPU devices.

The runs with a mesh are subprocesses (SPMD must be on before anything touches the XLA device;
this pytest process is single-device); their single-device twins run here. Equivalence: with
dropout off, a run over a mesh (data=2 x fsdp=2, data=2 x model=2, fsdp=2 x context=2 with the
tokens in the balanced order, or the default fsdp over every device) logs the
same loss at every step as the single-device run with the same flags and global batch.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
import transformers

import train_tiny
from torchattn import balanced_order
from train.__main__ import main
from train.data.batches import host_rows
from train.metrics import MetricsFile
from train.data.packing import IGNORE_INDEX
from train.runtime import default_mesh
from train.runtime.torch_xla import parameter_spec
from train.tasks import classification, lm
from train.models import model_outputs

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = ["--mesh", "data=2,fsdp=2"]
# Each step's loss on a mesh against one device: the tiny models' runs match exactly; MiniLM, when it ran here,
# differed by up to 1.5e-7. 1e-6 leaves a margin of about 7x, some 8 float32 roundings of a loss near 1: a wrong
# gradient reduction or batch split is far above it.
REL = 1e-6


def run_spmd(args: list[str], timeout: float = 600, devices: int = 4, **env) -> subprocess.CompletedProcess:
    """``python <args>`` from the repository root with ``devices`` virtual XLA:CPU devices."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), XLA_COMPILATION_CACHE_SIZE="8", **env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def losses(output_dir) -> list[float]:
    return [r["loss"] for r in MetricsFile(str(output_dir)).read() if "loss" in r]


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# --- which rows each host reads ---------------------------------------------------------------------

def test_each_host_reads_its_consecutive_block_of_the_global_batch():
    assert [host_rows(8, host, 2) for host in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [host_rows(12, host, 4) for host in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert host_rows(16, 0, 1) == slice(0, 16), "one host reads the whole batch"


@pytest.mark.parametrize("batch_size, host, hosts, message", [
    (8, 0, 3, "hosts: expected a positive int dividing batch_size 8, got 3"),
    (8, 2, 2, "host: expected an int in [0, 2), got 2"),
    (8, 0, 0, "hosts: expected a positive int dividing batch_size 8, got 0"),
])
def test_host_rows_refuses_a_split_that_does_not_exist(batch_size, host, hosts, message):
    with pytest.raises(ValueError) as error:
        host_rows(batch_size, host, hosts)
    assert str(error.value) == message


def _classification_rows() -> datasets.Dataset:
    # 10 rows; row 7 is the only one longer than 64 tokens.
    ids = [list(range(1, 6 + i)) for i in range(10)]
    ids[7] = list(range(1, 100))
    return datasets.Dataset.from_dict({"input_ids": ids, "label": [i % 3 for i in range(10)]})


def _lm_rows() -> datasets.Dataset:
    rows = np.arange(10 * 8).reshape(10, 8)
    return datasets.Dataset.from_dict({"input_ids": rows.tolist(), "position_ids": (rows % 8).tolist(),
                                       "labels": rows.tolist()})


@pytest.mark.parametrize("rows, task", [(_classification_rows, classification), (_lm_rows, lm)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_host_parts_put_together_are_the_global_batch(rows, task, drop_last):
    dataset = rows()
    loader = dict(batch_size=4, buckets=(64, 128), pad_id=0, shuffle=True, seed=3, drop_last=drop_last)
    whole = list(task.batches(dataset, **loader).epoch(1))
    parts = [list(task.batches(dataset, host=host, hosts=2, **loader).epoch(1)) for host in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole)
    for index, batch in enumerate(whole):
        for name, tensor in batch.items():
            first, second = parts[0][index][name], parts[1][index][name]
            assert first.shape[0] == second.shape[0] == 2, name
            # Same length on both hosts, chosen by the global batch's longest row.
            assert np.array_equal(np.concatenate([first, second]), tensor), (index, name)


def test_a_host_pads_its_rows_to_the_global_batchs_length_bucket():
    loader = classification.batches(_classification_rows(), batch_size=10, buckets=(64, 128), pad_id=0, shuffle=False,
                                    seed=0, drop_last=True, host=0, hosts=2)
    (batch,) = loader.epoch(0)
    assert batch["input_ids"].shape == (5, 128), "row 7 (99 tokens, host 1's) sets the length of host 0's part too"


# --- the token order of --balance-context ---------------------------------------------------------------

# balanced_order(8, 2), written out: 4 chunks of 2 tokens; device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
ORDER_8_OVER_2 = [0, 1, 6, 7, 2, 3, 4, 5]


def _packed_lm_rows(count: int, length: int, seed: int) -> datasets.Dataset:
    """``count`` rows of random tokens, each two packed documents (positions restart, the second's first
    label ignored) and a few other ignored labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 50, (count, length))
    start = rng.integers(1, length - 1, count)  # where each row's second document starts
    positions = np.where(np.arange(length) < start[:, None], np.arange(length), np.arange(length) - start[:, None])
    labels = np.where(rng.random((count, length)) < 0.2, IGNORE_INDEX, ids)
    labels[np.arange(count), start] = IGNORE_INDEX
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "position_ids": positions.tolist(),
                                       "labels": labels.tolist()})


def test_balanced_batches_are_the_natural_ones_shifted_then_reordered():
    dataset = _packed_lm_rows(6, 8, seed=11)
    loader = dict(batch_size=2, buckets=(8,), pad_id=0, shuffle=True, seed=4, drop_last=True)
    natural = list(lm.batches(dataset, **loader).epoch(1))
    balanced = list(lm.batches(dataset, balance=2, **loader).epoch(1))
    assert len(balanced) == len(natural) == 3
    for plain, reordered in zip(natural, balanced):
        assert sorted(reordered) == ["input_ids", "position_ids", "shift_labels"]
        labels = plain["labels"].numpy()
        next_token = np.concatenate([labels[:, 1:], np.full((2, 1), IGNORE_INDEX)], axis=1)  # t scores token t + 1
        columns = {"input_ids": plain["input_ids"].numpy(), "position_ids": plain["position_ids"].numpy(),
                   "shift_labels": next_token}
        for name, expected in columns.items():
            assert reordered[name].dtype == torch.int64 and reordered[name].shape == (2, 8), name
            assert np.array_equal(reordered[name].numpy(), expected[:, ORDER_8_OVER_2]), name


def test_balance_refuses_rows_it_cannot_reorder():
    with pytest.raises(ValueError) as error:
        classification.batches(_classification_rows(), batch_size=2, buckets=(64, 128), pad_id=0, shuffle=False,
                               seed=0, drop_last=True, balance=2)
    assert str(error.value) == "balance: expected None for classification rows (only LM rows are reordered), got 2"
    with pytest.raises(ValueError, match="expected a multiple of 6, got 8"):
        lm.batches(_lm_rows(), batch_size=2, buckets=(8,), pad_id=0, shuffle=False, seed=0, drop_last=True,
                   balance=3)


def test_a_balanced_batch_has_the_natural_loss_and_token_count():
    """A Llama without layers scores each position from its own token and position only, so reordered
    inputs give reordered logits: the loss of a balanced batch must be the natural batch's, over the same
    tokens (transformers must not shift the already shifted labels again)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(  # initializer_range 1: peaked logits
        vocab_size=50, hidden_size=16, num_hidden_layers=0, num_attention_heads=2, intermediate_size=32,
        initializer_range=1.0))
    dataset = _packed_lm_rows(4, 16, seed=12)
    loader = dict(batch_size=4, buckets=(16,), pad_id=0, shuffle=False, seed=0, drop_last=True)
    (natural,) = lm.batches(dataset, **loader).epoch(0)
    (balanced,) = lm.batches(dataset, balance=2, **loader).epoch(0)
    with torch.no_grad():
        expected, got = model_outputs(model, natural), model_outputs(model, lm.model_inputs(balanced))
        order = balanced_order(16, 2)
        assert torch.equal(got.logits, expected.logits[:, order]), "position-wise: the logits are reordered"
        reshifted = model_outputs(model, {"input_ids": balanced["input_ids"], "position_ids": balanced["position_ids"],
                                          "labels": natural["labels"].index_select(1, order)})
    assert got.loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)
    assert abs(reshifted.loss.item() - expected.loss.item()) > 1e-2, "reordered labels shifted by the model differ"
    counts = []
    for outputs, inputs in ((expected, natural), (got, balanced)):
        evaluation = lm.Evaluation()
        evaluation.add(outputs, inputs)
        counts.append(evaluation._tokens[0].item())
    assert counts[0] == counts[1] == int((natural["labels"][:, 1:] != IGNORE_INDEX).sum())


# --- parameter layout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, fsdp, spec", [
    ((30522, 384), 2, ("fsdp", None)),  # MiniLM's word embeddings: vocabulary split
    ((5, 384), 2, (None, "fsdp")),      # a classifier of 5 labels: 5 is odd, 384 is not
    ((384,), 4, ("fsdp",)),
    ((5,), 2, (None,)),                 # nothing divides: replicated
    ((384, 384), 2, ("fsdp", None)),    # equal dimensions: the first
    ((384, 1536), 2, (None, "fsdp")),   # the largest dimension
    ((384, 384), 1, (None, None)),      # no fsdp axis
])
def test_parameter_spec(shape, fsdp, spec):
    assert parameter_spec(shape, fsdp) == spec


# --- what --mesh auto (the default) decides -----------------------------------------------------------

@pytest.mark.parametrize("devices, batch_size, launched, mesh, note", [
    (1, 16, False, None, None),  # one device: nothing to say
    (4, 16, False, "fsdp=4", "the default on a host with several devices (--mesh none: one device)"),
    (2, 6, False, "fsdp=2", "the default on a host with several devices (--mesh none: one device)"),
    (4, 6, False, None, "none: one of the 4 devices (--batch-size 6 is not a multiple of 4; a multiple trains on "
                        "all of them)"),
    (8, 1, False, None, "none: one of the 8 devices (--batch-size 1 is not a multiple of 8; a multiple trains on "
                        "all of them)"),  # sotu-lm's batch on a v5e-8
    (1, 16, True, None, "none (started by accelerate launch: one device per process)"),
])
def test_default_mesh(devices, batch_size, launched, mesh, note):
    assert default_mesh(devices, batch_size, launched=launched) == (mesh, note)


# --- end to end on several virtual devices -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(bert, docs_csv) -> list[str]:
    """Flags of a cheap run: the tiny BERT on 60 documents, global batch 4, 3 steps, no dropout."""
    return ["--model", bert, "--dataset", docs_csv, "--batch-size", "4", "--max-steps", "3", "--log-steps", "1",
            "--lr", "3e-3", "--eval-batches", "1", "--dropout", "0"]


@pytest.fixture(scope="module")
def tiny_single(tiny, tmp_path_factory) -> list[float]:
    """The per-step losses of ``tiny`` on this process's one device."""
    out = tmp_path_factory.mktemp("tiny") / "one"
    assert main(tiny + ["--output-dir", str(out)]) == 0
    return losses(out)


@pytest.mark.slow
def test_the_default_command_trains_on_every_device_of_the_host(tiny, tiny_single, tmp_path):
    """No --mesh on a host with several devices (a TPU VM with 4 chips runs one process that sees 4):
    fsdp over all of them, said at the start and in the summary, with the single-device losses. (Which
    mesh the default is for other device counts: test_default_mesh.)"""
    devices = 4
    result = run_spmd(["-m", "train", *tiny, "--output-dir", str(tmp_path)], devices=devices)
    assert result.returncode == 0, result.stderr[-3000:]
    mesh = f"fsdp={devices} ({devices} devices, 1 host), the default on a host with several devices " \
           "(--mesh none: one device)"
    lines = result.stdout.splitlines()
    start = lines.index(f"output folder: {tmp_path}")
    assert lines[start + 1] == f"mesh: {mesh}"
    assert [line.split(None, 1)[1] for line in lines[start:] if line.startswith("mesh ")] == [mesh], \
        "the summary names the mesh"
    sharded = losses(tmp_path)
    assert len(sharded) == len(tiny_single) == 3
    print(f"{devices} devices: largest relative loss difference per step "
          f"{largest_relative_difference(sharded, tiny_single):.2e}")
    assert sharded == pytest.approx(tiny_single, rel=REL)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["mesh"] == f"fsdp={devices}", "saved as decided: --resume continues on it"


@pytest.mark.slow
def test_mesh_none_trains_on_one_of_several_devices(tiny, tiny_single, tmp_path):
    """--mesh none on a host with 2 devices: one device, which is not left waiting for the other
    (one step: its loss, taken before any update, is the single-device run's first)."""
    result = run_spmd(["-m", "train", *tiny, "--mesh", "none", "--max-steps", "1", "--output-dir", str(tmp_path)],
                      devices=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stdout.splitlines() if line.startswith("mesh")]
    assert losses(tmp_path) == tiny_single[:1], "the same computation on the same kind of device"


@pytest.mark.slow
def test_a_model_axis_splits_the_batch_over_data_only(tiny, tiny_single, tmp_path):
    """data=2 x model=2: each batch row sits on the 2 devices of its data index; no fsdp axis, so
    every device holds whole parameters. The losses are still the single-device ones."""
    spmd = run_spmd(["tests/spmd_train_probe.py", *tiny, "--mesh", "data=2,model=2",
                     "--output-dir", str(tmp_path / "mesh")])
    assert spmd.returncode == 0, spmd.stderr[-3000:]
    probe = json.loads(spmd.stdout.strip().splitlines()[-1])
    assert probe["losses"] == pytest.approx(tiny_single, rel=REL)
    assert probe["summary"]["mesh"] == "data=2,model=2 (4 devices, 1 host)"
    for name, layout in probe["parameters"].items():
        assert layout["shards"] == [layout["shape"]] * 4, name
    assert probe["batch"]["labels"]["shards"] == [[2]] * 4
    assert [shard[0] for shard in probe["batch"]["input_ids"]["shards"]] == [2] * 4


@pytest.mark.slow
@pytest.mark.parametrize("devices, mesh, seen, flags", [
    (4, "data=3", "4 devices", []), (1, "fsdp=4", "1 device", []),
    # 256 tokens do not split over 3 context devices either: the mesh, the cause, is named, not --max-length.
    (4, "context=3", "4 devices", ["--recipe", "sotu-lm", "--max-length", "256"])])
def test_a_mesh_that_does_not_match_the_devices_stops_before_training(tmp_path, devices, mesh, seen, flags):
    result = run_spmd(["-m", "train", *flags, "--mesh", mesh, "--batch-size", "12", "--output-dir",
                       str(tmp_path / "x")], devices=devices)
    assert result.returncode == 2
    wanted = mesh.split("=")[1]
    assert result.stderr.strip().splitlines()[-1] == (
        f"python -m train: error: --mesh: expected axis sizes whose product is the {seen}, got '{mesh}' (XLA:CPU "
        f"has {wanted} virtual devices with CPU_NUM_DEVICES={wanted})")
    assert not os.path.exists(tmp_path / "x")


# --- torchattn's per-device kernels in training --------------------------------------------------------

def programs(dump: str, stage: str) -> list[str]:
    """The texts of the step and evaluation programs XLA dumped at ``stage`` (not its transfers')."""
    return [open(path).read() for path in sorted(glob.glob(os.path.join(dump, f"*SyncTensorsGraph*{stage}.txt")))]


# A manual-sharding region's input (torchattn.spmd.per_device's _ToLocal) and an all-gather, with the array type
# they make.
MANUAL_INPUT = re.compile(r"= (\w+)\[([\d,]*)\]\S* custom-call\([^)]*\), custom_call_target=\"SPMDFullToShardShape\"")
ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(")


@pytest.mark.slow
def test_the_interpret_backend_runs_attention_per_device_on_a_mesh_with_sharded_state(tiny, tmp_path):
    """data=2 x fsdp=2 with --backend interpret, which runs torchattn's kernels per device under a mesh (on XLA:CPU
    the auto backend is xla, which GSPMD partitions itself), and XLA's dump of every program it compiled: the
    losses are the single-device ones, every parameter, gradient and AdamW moment is split as fsdp splits it, and
    the kernels take each device's rows of q, k and v (tiny BERT: 4 heads of 8, global batch 4 over 4 devices)
    with nothing gathering them. (The default recipe's MiniLM is a BERT too; it is not run on a mesh here.)"""
    flags = tiny + ["--backend", "interpret"]
    assert main(flags + ["--output-dir", str(tmp_path / "one")]) == 0
    dump = str(tmp_path / "dump")
    spmd = run_spmd(["tests/spmd_train_probe.py", *flags, *MESH, "--output-dir", str(tmp_path / "mesh")],
                    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    assert spmd.returncode == 0, spmd.stderr[-3000:]
    probe = json.loads(spmd.stdout.strip().splitlines()[-1])
    one = losses(tmp_path / "one")
    assert len(one) == 3
    difference = largest_relative_difference(probe["losses"], one)
    print(f"interpret backend on a mesh: largest relative loss difference per step {difference:.2e}")
    assert probe["losses"] == pytest.approx(one, rel=REL)
    assert probe["summary"]["mesh"] == "data=2,fsdp=2 (4 devices, 1 host)"
    assert probe["summary"]["compiles_after_warmup"] == 0

    # Each of the 4 devices holds half of a parameter (the fsdp half of its data=2 replica), on the largest
    # dimension 2 divides; gradients and AdamW moments are laid out like their parameter.
    parameters = probe["parameters"]
    expected = {"bert.embeddings.word_embeddings.weight": [15261, 32],  # (30522, 32): MiniLM's vocabulary
                "bert.embeddings.LayerNorm.weight": [16],
                "bert.encoder.layer.0.intermediate.dense.weight": [32, 32],  # (64, 32)
                "classifier.weight": [3, 16],  # 3 topics: odd
                "classifier.bias": [3]}
    for name, shard in expected.items():
        assert parameters[name]["shards"] == [shard] * 4, (name, parameters[name])
    for name, layout in parameters.items():
        assert len(layout["shards"]) == 4, name
        assert layout["grad"] == layout["shards"], name
        assert layout["moments"] == [layout["shards"]] * 2, name
    # The batch: rows split over data x fsdp, one of the 4 per device.
    length = probe["batch"]["input_ids"]["shape"][1]
    assert probe["batch"]["input_ids"] == {"shape": [4, length], "shards": [[1, length]] * 4}
    assert probe["batch"]["labels"]["shards"] == [[1]] * 4

    # Before partitioning, the kernels' region starts where q, k, v (and out's gradient) become per device.
    inputs = [(kind, [int(d) for d in dims.split(",")])
              for text in programs(dump, "before_optimizations")
              for kind, dims in MANUAL_INPUT.findall(text) if kind == "f32"]
    assert inputs, "no manual-sharding region: torchattn's kernels ran on the global tensors"
    for _, dims in inputs:
        assert len(dims) == 4 and (dims[0], dims[1], dims[3]) == (1, 4, 8), f"not one device's q: {dims}"
    # The partitioned programs: fsdp gathers parameters (1-d and 2-d), never the 4-d q, k, v or attention
    # output, and the global q shape (batch 4) appears nowhere.
    after = programs(dump, "cpu_after_optimizations")
    gathered = [dims.split(",") for text in after for _, dims in ALL_GATHER.findall(text)]
    assert gathered, "fsdp gathers parameters: the pattern must find them"
    assert not [dims for dims in gathered if len(dims) == 4], f"4-d arrays gathered: {gathered}"
    assert not [text for text in after if re.search(r"f32\[4,4,\d+,8\]", text)], "a global q in a per-device program"


@pytest.mark.slow
def test_a_real_sigterm_on_a_mesh_checkpoints_the_step_it_names_and_resumes_exactly(tiny, tmp_path):
    """SIGTERM to a data=2 x fsdp=2 run with dropout (hidden dropout from the XLA generator, torchattn's
    from torch's CPU one): it finishes the step in flight, writes the checkpoint of the step it prints,
    exits 143, and the resumed run logs exactly the uninterrupted run's later losses."""
    flags = tiny + ["--max-steps", "5", "--dropout", "0.1", *MESH]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_spmd(["-m", "train", *flags, "--output-dir", str(whole)]).returncode == 0
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_COMPILATION_CACHE_SIZE="8")
    returncode, output = train_tiny.signalled_run([*flags, "--output-dir", str(parts)], [("step 1/", signal.SIGTERM)],
                                                  env=env)
    assert returncode == 128 + signal.SIGTERM, output[-3000:]
    written = re.search(r"checkpoint of step (\d+) written: (\S+)", output)
    assert written, output[-3000:]
    step = int(written.group(1))
    assert os.listdir(parts / "checkpoints") == [f"step-{step:08d}"] == [os.path.basename(written.group(2))]
    assert os.path.isdir(parts / "checkpoints" / f"step-{step:08d}"), "a sharded checkpoint is a folder"
    assert step < 5, "stopped before the end"

    resumed = run_spmd(["-m", "train", "--output-dir", str(parts), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = losses(whole)
    assert len(set(expected)) == 5, "dropout: the losses differ from step to step"
    assert losses(parts) == expected, f"resumed after step {step}"


# --- a context axis: the sequence split over devices ---------------------------------------------------

CONTEXT_MESH = ["--mesh", "fsdp=2,context=2"]
# A sequence-sharded run against one device: the K/V gather and the sums over sequence shards (the gradients'
# reductions among them) reorder float32 additions; up to 4.6e-7 seen, balanced or not. Tighter than the 1e-4:
# this random tiny Llama's loss is near ln(vocabulary), and balanced tokens with wrong document boundaries
# (segment ids read from the reordered position ids) moved it by only 1.7e-4.
CONTEXT_REL = 1e-5


@pytest.fixture(scope="module")
def long_documents(llama, tmp_path_factory) -> dict:
    """sotu-lm (whole speeches packed into rows, positions restarting per speech) with a tiny Llama (GQA
    4:2) at 256 tokens, 2 steps of two micro-batches of 4 rows (the gradients accumulated over the mesh too),
    torchattn's kernels per device (--backend interpret; on XLA:CPU auto is xla); its per-step losses on this
    process's one device."""
    folder = tmp_path_factory.mktemp("context")
    flags = ["--recipe", "sotu-lm", "--model", llama, "--max-length", "256", "--batch-size", "4", "--grad-accum", "2",
             "--max-steps", "2", "--lr", "3e-3", "--log-steps", "1", "--eval-batches", "1", "--dropout", "0",
             "--backend", "interpret"]
    assert main(flags + ["--output-dir", str(folder / "one")]) == 0
    return {"flags": flags, "one": losses(folder / "one")}


@pytest.fixture(scope="module")
def balanced_run(long_documents, tmp_path_factory) -> dict:
    """The long-document run with --balance-context over fsdp=2 x context=2, uninterrupted (its probe)."""
    folder = tmp_path_factory.mktemp("balanced")
    flags = long_documents["flags"] + [*CONTEXT_MESH, "--balance-context"]
    spmd = run_spmd(["tests/spmd_train_probe.py", *flags, "--output-dir", str(folder / "whole")])
    assert spmd.returncode == 0, spmd.stderr[-3000:]
    return {"flags": flags, "probe": json.loads(spmd.stdout.strip().splitlines()[-1])}


@pytest.mark.slow
def test_a_balanced_context_run_logs_the_single_device_losses(long_documents, balanced_run):
    """fsdp=2 x context=2: each device holds 2 rows of 128 of the 4 x 256 tokens of a micro-batch, in the
    dual-chunk order (labels shifted before the reorder), attention gathers K/V along the sequence, and the losses
    of the accumulated steps are the single-device ones. (The natural order's split is the same gather without the
    reorder: its kernels per device in tests/test_spmd_context.py, its step compiled in
    tests/test_train_compile_only.py.)"""
    probe = balanced_run["probe"]
    difference = largest_relative_difference(probe["losses"], long_documents["one"])
    print(f"fsdp=2 x context=2, balanced: largest relative loss difference per step {difference:.2e}")
    assert probe["losses"] == pytest.approx(long_documents["one"], rel=CONTEXT_REL)
    assert sorted(probe["batch"]) == ["input_ids", "position_ids", "shift_labels"]
    for layout in probe["batch"].values():
        assert layout == {"shape": [4, 256], "shards": [[2, 128]] * 4}
    # context shards no parameter: each is split over fsdp only, the same on the two devices of a context pair.
    assert probe["parameters"]["model.embed_tokens.weight"]["shards"] == [[15261, 32]] * 4


@pytest.mark.slow
def test_a_balanced_context_run_resumes_on_one_device_in_the_natural_order(long_documents, balanced_run, tmp_path,
                                                                           capsys):
    """Stopped after step 1 of 2, the fsdp=2 x context=2 run's sharded checkpoint resumes on one device (--mesh
    none), which feeds the natural order again (said so) and logs the single-device losses. (A resume on the same
    mesh continues exactly: test_a_real_sigterm_on_a_mesh_checkpoints_the_step_it_names_and_resumes_exactly.)"""
    mesh = tmp_path / "mesh"
    stopped = run_spmd(["tests/spmd_train_stop.py", "1", *balanced_run["flags"], "--output-dir", str(mesh)])
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert losses(mesh) == balanced_run["probe"]["losses"][:1]

    capsys.readouterr()
    assert main(["--output-dir", str(mesh), "--resume", "--mesh", "none"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "  --balance-context: True -> False from step 2 on" in printed
    assert "  --mesh: 'fsdp=2,context=2' -> none from step 2 on" in printed, "None as --mesh spells it"
    assert losses(mesh) == pytest.approx(long_documents["one"], rel=CONTEXT_REL)
