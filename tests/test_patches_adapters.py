"""Module adapters (patches/adapters/) against the eager originals: LiLT, MPNet, RoFormer.

Tiny random models from tests/hf_models.py on CPU. A padded batch (the second row
ends in padding) runs through the eager model and through a deep copy patched
with torchattn; outputs at real tokens and every parameter gradient of a
weighted loss over real tokens must agree, and ``unpatch`` must give back the
eager model bit for bit.
"""

import copy
import warnings

import pytest
import torch
import transformers

import hf_models as H
import patches

ADAPTED = [f.name for f in patches.VERIFIED if f.route is patches.families.Route.ADAPTER]  # LiLT, MPNet, RoFormer
SEQ = 13  # the second row: 4 padding tokens
ATOL = 1e-5


def _inputs(family):
    return H.padded_batch(family, SEQ, pad=4).inputs


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


# XLA:CPU compiles the whole model's forward and backward: ~3 s for one layer, ~8 s for two.
# Layers feeding layers (LiLT's layout stream, MPNet's shared bias) are covered on "reference",
# and so is rotary_value: the rotation is model code that runs before any backend.
LAYERS = {"reference": 2, "xla": 1}
# hf_models' RoFormer rotates v too (rotary_value=True); the cases add one that does not.
CASES = [pytest.param(family, overrides, backend, id=f"{family}{'-no_rotary_value' * bool(overrides)}-{backend}")
         for backend in LAYERS for family in ADAPTED
         for overrides in (({}, dict(rotary_value=False)) if family == "RoFormer" and backend == "reference"
                           else ({},))]


@pytest.mark.parametrize("family,overrides,backend", CASES)
def test_matches_eager_and_unpatches(family, overrides, backend, device):
    eager = H.build(family, num_hidden_layers=LAYERS[backend], **overrides)
    inputs = _inputs(family)
    weights = torch.randn(*inputs["input_ids"].shape, eager.config.hidden_size,
                          generator=torch.Generator().manual_seed(1))
    real = inputs["attention_mask"].bool()
    device = device if backend == "xla" else torch.device("cpu")
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
    if family == "MPNet":  # the relative-position bias trains through torchattn's dbias
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
    eager = H.build("RoFormer", model_class=transformers.RoFormerForCausalLM, is_decoder=True)
    patched = copy.deepcopy(eager)
    patches.patch(patched, backend="reference")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding, as for generation
    ids = torch.randint(4, H.VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
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
    eager = H.build("RoFormer", is_decoder=True, add_cross_attention=True)
    patched = copy.deepcopy(eager)
    patches.patch(patched, backend="reference")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, H.VOCAB, (2, 7), generator=g)
    hidden = eager.config.hidden_size
    encoder = dict(encoder_hidden_states=torch.randn(2, 11, hidden, generator=g),
                   encoder_attention_mask=(torch.arange(11) < torch.tensor([[8], [11]])).long())  # row 0: 8 real
    steps = {}
    with torch.no_grad():
        for name, model in (("eager", eager), ("patched", patched)):  # prompt, then one step on its cache
            first = model(input_ids=ids[:, :6], use_cache=True, **encoder)
            second = model(input_ids=ids[:, 6:], cache=first.cache, use_cache=True, **encoder)
            steps[name] = (first.last_hidden_state, second.last_hidden_state)
    assert steps["patched"][1].shape == (2, 1, hidden)
    torch.testing.assert_close(steps["patched"], steps["eager"], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family", ADAPTED)
def test_output_attentions_warns_once_and_returns_none(family):
    model = H.build(family)
    inputs = _inputs(family)
    with patches.patched(model, backend="reference"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**inputs, output_attentions=True)  # two layers, one warning
    assert out.attentions == (None, None)
    messages = [str(w.message) for w in caught if "output_attentions" in str(w.message)]
    assert len(messages) == 1 and family in messages[0] and "never materialises" in messages[0]


@pytest.mark.parametrize("family", ADAPTED)
def test_training_dropout_follows_torch_seed(family):
    """In training the adapters pass the module's dropout p with a seed drawn from
    torch's generator: torch.manual_seed repeats a step exactly, a new seed changes it."""
    model = H.build(family, attention_probs_dropout_prob=0.1).train()  # hf_models has no dropout: only this draws
    inputs = _inputs(family)
    patches.patch(model, backend="reference")

    def step(seed):
        torch.manual_seed(seed)
        return model(**inputs).last_hidden_state

    first = step(0)
    assert torch.isfinite(first).all()
    assert torch.equal(first, step(0)) and not torch.equal(first, step(1))
