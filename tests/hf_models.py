"""Tiny random Hugging Face models, one per verified family (``patches.VERIFIED``), and their inputs.

Every model is the family's base model (hidden states out), float32, eval mode,
hidden 64 (LiLT 48), 2 layers, 4 heads (decoders: 4 query / 2 key-value heads),
vocab 100, at least 1100 positions (so S=1024 fits), attention dropout 0, and
built from a fixed seed, so two builds of a family hold the same weights. Each
config turns on what its family does differently: sliding windows on some
layers, softcap, query_pre_attn_scalar, relative biases, rotary values, layout
streams. LayoutLMv3 runs text only: without ``pixel_values`` its model skips the
visual path and attends over the text tokens with both relative biases.

``padded_batch`` gives batch 2 whose second row is padded (at the end for
encoders, at the start for decoders, where right padding would hide nothing a
causal mask does not already hide). ``packed_batch`` gives batch 1 holding 3
documents as ``DataCollatorWithFlattening`` packs them, plus each document's
own unpacked inputs.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import transformers as T

VOCAB = 100
SEED = 1234
_ENCODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=VOCAB, max_position_embeddings=1100, attention_probs_dropout_prob=0.0)
_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=2048, attention_dropout=0.0,
                use_cache=False)
# Random init at the default 0.02 leaves attention nearly uniform (scores ~1e-2), which
# hides wrong masks, windows and softcaps; 0.2 gives scores of order one.
_INIT = 0.2


@dataclasses.dataclass(frozen=True)
class Spec:
    model_class: type
    config: dict
    decoder: bool = False  # causal: padded on the left, as for generation
    bbox: bool = False  # needs a (batch, S, 4) bbox input
    pad_token_id: int = 0
    # Packed position_ids start here: RoBERTa-like models number tokens from pad_token_id + 1.
    position_start: int = 0


SPECS = {
    "BERT": Spec(T.BertModel, dict(_ENCODER, hidden_dropout_prob=0.0)),
    "RoBERTa": Spec(T.RobertaModel, dict(_ENCODER, hidden_dropout_prob=0.0, pad_token_id=1), pad_token_id=1,
                    position_start=2),
    "DistilBERT": Spec(T.DistilBertModel, dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB,
                                               max_position_embeddings=1100, attention_dropout=0.0, dropout=0.0)),
    "ModernBERT": Spec(T.ModernBertModel, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=1100,
                                               local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
                                               bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                                               attention_dropout=0.0)),
    "LayoutLM": Spec(T.LayoutLMModel, dict(_ENCODER, hidden_dropout_prob=0.0), bbox=True),
    "LayoutLMv3": Spec(T.LayoutLMv3Model, dict(_ENCODER, hidden_dropout_prob=0.0, pad_token_id=1,
                                               coordinate_size=12, shape_size=8, has_relative_attention_bias=True,
                                               rel_pos_bins=8, max_rel_pos=16, has_spatial_attention_bias=True,
                                               rel_2d_pos_bins=8, max_rel_2d_pos=32, input_size=32, patch_size=16),
                       bbox=True, pad_token_id=1, position_start=2),
    # LiLT's layout embeddings need hidden % 6 == 0: hidden 48 (head_dim 12, layout head_dim 3).
    "LiLT": Spec(T.LiltModel, dict(_ENCODER, hidden_size=48, hidden_dropout_prob=0.0, channel_shrink_ratio=4),
                 bbox=True),
    "MPNet": Spec(T.MPNetModel, dict(_ENCODER, hidden_dropout_prob=0.0, pad_token_id=1), pad_token_id=1),
    "RoFormer": Spec(T.RoFormerModel, dict(_ENCODER, hidden_dropout_prob=0.0, embedding_size=64, rotary_value=True)),
    "Llama": Spec(T.LlamaModel, _DECODER, decoder=True),
    "Qwen2": Spec(T.Qwen2Model, dict(_DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1),
                  decoder=True),
    "Mistral": Spec(T.MistralModel, dict(_DECODER, sliding_window=4), decoder=True),
    "Gemma 2": Spec(T.Gemma2Model, dict(_DECODER, sliding_window=4, attn_logit_softcapping=2.0,
                                        query_pre_attn_scalar=8), decoder=True),
}


# family -> backend -> quantity -> max |patched - eager|, filled by the tests, printed by conftest.py.
MAX_DIFFS: dict = defaultdict(lambda: defaultdict(dict))


def config(family: str, attn_implementation: str = "eager", **overrides) -> T.PretrainedConfig:
    """The family's tiny config, as a user would write it (``attn_implementation=`` included);
    ``overrides`` replace or add config fields (``num_hidden_layers=1``, ``is_decoder=True``)."""
    spec = SPECS[family]
    return spec.model_class.config_class(**{**spec.config, **overrides}, initializer_range=_INIT,
                                         attn_implementation=attn_implementation)


def build(family: str, attn_implementation: str = "eager", *, model_class: type | None = None,
          **overrides) -> T.PreTrainedModel:
    """The family's tiny model on the CPU, float32, eval mode, the same weights on every call.

    model_class: the family's base model by default, or a class with a head on it
        (``RoFormerForCausalLM``); overrides: config fields, as for :func:`config`.
    """
    torch.manual_seed(SEED)
    model = (model_class or SPECS[family].model_class)(config(family, attn_implementation, **overrides))
    return model.float().eval()


@dataclasses.dataclass
class Batch:
    inputs: dict  # keyword arguments of the model's forward (CPU tensors)
    valid: torch.Tensor  # (batch, S) bool: positions that are real tokens

    def to(self, device) -> "Batch":
        return Batch({k: v.to(device) if torch.is_tensor(v) else v for k, v in self.inputs.items()},
                     self.valid.to(device))


def _tokens(shape, g) -> torch.Tensor:
    return torch.randint(4, VOCAB, shape, generator=g)  # 0-3 are pad/bos/eos ids in some configs


def _bbox(shape, g) -> torch.Tensor:
    """(..., 4) boxes x0 <= x1, y0 <= y1 inside the 0..1000 page LayoutLM-like models expect."""
    xy = torch.randint(0, 1001, (*shape, 2, 2), generator=g).sort(dim=-2).values  # (..., [lo, hi], [x, y])
    return xy.transpose(-1, -2).reshape(*shape, 4)[..., [0, 2, 1, 3]].contiguous()  # x0, y0, x1, y1


def padded_batch(family: str, seq: int, *, pad: int | None = None, seed: int = 0) -> Batch:
    """Batch 2 of length ``seq``; the second row has ``pad`` (default seq // 3) padding tokens,
    at the end for encoders and at the start for decoders."""
    spec = SPECS[family]
    g = torch.Generator().manual_seed(seed)
    pad = seq // 3 if pad is None else pad
    ids = _tokens((2, seq), g)
    mask = torch.ones(2, seq, dtype=torch.long)
    padding = slice(0, pad) if spec.decoder else slice(seq - pad, seq)
    mask[1, padding] = 0
    ids[1, padding] = spec.pad_token_id
    inputs = dict(input_ids=ids, attention_mask=mask)
    if spec.bbox:
        inputs["bbox"] = _bbox((2, seq), g)
    return Batch(inputs, mask.bool())


@dataclasses.dataclass
class Packed:
    inputs: dict  # batch 1, the documents back to back (CPU tensors)
    documents: list  # each document's own inputs, batch 1, no padding


def packed_batch(family: str, lengths=(70, 35, 95), *, flash_kwargs: bool = True, seed: int = 1) -> Packed:
    """Documents of ``lengths`` packed into one row as DataCollatorWithFlattening does:
    position_ids restart per document (at ``Spec.position_start``), there is no
    attention_mask, and with ``flash_kwargs`` (``return_flash_attn_kwargs=True``)
    cu_seq_lens_q/k and max_length_q/k describe the documents too."""
    spec = SPECS[family]
    g = torch.Generator().manual_seed(seed)
    docs = [_tokens((n,), g).tolist() for n in lengths]
    collate = T.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs,
                                           position_ids_start=spec.position_start)
    inputs = dict(collate([{"input_ids": d} for d in docs]))
    inputs.pop("labels")
    documents = [dict(input_ids=torch.tensor([d])) for d in docs]
    if spec.bbox:
        boxes = [_bbox((1, n), g) for n in lengths]
        inputs["bbox"] = torch.cat(boxes, dim=1)
        for doc, box in zip(documents, boxes):
            doc["bbox"] = box
    return Packed(inputs, documents)
