"""Which model families the patches serve, how, and which they cannot serve and why.

``VERIFIED`` is also the test matrix: tests/test_patches_families.py runs every
entry (last hidden states and every parameter gradient against eager, padded and
packed), and ``python -m patches --list`` prints this table.
"""

from __future__ import annotations

import dataclasses
import enum

from . import transformers_internals


class Route(enum.Enum):
    INTERFACE = "AttentionInterface"  # the model dispatches through transformers' registry
    ADAPTER = "module adapter"  # hand-written attention: one adapter module replaces its forward


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # config.model_type
    route: Route
    features: tuple[str, ...]
    adapter: str | None = None  # module in patches/adapters/
    not_served: tuple[str, ...] = ()  # "what: why" for inputs the family cannot be served (printed by --list)


VERIFIED = (
    Family("BERT", "bert", Route.INTERFACE, ("bidirectional", "padding", "packing", "dropout")),
    Family("RoBERTa", "roberta", Route.INTERFACE, ("bidirectional", "padding", "packing", "dropout")),
    Family("DistilBERT", "distilbert", Route.INTERFACE,
           ("bidirectional", "padding", "packing (cu_seq_lens)", "dropout")),
    Family("ModernBERT", "modernbert", Route.INTERFACE,
           ("bidirectional", "local sliding window", "padding", "packing (cu_seq_lens)", "dropout")),
    Family("LayoutLM", "layoutlm", Route.INTERFACE,
           ("bidirectional", "padding (broadcast mask as bias)", "packing (cu_seq_lens)", "dropout")),
    Family("LayoutLMv3", "layoutlmv3", Route.INTERFACE,
           ("bidirectional", "1-D + 2-D relative position bias (dense)", "padding", "packing (cu_seq_lens)",
            "dropout")),
    Family("LiLT", "lilt", Route.ADAPTER,
           ("bidirectional", "text + layout streams share one score matrix", "padding", "dropout"), adapter="lilt",
           not_served=("packing: LiltModel.forward drops its **kwargs, so neither cu_seq_lens_q/k nor "
                       "position_ids reach the attention",)),
    Family("MPNet", "mpnet", Route.ADAPTER,
           ("bidirectional", "relative position bias (dense, trained)", "padding", "dropout"), adapter="mpnet",
           not_served=("packing: MPNetModel.forward drops its **kwargs, so neither cu_seq_lens_q/k nor "
                       "position_ids reach the attention",)),
    Family("RoFormer", "roformer", Route.ADAPTER, ("bidirectional", "rotary q/k (and v)", "padding", "dropout"),
           adapter="roformer",
           not_served=("packing: cu_seq_lens_q/k and position_ids reach RoFormerSelfAttention, but the "
                       "adapter does not pass them on",)),
    Family("Llama", "llama", Route.INTERFACE, ("causal", "GQA", "padding", "packing", "dropout")),
    Family("Qwen2", "qwen2", Route.INTERFACE, ("causal", "GQA", "sliding window layers", "padding", "packing")),
    Family("Mistral", "mistral", Route.INTERFACE, ("causal", "GQA", "sliding window", "padding", "packing")),
    Family("Gemma 2", "gemma2", Route.INTERFACE,
           ("causal", "GQA", "softcap", "alternating sliding window", "query_pre_attn_scalar", "padding", "packing")),
)

UNSUPPORTED = {
    "deberta-v2": "DeBERTa-v2's content-to-position and position-to-content terms gather per (query, key) "
                  "pair from q and k: a dense bias with a gradient, not expressible without a q_len x kv_len matrix",
    "longformer": "Longformer's global tokens attend and are attended with separate projections: "
                  "a band plus global rows and columns, not a window or segment mask",
    "big_bird": "BigBird's block-sparse mode picks random key blocks per head and query block: "
                "needs a block-sparse kernel or a dense per-head mask",
    "bros": "BROS adds a per-pair bounding-box term q_i . e_ij that the model materialises as "
            "(S, S, batch, head_dim); needs BrosModel.forward rewritten, not an attention adapter",
    "layoutlmv2": "LayoutLMv2's bbox-bucketed relative biases are dense (batch, heads, S, S) and its "
                  "visual backbone needs detectron2",
}

_BY_TYPE = {f.model_type: f for f in VERIFIED}


def lookup(model) -> Family | None:
    """The verified family of ``model``; None if it is not verified but dispatches
    through AttentionInterface; raises NotImplementedError otherwise."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    name = type(model).__name__
    if model_type in UNSUPPORTED:
        reason = UNSUPPORTED[model_type]
    elif transformers_internals.dispatches_through_interface(type(model)):
        return None
    else:
        reason = "it writes its own attention instead of dispatching through AttentionInterface"
    supported = ", ".join(f.name for f in VERIFIED)
    raise NotImplementedError(f"torchattn cannot patch {name}: {reason}. Supported families: {supported}")


def unverified_message(model: str) -> str:
    return (f"torchattn: {model} dispatches through AttentionInterface but is not among the verified families; "
            "run `python -m patches --list`")


def table() -> str:
    rows = [("family", "model_type", "route", "status", "attention features")]
    rows += [(f.name, f.model_type, f.route.value, "verified",
              "; ".join([", ".join(f.features), *(f"not served: {n}" for n in f.not_served)])) for f in VERIFIED]
    rows += [(t, t, "-", "unsupported", reason) for t, reason in UNSUPPORTED.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)
