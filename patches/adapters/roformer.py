"""RoFormer: rotary q/k (and v) with the module's own rotation, then one torchattn call.

RoFormerSelfAttention serves self- and cross-attention. Self-attention rotates q
and k (and v when ``config.rotary_value``) with ``apply_rotary_position_embeddings``
before the cache stores them; cross-attention takes k, v from the encoder states,
unrotated. Decoders (``config.is_decoder``, kept as ``self.is_decoder``) are
causal in self-attention: under the "torchattn" mask function the model hands
over only a padding mask, so causality is passed to the kernel, bottom-right
aligned (a cached decode step sees every earlier key). Cross-attention is never
causal. Caches follow eager exactly: self-attention appends, cross-attention
fills once per EncoderDecoderCache layer and then reuses.
"""

from __future__ import annotations

from transformers.cache_utils import EncoderDecoderCache
from transformers.models.roformer.modeling_roformer import RoFormerSelfAttention
from transformers.utils.deprecation import deprecate_kwarg

from ..attention import warn_no_attentions
from ._common import attend

TARGET = RoFormerSelfAttention


@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")  # as the original forward
def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None, cache=None,
            output_attentions=False, **kwargs):
    cross = encoder_hidden_states is not None
    layer_cache, reuse = cache, False
    if isinstance(cache, EncoderDecoderCache):
        layer_cache = cache.cross_attention_cache if cross else cache.self_attention_cache
        reuse = cross and bool(cache.is_updated.get(self.layer_idx))

    # (batch, S, hidden) -> (batch, heads, S, d)
    q = self.query(hidden_states).view(*hidden_states.shape[:-1], -1, self.attention_head_size).transpose(1, 2)
    if reuse:  # cross-attention k, v computed on an earlier step
        k, v = layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
    else:
        states = encoder_hidden_states if cross else hidden_states
        kv_shape = (*states.shape[:-1], -1, self.attention_head_size)
        k = self.key(states).view(kv_shape).transpose(1, 2)  # (batch, heads, kv_len, d)
        v = self.value(states).view(kv_shape).transpose(1, 2)
        if not cross and sinusoidal_pos is not None:
            if self.rotary_value:
                q, k, v = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k, v)
            else:
                q, k = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k)
        if cache is not None:  # the cache stores rotated k, v, as in eager
            k, v = layer_cache.update(k, v, self.layer_idx, kwargs=kwargs)
            if cross and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True

    causal = bool(self.is_decoder) and not cross
    out = attend(self, q, k, v, attention_mask, scale=self.attention_head_size**-0.5, causal=causal)
    if output_attentions:
        warn_no_attentions("RoFormer")
    return out.flatten(2), None  # (batch, S, heads, d) -> (batch, S, hidden); eager always returns 2
