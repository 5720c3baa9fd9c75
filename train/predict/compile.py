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

The compiler takes each torchattn kernel's work from the kernel's own cost estimate, which counts every tile the
band leaves (the segment ids are data). With --input, the first rows that input packs into (as a run packs them)
give the share of tiles the kernels visit there, and a second time per step counts those tiles, with those rows'
documents and tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import re

import numpy as np
import torch

from patches.masks import document_ids
from torchattn.aot import Attention
from torchattn.kernels import cost, segment_blocks
from torchattn.tpu import devices, generations
from torchattn.tuning import roofline

from .. import compile_only, runtime
from ..config import ConfigError
from ..runtime.other_stack import compiler_for
from ..data.packing import pack_whole
from . import documents, model
from .config import PredictConfig
from .job import pack_texts
from .runner import is_causal, step_inputs

SAMPLED_ROWS = 64  # packed rows of --input the tile count reads, at most
# A Pallas kernel's cost estimate in the payload of its tpu_custom_call (quotes escaped as \22 in StableHLO text).
_COST = re.compile(r'cost_estimate\\22: (\{[^}]*\})')


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
            text, causal = _step_graph(loaded, config)
        finally:
            gc.collect()  # the traced step's tensors, unmaterialised, before anything else may sync
        row = compile_only.compile_row(text, 0, target, config.attn, batch_tokens)
    row.layers = layers
    print("\n".join(compile_only.table_lines([row])))
    print(compile_only.fitting([row], target))
    if not row.fits:
        print(f"time per step: none (the step {'does not fit' if row.total_bytes else 'did not compile'})")
        return 0
    print(_time_estimate(row.flops, row.bytes_accessed, target.generation, rows * per_row, rows * batch_tokens,
                         "time per step"))
    if config.input is not None:
        print(_sampled_estimate(config, loaded, text, causal, row, target.generation))
    return 0


def _time_estimate(flops: float, bytes_accessed: float, generation: str, documents: float, tokens: float,
                   what: str) -> str:
    """The roofline of a step of ``flops`` and ``bytes_accessed`` on one device and the documents/s and tokens/s per
    chip it bounds (a chip of v4 or v7x is two devices, each running the step on its own share of the chip's peak
    and bandwidth)."""
    devices = generations.get(generation).devices_per_chip
    seconds, bound = roofline.Work(flops * devices, bytes_accessed * devices).seconds(generation)
    where = f" on one of a chip's {devices} devices" if devices > 1 else ""
    return (f"{what}, at least: {seconds * 1e3:.3g} ms{where} ({bound}-bound roofline of the compiler's cost "
            f"analysis: {flops / 1e9:.3g} GFLOP, {bytes_accessed / 1e9:.3g} GB of HBM; a compiler estimate "
            f"and a lower bound); per chip at most {devices * documents / seconds:,.0f} documents/s, "
            f"{devices * tokens / seconds:,.0f} tokens/s")


