"""transformers' Trainer with XLA FSDPv2 on 4 virtual CPU devices; run by tests/test_patches_fsdpv2.py.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \\
        python tests/fsdpv2_probe.py DIR OUT.json

What a user writes: ``xr.use_spmd()``, a model loaded with ``attn_implementation="torchattn"`` and
``TrainingArguments(fsdp=True, fsdp_config={"xla": True, "xla_fsdp_v2": True})``. The Trainer
sets the global mesh ("fsdp", "tensor") = (4, 1) and shards each batch over "fsdp"; nothing else says
how attention's inputs are laid out. Off a TPU the model is patched to the ``interpret`` backend, the
TPU kernels in interpret mode (a TPU's "auto" is ``pallas``; XLA:CPU's is ``xla``, no kernel call).
Each family (a tiny random Llama causal LM, a tiny random BERT masked LM) trains 3 steps with torchattn
and with sdpa from the same weights and batches. Written per run: the logged losses, the q shape of
every kernel call (what one device's kernel sees) and the all-gathers of the partitioned programs XLA
compiled for the run (its dump after optimisations). Then, per other global mesh (MESH_CASES), the
warnings and kernel q shapes of one call. transformers 5.24's Trainer needs three things under FSDPv2
whatever the attention (Fsdpv2Trainer, FAMILIES, train).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
import warnings

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import transformers as T

import patches  # registers "torchattn"
import torchattn
import torchattn.backends.autograd
from torchattn import once

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402

BATCH, SEQ, STEPS = 4, 64, 3  # batch 4 over fsdp 4: one row per device
# name: (hf_models family, model class with a head, config overrides). transformers' FSDPv2 output hook
# (integrations/tpu.py, shard_output) marks the logits (batch, seq, vocab) sharded and accepts only a
# tensor, a tuple or a CausalLMOutputWithPast (anything else: "the output of the model shouldn't be None"):
# BERT runs as a masked LM returning a tuple, its loss from the Trainer's compute_loss_func.
FAMILIES = {
    "llama": ("Llama", T.LlamaForCausalLM, dict(num_hidden_layers=1)),
    "bert": ("BERT", T.BertForMaskedLM, dict(num_hidden_layers=1, return_dict=False)),
}
MASK_ID = 3  # the masked LM's stand-in [MASK] (hf_models keeps ids 0-3 out of the text)
# Other global meshes, each with one call on q of the given shape (batch, heads, seq, head_dim):
# name: (mesh shape, axis names, q shape).
MESH_CASES = {
    "fsdp_2_tensor_2": ((2, 2), ("fsdp", "tensor"), (2, 4, 32, 16)),
    "no_fsdp_axis": ((4, 1), ("data", "model"), (4, 4, 32, 16)),
    "data_axis_too": ((2, 2, 1), ("data", "fsdp", "tensor"), (4, 4, 32, 16)),
    "batch_3": ((4, 1), ("fsdp", "tensor"), (3, 4, 32, 16)),
}
IMPLEMENTATIONS = ("torchattn", "sdpa")


def rows(family: str) -> list[dict]:
    """STEPS batches of BATCH rows, fixed by a seed; every fourth row ends in 16 padding tokens. Llama
    predicts every real token; BERT a random 15 % of them, replaced by MASK_ID in its input."""
    g = torch.Generator().manual_seed(0)
    out = []
    for index in range(BATCH * STEPS):
        ids = torch.randint(4, hf_models.VOCAB, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        if index % 4 == 1:
            mask[-16:] = 0
            ids[-16:] = 0
        target = mask.bool() if family == "llama" else mask.bool() & (torch.rand(SEQ, generator=g) < 0.15)
        labels = ids.masked_fill(~target, -100)
        if family == "bert":
            ids = ids.masked_fill(target, MASK_ID)
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return out


def masked_lm_loss(outputs, labels, num_items_in_batch=None):
    """Cross-entropy over the labelled tokens (the Trainer's compute_loss_func for BERT's tuple output)."""
    logits = outputs[0]
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                              reduction="sum")
    return total / (labels != -100).sum() if num_items_in_batch is None else total / num_items_in_batch


def kernel_q_shapes() -> list:
    """Wraps torchattn.backends.autograd.apply (the autograd Function on one device's tensors, under SPMD);
    returns the list collecting each call's q shape."""
    shapes = []
    original = torchattn.backends.autograd.apply

    def spy(backend, tensors, options):
        shapes.append(list(tensors.q.shape))
        return original(backend, tensors, options)

    torchattn.backends.autograd.apply = spy
    return shapes


class Fsdpv2Trainer(T.Trainer):
    """transformers 5.24's Trainer wraps the model for XLA FSDP and delays the optimizer until after that,
    but never creates it (Trainer._prepare_for_training: the wrapped model skips accelerate's prepare, and
    create_scheduler then fails on "'NoneType' object has no attribute 'param_groups'"). FSDPv2 shards the
    parameters in place, so the optimizer is the default one over them, created right after wrapping."""

    def _wrap_model(self, model, *args, **kwargs):
        wrapped = super()._wrap_model(model, *args, **kwargs)
        if self.optimizer is None:
            self.create_optimizer(wrapped)
        return wrapped


def train(family: str, implementation: str, folder: str) -> list[float]:
    name, model_class, overrides = FAMILIES[family]
    model = hf_models.build(name, implementation, model_class=model_class, **overrides)
    if implementation == "torchattn":
        patches.patch(model, backend="interpret")  # XLA:CPU's stand-in for a TPU's pallas
    # optim: the default, adamw_torch_fused, refuses XLA tensors; pinning batches fails on XLA:CPU
    # ("Please register PrivateUse1HooksInterface").
    args = T.TrainingArguments(output_dir=folder, per_device_train_batch_size=BATCH, max_steps=STEPS,
                               logging_steps=1, learning_rate=1e-3, optim="adamw_torch", seed=0, data_seed=0,
                               report_to="none", save_strategy="no", dataloader_drop_last=True,
                               dataloader_pin_memory=False, disable_tqdm=True,
                               fsdp=True, fsdp_config={"xla": True, "xla_fsdp_v2": True})
    trainer = Fsdpv2Trainer(model=model, args=args, train_dataset=rows(family),
                            compute_loss_func=masked_lm_loss if family == "bert" else None)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def global_meshes(shapes: list) -> dict:
    """Per MESH_CASES entry, with that mesh set as the global one: the torchattn warnings and kernel q shapes
    of one forward call on an unannotated q (traced, not run)."""
    found = {}
    for name, (mesh_shape, axes, q_shape) in MESH_CASES.items():
        xs.set_global_mesh(xs.Mesh(np.arange(np.prod(mesh_shape)), mesh_shape, axes))
        once._shown = set()
        shapes.clear()
        q = torch.randn(q_shape).to(torch_xla.device()) * 1.0  # an intermediate: no sharding of its own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torchattn.flash_attention(q, q, q, backend="interpret")
        found[name] = {"warnings": [str(w.message) for w in caught if str(w.message).startswith("torchattn")],
                       "kernel_q_shapes": sorted({tuple(s) for s in shapes})}
    return found


def new_programs(dump: str, seen: set) -> list[str]:
    """Texts of the partitioned programs compiled since the last call."""
    paths = set(glob.glob(os.path.join(dump, "*after_optimizations.txt"))) - seen
    seen |= paths
    return [open(path).read() for path in sorted(paths)]


def all_gathers(texts: list[str]) -> list[str]:
    """The array types every all-gather in ``texts`` returns (each of a tuple's), e.g. "f32[4,4,64,16]"."""
    found = []
    for text in texts:
        for line in text.splitlines():
            match = re.search(r"=\s*(\S.*?)\s+all-gather(?:-start)?\(", line)
            if match:
                found += re.findall(r"\b(?:pred|bf16|[fsu]\d+)\[[\d,]*\]", match.group(1))
    return found


def main(dump: str, out_path: str) -> None:
    seen: set = set()
    shapes = kernel_q_shapes()
    results = {}
    for family in FAMILIES:
        for implementation in IMPLEMENTATIONS:
            shapes.clear()
            with tempfile.TemporaryDirectory() as folder:
                losses = train(family, implementation, folder)
            texts = new_programs(dump, seen)
            results[f"{family}-{implementation}"] = {
                "losses": losses, "kernel_q_shapes": sorted({tuple(s) for s in shapes}),
                "programs": len(texts), "all_gathers": all_gathers(texts)}
    results["global_meshes"] = global_meshes(shapes)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    # SPMD is process-wide and must be on before any XLA tensor exists: here, not at import (the test
    # imports this module for its names).
    xr.use_spmd()
    main(sys.argv[1], sys.argv[2])
