"""LiLT: the text and layout streams through one torchattn call.

Eager LiLT adds the text scores q.k/sqrt(d) and the layout scores
ql.kl/sqrt(d // r) into ONE score matrix that both streams softmax (the mask
added to each), then applies it to v and to vl. That is a single attention over
concatenated features: Q = [q/sqrt(d), ql/sqrt(d//r)], K = [k, kl], V = [v, vl],
scale 1, output split at d.

Difference from eager, in training only: one call draws ONE dropout mask that
both streams share, where eager calls ``self.dropout`` twice and draws two
independent masks. In eval (no dropout) the two are the same computation.
Gradients: when the caller does not use the layout context (LiltModel drops
the last layer's), eager leaves that layer's ``layout_value`` grad None; here v
and vl share one kernel call, so it is an all-zero tensor instead.
"""

from __future__ import annotations

import math

import torch
from transformers.models.lilt.modeling_lilt import LiltSelfAttention

from ..attention import warn_no_attentions
from ._common import attend

TARGET = LiltSelfAttention


def forward(self, hidden_states, layout_inputs, attention_mask=None, output_attentions=False):
    r = self.channel_shrink_ratio
    d = self.attention_head_size
    d_layout = d // r  # eager's layout scale uses this integer division too
    # (batch, S, hidden) -> (batch, heads, S, d); layout (batch, S, hidden/r) -> (batch, heads, S, d/r)
    q, k, v = (self.transpose_for_scores(f(hidden_states)) for f in (self.query, self.key, self.value))
    ql, kl, vl = (self.transpose_for_scores(f(layout_inputs), r=r)
                  for f in (self.layout_query, self.layout_key, self.layout_value))
    # [q/sqrt(d), ql/sqrt(d_layout)] . [k, kl] = q.k/sqrt(d) + ql.kl/sqrt(d_layout): eager's shared score matrix.
    # One call, so one dropout mask for both streams (eager draws two; see the module docstring).
    query = torch.cat([q / math.sqrt(d), ql / math.sqrt(d_layout)], dim=-1)  # (batch, heads, S, d + d/r)
    out = attend(self, query, torch.cat([k, kl], dim=-1), torch.cat([v, vl], dim=-1), attention_mask,
                 scale=1.0)  # (batch, S, heads, d + d/r)
    context = out[..., :d].flatten(2)  # (batch, S, hidden)
    layout_context = out[..., d:].flatten(2)  # (batch, S, hidden/r)
    if output_attentions:
        warn_no_attentions("LiLT")
        return context, layout_context, None
    return context, layout_context
