"""Module adapters (patches/adapters/) against the eager originals: LiLT, MPNet, RoFormer.

Tiny random models built from configs on CPU. A padded batch (one row with
trailing padding) runs through the eager model and through a deep copy patched
with torchattn; outputs at real tokens and every parameter gradient of a
weighted loss over real tokens must agree, and ``unpatch`` must give back the
eager model bit for bit.
"""

import copy
import warnings

import pytest
import torch
from transformers import (LiltConfig, LiltModel, MPNetConfig, MPNetModel, RoFormerConfig, RoFormerForCausalLM,
                          RoFormerModel)

import patches

BATCH, SEQ, VOCAB, REAL = 3, 13, 100, 9  # row 1 keeps REAL tokens, then padding
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
ATOL = 1e-5


def _inputs(family, pad_token_id):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, REAL:] = 0
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g).masked_fill(mask == 0, pad_token_id)
    inputs = dict(input_ids=ids, attention_mask=mask)
    if family == "lilt":  # boxes (x0, y0, x1, y1) in 0..1000 with x0 <= x1, y0 <= y1
        corners = torch.randint(0, 1001, (BATCH, SEQ, 2, 2), generator=g).sort(dim=2).values
        inputs["bbox"] = corners.reshape(BATCH, SEQ, 4)  # [[x0, y0], [x1, y1]] -> (x0, y0, x1, y1)
    return inputs


def _model(family, rotary_value=False, layers=2, **overrides):
    torch.manual_seed(0)
    sizes = {**SIZES, "num_hidden_layers": layers, **overrides}
    if family == "lilt":
        # hidden divisible by 6 (six box embeddings concatenated): 48 -> head_dim 12, layout head_dim 3
        return LiltModel(LiltConfig(**{**sizes, "hidden_size": 48}, channel_shrink_ratio=4)).eval()
    if family == "mpnet":
        return MPNetModel(MPNetConfig(**sizes)).eval()
    return RoFormerModel(RoFormerConfig(**sizes, rotary_value=rotary_value)).eval()


def _run(model, inputs, weights, device):
    """last_hidden_state (on CPU) and {name: grad (on CPU)} of sum(out * weights) over real tokens."""
    model.zero_grad(set_to_none=True)
    out = model(**{k: v.to(device) for k, v in inputs.items()}).last_hidden_state
    keep = inputs["attention_mask"].to(device, out.dtype)[..., None]  # (batch, S, 1)
    (out * weights.to(device) * keep).sum().backward()
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()  # one graph for forward and backward, before reading anything back
    grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
    return out.detach().cpu(), grads


def _device(backend):
    if backend == "xla":
        import torch_xla

        return torch_xla.device()
    return torch.device("cpu")


# XLA:CPU compiles the whole model's forward and backward: ~3 s for one layer, ~8 s for two.
# Layers feeding layers (LiLT's layout stream, MPNet's shared bias) are covered on "reference",
# and so is rotary_value: the rotation is model code that runs before any backend.
LAYERS = {"reference": 2, "xla": 1}
CASES = [pytest.param(family, rotary_value, backend, id=f"{family}{'-rotary_value' * rotary_value}-{backend}")
         for backend in LAYERS for family in ("lilt", "mpnet", "roformer")
         for rotary_value in ((False, True) if family == "roformer" and backend == "reference" else (False,))]


