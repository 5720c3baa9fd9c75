"""Every verified family (``patches.VERIFIED``) patched onto torchattn, against the same model in eager.

Tiny random models from tests/hf_models.py. The patched model runs on the XLA
device (backends "xla" and "interpret"; "interpret" on CPU tensors in .venv-current, the
``kernel_device`` fixture), the eager one on the CPU in float32:
outputs at real tokens and every parameter gradient must agree (padded batch),
packed documents must come out as if run one by one, and patching must be
invisible once undone: no parameter, state_dict entry or saved config changes,
and ``unpatch`` restores bit-identical outputs. The largest differences per
family are printed at the end of the run (tests/conftest.py).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers

import hf_models as H
from numerics import sync
import patches
import torchattn
from patches import masks, registration


FAMILIES = [f.name for f in patches.VERIFIED]
INTERFACE = [f.name for f in patches.VERIFIED if f.route is patches.families.Route.INTERFACE]
PACKING = [f.name for f in patches.VERIFIED if any(x.startswith("packing") for x in f.features)]
# Families whose attention also gets position_ids, so the collator's default output (no
# cu_seq_lens) is enough; the others' features say "packing (cu_seq_lens)".
PACKING_BY_POSITIONS = [f.name for f in patches.VERIFIED if "packing" in f.features]
# "xla" needs torch_xla; "interpret" runs where the kernels run in this environment (kernel_device): every family
# where that is the CPU (.venv-current). Under torch_xla (.venv) it adds the call_jax bridge to what the families test,
# which the kernels' own matrix covers (tests/test_kernel_interpret.py): there one family (Llama: GQA, causal, packed
# by cu_seq_lens) stands for the others.
INTERPRET_FAMILIES = ["Llama"] if importlib.util.find_spec("torch_xla") else FAMILIES
BACKEND_CASES = ([pytest.param(f, "xla", id=f"{f}-xla", marks=pytest.mark.xla) for f in FAMILIES]
                 + [pytest.param(f, "interpret", id=f"{f}-interpret") for f in INTERPRET_FAMILIES])
SEQ = 200  # second row: 66 padding tokens
# Small blocks so the padded batch spans 4 query x 2 key blocks, with windows and padding
# skipping some: the model-level test then also covers block skipping and partial blocks.
BLOCKS = torchattn.BlockSizes(block_q=64, block_kv=128, block_q_bwd=64, block_kv_bwd=128)
ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture
def kernel_calls(monkeypatch):
    """The backend of every torchattn.flash_attention call: proves the patched model really
    ran torchattn, once per layer (an unpatched model on XLA would match eager too)."""
    calls = []
    real = torchattn.flash_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torchattn, "flash_attention", spy)
    return calls


def _forward_backward(model, batch, weights):
    """last hidden state and {name: grad or None} of sum(out * weights) over real tokens, on the CPU."""
    model.zero_grad(set_to_none=True)
    out = model(**batch.inputs).last_hidden_state
    (out * weights.to(out.device) * batch.valid[..., None]).sum().backward()
    sync(out)  # on XLA forward and backward as one graph, compiled once, before anything is read
    return out.detach().cpu(), {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}


@functools.cache
def _eager_padded(family):
    model = H.build(family)
    batch = H.padded_batch(family, SEQ)
    weights = torch.randn(2, SEQ, model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    return batch, weights, *_forward_backward(model, batch, weights)


def _grad_diff(got: dict, want: dict) -> tuple[float, float]:
    """Largest |got - want| over every parameter gradient, and that relative to the largest |want|.
    A gradient eager leaves None (the unused pooler, LayoutLMv3's no_grad relative biases, LiLT's
    last layout_value) must be None or all zero."""
    assert got.keys() == want.keys()
    worst = scale = 0.0
    for name, w in want.items():
        g = got[name]
        if w is None:
            assert g is None or not g.any(), f"{name}: eager has no gradient, patched has a non-zero one"
            continue
        assert g is not None, f"{name}: eager has a gradient, patched has none"
        torch.testing.assert_close(g, w, atol=ATOL * max(1.0, w.abs().max().item()), rtol=RTOL,
                                   msg=lambda m: f"{name}: {m}")
        worst = max(worst, (g - w).abs().max().item())
        scale = max(scale, w.abs().max().item())
    return worst, worst / scale


def test_tiny_models_keep_what_makes_each_family_different():
    """A config typo would silently drop a feature (Qwen2 ignores sliding_window without
    use_sliding_window, for one) and the comparisons below would test less than they say."""
    configs = {f: H.config(f) for f in FAMILIES}
    assert configs["ModernBERT"].layer_types == ["full_attention", "sliding_attention"]
    assert configs["Qwen2"].layer_types == ["full_attention", "sliding_attention"]
    assert configs["Gemma 2"].layer_types == ["sliding_attention", "full_attention"]
    assert configs["ModernBERT"].local_attention == 4
    assert {configs[f].sliding_window for f in ("Qwen2", "Mistral", "Gemma 2")} == {4}
    gemma = configs["Gemma 2"]
    assert gemma.attn_logit_softcapping == 2.0 and gemma.query_pre_attn_scalar != gemma.head_dim
    assert configs["LayoutLMv3"].has_relative_attention_bias and configs["LayoutLMv3"].has_spatial_attention_bias
    assert configs["RoFormer"].rotary_value
    assert {configs[f].num_key_value_heads for f in ("Llama", "Qwen2", "Mistral", "Gemma 2")} == {2}  # GQA
    for cfg in configs.values():
        assert cfg.num_hidden_layers == 2 and cfg.num_attention_heads == 4 and cfg.max_position_embeddings >= 1100
        assert cfg._attn_implementation == "eager"


@pytest.mark.parametrize("family,backend", BACKEND_CASES)
def test_padded_batch_outputs_and_every_gradient_match_eager(family, backend, request, kernel_calls):
    device = _device(request, backend)
    batch, weights, want, want_grads = _eager_padded(family)
    model = H.build(family).to(device)
    patches.patch(model, backend, block_sizes=BLOCKS)
    got, got_grads = _forward_backward(model, batch.to(device), weights)

    assert kernel_calls == [backend] * model.config.num_hidden_layers
    valid = batch.valid
    torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=RTOL)
    grad, grad_rel = _grad_diff(got_grads, want_grads)
    H.MAX_DIFFS[family][backend].update(out=(got - want)[valid].abs().max().item(), grad=grad, grad_rel=grad_rel)


# Document boundaries from cu_seq_lens on both backends; from position_ids alone (the collator's
# default) on "xla" only: turning them into segment ids happens before any backend.
PACKED_CASES = ([pytest.param(f, "xla", True, id=f"{f}-xla", marks=pytest.mark.xla) for f in PACKING]
                + [pytest.param(f, "interpret", True, id=f"{f}-interpret") for f in PACKING if f in INTERPRET_FAMILIES]
                + [pytest.param(f, "xla", False, id=f"{f}-xla-position_ids", marks=pytest.mark.xla)
                   for f in PACKING_BY_POSITIONS])


def _device(request, backend: str):
    """The device a patched model runs on for ``backend``: XLA for "xla", kernel_device for "interpret"."""
    return request.getfixturevalue("kernel_device" if backend == "interpret" else "device")


@pytest.mark.parametrize("family,backend,flash_kwargs", PACKED_CASES)
def test_packed_documents_match_each_document_run_alone(family, backend, flash_kwargs, request, kernel_calls):
    """DataCollatorWithFlattening's packed row against each document run separately in eager
    (the eager model itself cannot isolate packed documents in most families). Gradients too:
    the parameters are shared, so the packed row's loss gradient is the sum of the documents'
    gradients exactly when no document sees another."""
    packed = H.packed_batch(family, flash_kwargs=flash_kwargs)
    assert ("cu_seq_lens_q" in packed.inputs) == flash_kwargs
    eager = H.build(family)
    hidden = eager.config.hidden_size
    weights = torch.randn(packed.inputs["input_ids"].shape[1], hidden, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([eager(**doc).last_hidden_state[0] for doc in packed.documents])  # (tokens, hidden)
    (alone * weights).sum().backward()
    want = alone.detach()
    want_grads = {n: None if p.grad is None else p.grad for n, p in eager.named_parameters()}

    device = _device(request, backend)
    model = H.build(family).to(device)
    patches.patch(model, backend, block_sizes=BLOCKS)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.inputs.items()}
    out = model(**inputs).last_hidden_state[0]
    (out * weights.to(device)).sum().backward()
    sync(out)
    got = out.detach().cpu()
    got_grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}

    assert kernel_calls == [backend] * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    _grad_diff(got_grads, want_grads)
    H.MAX_DIFFS[family][backend]["packed" if flash_kwargs else "packed_pos"] = (got - want).abs().max().item()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in PACKING])
def test_packing_not_served_for_the_reason_in_the_family_table(family, monkeypatch):
    """Families without "packing" among their features: the family table says why, and it
    holds: the documents' boundaries never reach the attention, so a packed batch leaks
    across documents, patched or not."""
    family = next(f for f in patches.VERIFIED if f.name == family)
    reason = next((n for n in family.not_served if n.startswith("packing:")), None)
    assert reason, f"{family.name}: no packing feature and no reason in patches/families.py"
    seen = []
    real = masks.from_hf

    def spy(attention_mask, **kwargs):
        seen.append((kwargs["cu_seq_lens_q"], kwargs["position_ids"]))
        return real(attention_mask, **kwargs)

    monkeypatch.setattr(masks, "from_hf", spy)
    packed = H.packed_batch(family.name)
    model = H.build(family.name)
    with torch.no_grad():
        alone = torch.cat([model(**doc).last_hidden_state[0] for doc in packed.documents])
        with patches.patched(model, "reference"):
            got = model(**packed.inputs).last_hidden_state[0]
    assert seen and all(cu is None and pos is None for cu, pos in seen), reason
    assert (got - alone).abs().max() > 1e-2  # the leak is real: the family must not claim packing


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_changes_no_parameter_and_unpatch_restores_bit_identical_outputs(family):
    model = H.build(family)
    batch = H.padded_batch(family, 24)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(**batch.inputs).last_hidden_state
        patches.patch(model, "reference")
        assert model.config._attn_implementation == patches.NAME
        after = model.state_dict()
        assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
        assert dict(model.named_parameters()) == params  # the same Parameter objects
        during = model(**batch.inputs).last_hidden_state
        patches.unpatch(model)
        restored = model(**batch.inputs).last_hidden_state
    torch.testing.assert_close(during[batch.valid], before[batch.valid], atol=ATOL, rtol=RTOL)
    assert torch.equal(restored, before)
    assert model.config._attn_implementation == "eager"
    assert not [m for m in model.modules() if "forward" in m.__dict__]  # no adapter left behind


@pytest.mark.filterwarnings("ignore:torchattn. backend 'sdpa' cannot serve")  # Gemma 2's softcap: reference
@pytest.mark.parametrize("family", INTERFACE)
def test_loading_with_attn_implementation_equals_patching_after_load(family):
    """``Model(config)`` with attn_implementation="torchattn" and ``_from_config(...,
    attn_implementation="torchattn")`` run the same computation as ``patch`` on a loaded model."""
    eager = H.build(family)
    cls = type(eager)
    batch = H.padded_batch(family, 24)
    cfg = H.config(family)
    from_config = cls._from_config(copy.deepcopy(cfg), attn_implementation=patches.NAME)
    constructed = cls(H.config(family, attn_implementation=patches.NAME))
    assert cfg._attn_implementation == "eager"  # _from_config mutated only the copy it was given
    with torch.no_grad():
        patches.patch(eager, "auto")  # on the CPU, as the never-patched models' default options
        want = eager(**batch.inputs).last_hidden_state
        for model in (from_config, constructed):
            assert model.config._attn_implementation == patches.NAME
            model.load_state_dict(eager.state_dict())
            assert torch.equal(model.eval()(**batch.inputs).last_hidden_state, want)


def test_saved_patched_model_loads_without_torchattn(tmp_path):
    model = H.build("BERT")
    batch = H.padded_batch("BERT", 24)
    patches.patch(model, "reference")
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert patches.NAME not in json.dumps(saved)
    with torch.no_grad():
        want = model(**batch.inputs).last_hidden_state
    torch.save(batch.inputs, tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModel
        model = AutoModel.from_pretrained({str(tmp_path)!r}).eval()
        assert not any(name.split(".")[0] in ("patches", "torchattn") for name in sys.modules)
        with torch.no_grad():
            out = model(**torch.load({str(tmp_path / "inputs.pt")!r})).last_hidden_state
        torch.save((model.config._attn_implementation, out), {str(tmp_path / "out.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    implementation, got = torch.load(tmp_path / "out.pt")
    assert implementation != patches.NAME
    torch.testing.assert_close(got[batch.valid], want[batch.valid], atol=ATOL, rtol=RTOL)


def test_unsupported_model_is_refused_naming_it_and_the_supported_families():
    config = transformers.DebertaV2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=100)
    model = transformers.DebertaV2Model(config)
    with pytest.raises(NotImplementedError, match="DebertaV2Model") as raised:
        patches.patch(model)
    assert all(name in str(raised.value) for name in FAMILIES)
    assert not hasattr(model, "_torchattn_patch") and model.config._attn_implementation != patches.NAME


def test_double_patch_raises_and_unpatching_twice_raises():
    model = H.build("BERT")
    patches.patch(model, "reference")
    with pytest.raises(ValueError, match="already patched"):
        patches.patch(model, "reference")
    patches.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        patches.unpatch(model)


def test_register_is_idempotent():
    functions = dict(transformers.AttentionInterface._global_mapping)
    mask_functions = dict(transformers.AttentionMaskInterface._global_mapping)
    patches.register()
    patches.register()
    assert dict(transformers.AttentionInterface._global_mapping) == functions
    assert dict(transformers.AttentionMaskInterface._global_mapping) == mask_functions
    assert functions[patches.NAME] is patches.attention.torchattn_attention


def test_unverified_transformers_version_warns_once_naming_both_versions(monkeypatch):
    monkeypatch.setattr(torchattn.once, "_shown", set())
    # The module object registration.py reads: importing some model classes re-executes transformers'
    # lazy __init__, so sys.modules["transformers"] may no longer be the object imported here.
    monkeypatch.setattr(registration.transformers, "__version__", "5.99.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches.register()
        patches.register()
    caught = [w for w in caught if issubclass(w.category, registration.UnverifiedTransformersWarning)]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "5.99.1" in message and "5.24" in message


def test_list_prints_every_verified_and_unsupported_family():
    listing = subprocess.run([sys.executable, "-m", "patches", "--list"], check=True, capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             env=_env()).stdout
    rows = {line.split("  ")[0] for line in listing.splitlines()}
    assert set(FAMILIES) <= rows
    for model_type in patches.UNSUPPORTED:
        assert any(line.startswith(model_type) and "unsupported" in line for line in listing.splitlines())
    for family in patches.VERIFIED:
        row = next(line for line in listing.splitlines() if line.startswith(family.name + " "))
        assert all(f"not served: {n}" in row for n in family.not_served)


def test_dense_4d_mask_from_the_caller_is_served_with_one_warning(device, monkeypatch):
    """A caller's own (batch, 1, S, S) additive mask reaches the attention unchanged; torchattn
    serves it as a dense bias (matching eager) and says so once, naming the module."""
    monkeypatch.setattr(torchattn.once, "_shown", set())
    eager = H.build("BERT")
    batch = H.padded_batch("BERT", 24)
    g = torch.Generator().manual_seed(5)
    keep = (torch.rand(2, 1, 24, 24, generator=g) > 0.4) & batch.valid[:, None, None, :]
    keep |= torch.eye(24, dtype=torch.bool)  # every query sees at least itself
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    inputs = dict(batch.inputs, attention_mask=additive)
    with torch.no_grad():
        want = eager(**inputs).last_hidden_state
        model = H.build("BERT").to(device)
        patches.patch(model, "xla")
        on_device = {k: v.to(device) for k, v in inputs.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model(**on_device).last_hidden_state.cpu()
            model(**on_device)  # traced, never run: only the warning matters
    dense = [str(w.message) for w in caught if "dense 4-D attention mask" in str(w.message)]
    assert len(dense) == 1 and "BertSelfAttention" in dense[0] and "bias" in dense[0], dense
    torch.testing.assert_close(got[batch.valid], want[batch.valid], atol=ATOL, rtol=RTOL)


def _env():
    """The test process's environment, with the repository importable (for ``-m patches``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))


def test_patching_something_else_than_a_transformers_model_is_a_type_error():
    with pytest.raises(TypeError, match="model: expected a transformers PreTrainedModel, got Linear"):
        patches.patch(torch.nn.Linear(2, 2))


def test_output_attentions_on_a_patched_model_warns_naming_the_option(monkeypatch):
    """transformers' sdpa path warns that it cannot return attention weights; so does torchattn."""
    monkeypatch.setattr(torchattn.once, "_shown", set())
    model = H.build("Llama")
    batch = H.padded_batch("Llama", 12)
    patches.patch(model, "reference")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**batch.inputs, output_attentions=True)
    assert all(a is None for a in out.attentions)  # no weights: an empty tuple
    messages = [str(w.message) for w in caught if "output_attentions" in str(w.message)]
    assert len(messages) == 1 and "LlamaAttention" in messages[0], messages