def _sampled_estimate(config: PredictConfig, loaded: model.Loaded, text: str, causal: bool, row, generation: str
                      ) -> str:
    """The share of tiles the step's kernels visit in the first rows --input packs into, and the time per step
    with those tiles and those rows' documents and tokens; or why it is not estimated. The kernels are the
    forward of the call the model's configuration makes (its heads, head_dim, causal or not, packed): checked
    against the cost estimate each kernel of the compiled step carries, which it must equal at every tile."""
    import datasets

    datasets.disable_progress_bars()  # as a run reads --input
    read = documents.read(config.input, text_column=config.text_column)
    lengths = loaded.lengths
    _, _, packed = pack_texts(read.texts[:config.shard_size], loaded.tokenizer, loaded.frame,
                              max_length=lengths.max_length, long=config.long, stride=lengths.stride,
                              specials_per_window=loaded.head.SPECIALS_PER_WINDOW, batch_tokens=lengths.batch_tokens)
    sampled = min(len(packed["input_ids"]), SAMPLED_ROWS)
    if sampled == 0:
        return "tiles visited: not estimated (--input's first documents hold no token)"
    kernels = [json.loads(found.replace("\\22", '"')) for found in _COST.findall(text)]
    if not kernels:
        return f"tiles visited: not estimated (--attn {config.attn} runs no torchattn kernel)"
    text_config = loaded.model_config.get_text_config()
    heads = text_config.num_attention_heads
    attention = Attention(
        batch=config.rows_per_device, q_heads=heads, q_len=lengths.batch_tokens, kv_len=lengths.batch_tokens,
        kv_heads=getattr(text_config, "num_key_value_heads", None) or heads, causal=causal, segments=True,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads, dtype="float32")
    blocks = attention.default_block_sizes(generation)
    spec, _ = attention.specs(blocks, generation)
    every = cost.forward_cost(spec)  # every tile the band leaves: what each kernel's estimate counts
    if any((kernel["flops"], kernel["bytes_accessed"]) != (every.flops, every.bytes_accessed) for kernel in kernels):
        return (f"tiles visited: not estimated (the step's kernels are not the forward of {attention}, which the "
                f"model's configuration gives)")
    # The ids the kernels get: patches' documents of the packed rows' positions (padding: a token each).
    ids = document_ids(torch.from_numpy(packed["position_ids"][:sampled])).numpy()
    visited = [cost.forward_cost(spec, spec.geometry(segment_blocks.layout_key(spec, row_ids, row_ids), 0))
               for row_ids in ids]
    flops = np.mean([v.flops for v in visited])
    moved = np.mean([v.bytes_accessed for v in visited])
    all_tiles = cost.forward_cost(dataclasses.replace(attention, causal=False).specs(blocks, generation)[0])
    windows = np.bincount(packed["placement"][:, 0], minlength=len(packed["input_ids"]))[:sampled]
    tokens = (packed["segment_ids"][:sampled] > 0).sum(axis=1)
    rows = config.rows_per_device
    line = (f"tiles visited: {flops / all_tiles.flops:.1%} of the attention kernels' tiles (the band alone: "
            f"{every.flops / all_tiles.flops:.1%}, which the compiler counts), in the first {sampled} rows --input "
            f"packs into (mean {windows.mean():.1f} windows, {tokens.mean():.0f} tokens per row)")
    kept_flops = row.flops - len(kernels) * (every.flops - flops)
    kept_bytes = row.bytes_accessed - len(kernels) * (every.bytes_accessed - moved)
    return line + "\n" + _time_estimate(kept_flops, kept_bytes, generation, rows * windows.mean(),
                                        rows * tokens.mean(), "time per step with those tiles and rows")


def _step_graph(loaded: model.Loaded, config: PredictConfig) -> tuple[str, bool]:
    """StableHLO of one step: --rows-per-device rows of documents of --max-length random tokens packed whole; and
    whether the model's attention is causal."""
    empty = compile_only.with_placeholders(model.build(loaded, config, weights=False))
    max_length, batch_tokens = loaded.lengths.max_length, loaded.lengths.batch_tokens
    vocab = loaded.model_config.get_text_config().vocab_size
    documents = np.random.default_rng(0).integers(0, vocab, (config.rows_per_device * (batch_tokens // max_length),
                                                             max_length))
    packed = pack_whole(documents, row_length=batch_tokens, pad_id=loaded.tokenizer.pad_token_id)
    batch = {name: torch.from_numpy(packed[name]).to(runtime.device())
             for name in ("input_ids", "position_ids", "segment_ids")}
    causal = is_causal(empty)
    inputs = step_inputs(batch, dense_mask=config.attn != "torchattn", causal=causal, dtype=torch.float32)
    with torch.no_grad():
        outputs = loaded.head(empty.config).outputs(empty, inputs)
    return runtime.stablehlo([outputs]), causal
