"""python -m train predict --compile-only GENERATION: HBM per TPU chip of one predict step and the least time it
takes, from the TPU compiler, with nothing predicted and no TPU (train/compile_only.py's machinery: placeholders for the
weights, torchattn's kernels as the chip's ``tpu_custom_call``s, libtpu's compile-only client).

    python -m train predict --model minilm --batch-tokens 2048 --compile-only v5e

The step is the one a run takes on each chip: --rows-per-device packed rows of --batch-tokens tokens
(documents of --max-length tokens laid whole), the model's forward and the task's per-token outputs, float32.

The time per step is the roofline of the compiler's cost analysis of the compiled step: max(its FLOPs / the
chip's peak, its HBM bytes / the chip's bandwidth) (torchattn.tuning.roofline.Work; the step's matmuls are bf16 passes:
torch_xla asks for DEFAULT precision). It is a lower bound on the time, so the documents/s it gives is an upper
bound. It is not a schedule estimate: torchattn.aot.schedule estimates a Pallas kernel from libtpu's VLIW
schedule, but a whole step is hundreds of XLA programs besides the kernels, and its schedule dump does not add
up: libtpu compiles identical programs once (the kernel of every layer, like fusions) and the top-level
program's calls name the HLO instruction, not the program they run, so how often each dumped program runs is
not in the dump (docs/predict.md). The compiler's own ``optimal_seconds`` is not used: libtpu 0.0.21 reports it
negative for these steps.
"""

from __future__ import annotations

import gc

import numpy as np
import torch

from torchattn.tpu import devices, generations
from torchattn.tuning import roofline

from .. import compile_only, runtime
from ..config import ConfigError
from ..runtime.other_stack import compiler_for
from ..data.packing import pack_whole
from . import model
from .config import PredictConfig
from .runner import is_causal, step_inputs


def run(config: PredictConfig) -> int:
    """Compiles the step, prints its HBM per chip and its time's roofline; exit status 0. ConfigError for a
    topology or generation this environment's libtpu does not compile for, ModelError for a model without the
    task's head; ConfigError on the torch runtime (the step is traced with torch_xla)."""
    compile_only.require_torch_xla(config.runtime)
    target = compile_only.resolve_target(config.compile_only)
    try:  # before tracing: v7x needs the current stack's libtpu, which compiles here only through its environment
        compiler_for(target.generation, one_chip=target.chips == 1)
    except ValueError as error:
        raise ConfigError(f"--compile-only: {error}") from None
    loaded = model.load(config)
    max_length, batch_tokens = loaded.lengths.max_length, loaded.lengths.batch_tokens
    per_row, rows = batch_tokens // max_length, config.rows_per_device
    print(f"compile-only: {config.model} ({loaded.task}), --attn {config.attn}, float32; {rows} "
          f"row{'s' * (rows > 1)} of {batch_tokens} tokens ({per_row} document{'s' * (per_row > 1)} of {max_length} "
          f"each) per chip of {target.topology}, libtpu's compiler", flush=True)
    layers = loaded.model_config.get_text_config().num_hidden_layers
    with devices.seen_as_tpu(target.generation):
        try:
            text = _step_graph(loaded, config)
        finally:
            gc.collect()  # the traced step's tensors, unmaterialised, before anything else may sync
        row = compile_only.compile_row(text, 0, target, config.attn, batch_tokens)
    row.layers = layers
    print("\n".join(compile_only.table_lines([row])))
    print(compile_only.fitting([row], target))
    print(_time_estimate(row, target.generation, rows * per_row, rows * batch_tokens))
    return 0


def _time_estimate(row: compile_only.Row, generation: str, documents: int, tokens: int) -> str:
    """The step's roofline on one device and the documents/s and tokens/s per chip it bounds (a chip of v4 or
    v7x is two devices, each running the step on its own share of the chip's peak and bandwidth)."""
    if not row.fits:
        return f"time per step: none (the step {'does not fit' if row.total_bytes else 'did not compile'})"
    devices = generations.get(generation).devices_per_chip
    seconds, bound = roofline.Work(row.flops * devices, row.bytes_accessed * devices).seconds(generation)
    where = f" on one of a chip's {devices} devices" if devices > 1 else ""
    return (f"time per step, at least: {seconds * 1e3:.3g} ms{where} ({bound}-bound roofline of the compiler's cost "
            f"analysis: {row.flops / 1e9:.3g} GFLOP, {row.bytes_accessed / 1e9:.3g} GB of HBM; a compiler estimate "
            f"and a lower bound); per chip at most {devices * documents / seconds:,.0f} documents/s, "
            f"{devices * tokens / seconds:,.0f} tokens/s")


def _step_graph(loaded: model.Loaded, config: PredictConfig) -> str:
    """StableHLO of one step: --rows-per-device rows of documents of --max-length random tokens packed whole."""
    empty = compile_only.with_placeholders(model.build(loaded, config, weights=False))
    max_length, batch_tokens = loaded.lengths.max_length, loaded.lengths.batch_tokens
    vocab = loaded.model_config.get_text_config().vocab_size
    documents = np.random.default_rng(0).integers(0, vocab, (config.rows_per_device * (batch_tokens // max_length),
                                                             max_length))
    packed = pack_whole(documents, row_length=batch_tokens, pad_id=loaded.tokenizer.pad_token_id)
    batch = {name: torch.from_numpy(packed[name]).to(runtime.device())
             for name in ("input_ids", "position_ids", "segment_ids")}
    inputs = step_inputs(batch, dense_mask=config.attn != "torchattn", causal=is_causal(empty), dtype=torch.float32)
    with torch.no_grad():
        outputs = loaded.head(empty.config).outputs(empty, inputs)
    return runtime.stablehlo([outputs])
