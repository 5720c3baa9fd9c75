"""MPNet: relative-position bias and output projection around one torchattn call.

Eager MPNet computes softmax(q.k/sqrt(d) + position_bias + mask) v and then its
output projection ``self.o``, all inside MPNetSelfAttention. ``position_bias``
(batch, heads, S, S) comes from the encoder's trained ``relative_attention_bias``
embedding and requires grad: it is passed as torchattn's ``bias``, whose
gradient torchattn returns, so the embedding trains exactly as in eager.
"""

from __future__ import annotations

from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

from ..attention import warn_no_attentions
from ._common import attend

TARGET = MPNetSelfAttention


def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
    hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    # (batch, S, hidden) -> (batch, heads, S, d)
    q = self.q(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v(hidden_states).view(hidden_shape).transpose(1, 2)
    # eager adds position_bias after scaling, as torchattn adds ``bias``
    out = attend(self, q, k, v, attention_mask, scale=self.attention_head_size**-0.5, bias=position_bias)
    o = self.o(out.flatten(2))  # (batch, S, heads, d) -> (batch, S, hidden)
    if output_attentions:
        warn_no_attentions("MPNet")
        return o, None
    return (o,)