@pytest.mark.parametrize("family,rotary_value,backend", CASES)
def test_matches_eager_and_unpatches(family, rotary_value, backend):
    eager = _model(family, rotary_value, LAYERS[backend])
    inputs = _inputs(family, eager.config.pad_token_id)
    weights = torch.randn(BATCH, SEQ, eager.config.hidden_size, generator=torch.Generator().manual_seed(1))
    real = inputs["attention_mask"].bool()
    device = _device(backend)
    want, want_grads = _run(eager, inputs, weights, torch.device("cpu"))

    patched = copy.deepcopy(eager)
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    patches.patch(patched, backend=backend)
    assert patched.config._attn_implementation == "torchattn"
    after = patched.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    got, got_grads = _run(patched.to(device), inputs, weights, device)
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=1e-4)
    assert got_grads.keys() == want_grads.keys()
    for name, want_grad in want_grads.items():
        got_grad = got_grads[name]
        if want_grad is None:  # outside the loss: the pooler; LiLT's last layout_value (see adapters/lilt.py)
            assert got_grad is None or not got_grad.any(), name
            continue
        scale = max(1.0, want_grad.abs().max().item())  # embedding grads sum over many tokens
        torch.testing.assert_close(got_grad, want_grad, atol=ATOL * scale, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    if family == "mpnet":  # the relative-position bias trains through torchattn's dbias
        assert got_grads["encoder.relative_attention_bias.weight"].abs().sum() > 0

    patches.unpatch(patched.cpu())
    assert patched.config._attn_implementation == eager.config._attn_implementation == "eager"
    assert not [m for m in patched.modules() if "forward" in m.__dict__]
    with torch.no_grad():
        restored = patched(**inputs).last_hidden_state
        assert torch.equal(restored, eager(**inputs).last_hidden_state)


def test_roformer_decoder_causal_and_cached_generation():
    """A causal decoder with padding: the kernel applies causality the model no longer
    puts in the mask, and greedy generation with a DynamicCache (bottom-right aligned
    decode steps over rotated cached keys) matches eager step for step."""
    torch.manual_seed(0)
    eager = RoFormerForCausalLM(RoFormerConfig(**SIZES, is_decoder=True)).eval()
    patched = copy.deepcopy(eager)
    patches.patch(patched, backend="reference")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding, as for generation
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=ATOL, rtol=1e-4)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        want_gen, got_gen = eager.generate(**kwargs), patched.generate(**kwargs)
    assert torch.equal(got_gen.sequences, want_gen.sequences)
    torch.testing.assert_close(torch.stack(got_gen.scores), torch.stack(want_gen.scores), atol=ATOL, rtol=1e-4)


def test_roformer_cross_attention_with_cache():
    """Cross-attention layers take k, v from the encoder states, unrotated, under the
    encoder's padding mask, never causal; with an EncoderDecoderCache the second step
    reuses them while self-attention appends one rotated key."""
    torch.manual_seed(0)
    eager = RoFormerModel(RoFormerConfig(**SIZES, is_decoder=True, add_cross_attention=True)).eval()
    patched = copy.deepcopy(eager)
    patches.patch(patched, backend="reference")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (2, 7), generator=g)
    encoder = dict(encoder_hidden_states=torch.randn(2, 11, SIZES["hidden_size"], generator=g),
                   encoder_attention_mask=(torch.arange(11) < torch.tensor([[8], [11]])).long())  # row 0: 8 real
    steps = {}
    with torch.no_grad():
        for name, model in (("eager", eager), ("patched", patched)):  # prompt, then one step on its cache
            first = model(input_ids=ids[:, :6], use_cache=True, **encoder)
            second = model(input_ids=ids[:, 6:], cache=first.cache, use_cache=True, **encoder)
            steps[name] = (first.last_hidden_state, second.last_hidden_state)
    assert steps["patched"][1].shape == (2, 1, SIZES["hidden_size"])
    torch.testing.assert_close(steps["patched"], steps["eager"], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family,name", [("lilt", "LiLT"), ("mpnet", "MPNet"), ("roformer", "RoFormer")])
def test_output_attentions_warns_once_and_returns_none(family, name):
    model = _model(family)
    inputs = _inputs(family, model.config.pad_token_id)
    with patches.patched(model, backend="reference"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**inputs, output_attentions=True)  # two layers, one warning
    assert out.attentions == (None, None)
    messages = [str(w.message) for w in caught if "output_attentions" in str(w.message)]
    assert len(messages) == 1 and name in messages[0] and "never materialises" in messages[0]


@pytest.mark.parametrize("family", ["lilt", "mpnet", "roformer"])
def test_training_dropout_follows_torch_seed(family):
    """In training the adapters pass the module's dropout p with a seed drawn from
    torch's generator: torch.manual_seed repeats a step exactly, a new seed changes it."""
    model = _model(family, hidden_dropout_prob=0.0).train()  # only attention dropout draws
    inputs = _inputs(family, model.config.pad_token_id)
    patches.patch(model, backend="reference")

    def step(seed):
        torch.manual_seed(seed)
        return model(**inputs).last_hidden_state

    first = step(0)
    assert torch.isfinite(first).all()
    assert torch.equal(first, step(0)) and not torch.equal(first, step(1))
