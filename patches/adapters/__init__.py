"""Module adapters: torchattn for families whose attention is hand-written, not dispatched
through transformers' AttentionInterface (LiLT, MPNet, RoFormer).

The contract patches/patching.py relies on, one module per family (named by
``Family.adapter`` in patches/families.py):

- ``TARGET``: the transformers self-attention class whose instances are patched.
- ``forward(self, ...)``: the original forward's exact signature and return
  structure. ``patch()`` binds it per instance (``module.forward =
  functools.partial(forward, module)``, which survives deepcopy and pickling);
  ``unpatch()`` deletes that instance attribute, so the class's own forward shows
  through again. Parameters, buffers and state_dict are never touched.

Because every target module is adapted, ``patch()`` also sets the config's attention
implementation to "torchattn" (``transformers_internals.set_attn_implementation``):
the model then builds a 2-D (batch, kv_len) bool padding mask (or None) with the
registered mask function (``patches.masks.padding_mask``) instead of a dense
(batch, 1, S, S) float one. An adapter therefore receives None, a 2-D padding mask,
or a caller's own 4-D mask. It computes q, k, v the module's way and calls ``_common.attend``, i.e.
``patches.attention.torchattn_attention`` (the function registered with
AttentionInterface), so both routes share one mask conversion
(``patches.masks.from_hf``), one options lookup (``options_for(self)``: backend,
block sizes) and one dropout rule: ``self.dropout.p`` in training, 0 in eval,
with a fresh seed per call. Loading an adapter family with
``attn_implementation="torchattn"`` installs no adapter, so it is refused at load
time (patches/loading.py).

torchattn never materialises attention probabilities: with
``output_attentions=True`` an adapter warns once and returns None in the
probabilities slot, as transformers' own non-eager implementations do.
"""
