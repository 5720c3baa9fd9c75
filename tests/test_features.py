"""Backends serve only the call features they declare (torchattn/call/features.py): a feature added to the
declaration is refused by every backend, by name, until one declares it; everything a call's features set
follows from the declaration."""

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchattn
from torchattn import api, backends
from torchattn.call import features
from torchattn.api import validated
from torchattn.backends.backend import Backend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def new_feature(monkeypatch):
    """A feature every call uses, declared at runtime as a new static option would be."""
    feature = features.Feature(name="sharpness", arguments=(), check=lambda call: (), fields=(),
                               used=lambda request: True)
    monkeypatch.setattr(features, "FEATURES", [*features.FEATURES, feature])
    return feature


def cpu_call():
    q = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    return validated(q, torch.randn_like(q), torch.randn_like(q))


def test_every_backend_refuses_an_undeclared_feature_by_name(new_feature):
    request = cpu_call()
    for name, backend in backends.BACKENDS.items():
        assert features.unsupported(request, backend.features) == ["sharpness"], name
    # On the CPU tensors, reference and sdpa are otherwise able: both refuse it, naming it.
    for name in ("reference", "sdpa"):
        assert backends.BACKENDS[name].refusal(request) == "sharpness: not among the features it serves"
    with pytest.raises(ValueError, match="no backend can serve this call: .*'reference': sharpness"):
        backends.choose(request)


def test_a_backend_serves_the_feature_once_it_declares_it(new_feature, monkeypatch):
    request = cpu_call()
    reference = backends.BACKENDS["reference"]
    declaring = dataclasses.replace(reference, features=reference.features | {"sharpness"})
    monkeypatch.setitem(backends.BACKENDS, "reference", declaring)
    assert declaring.refusal(request) is None
    choice = backends.choose(request)
    assert choice.backend == "reference"
    assert choice.passed_over["sdpa"] == "sharpness: not among the features it serves"


def test_without_the_new_feature_every_backend_declares_only_known_ones():
    known = {feature.name for feature in features.FEATURES}
    for name, backend in backends.BACKENDS.items():
        assert backend.features <= known and "scale" in backend.features, name
    with pytest.raises(TypeError, match=r"backend 'typo': features \['sofcap'\] are not declared"):
        Backend("typo", lambda request: None, frozenset({"scale", "sofcap"}), dense=lambda request: None)


def test_sdpa_refuses_what_it_does_not_declare_with_its_reason():
    q = torch.randn(1, 2, 16, 8)
    choice = torchattn.explain(q, q, q, softcap=5.0)
    assert choice.backend == "reference"
    assert choice.passed_over["sdpa"] == "softcap: SDPA has no logit soft-capping"


def test_flash_attention_takes_the_declared_arguments_with_their_defaults():
    parameters = inspect.signature(torchattn.flash_attention).parameters
    declared = {name: parameter.default for name, parameter in parameters.items()
                if name not in ("q", "k", "v", "block_sizes", "backend")}
    assert declared == features.arguments()
    assert list(declared) == list(features.arguments())  # the same order: the checks run in it


def test_flash_attention_passes_every_declared_argument_on(monkeypatch):
    """Its signature is written out for users; what it passes to the validation is checked here, so a parameter
    added to the signature but not passed on cannot be silently ignored."""
    given = {}

    def spy(q, k, v, **kwargs):
        given.update(kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(api, "validated", spy)
    marked = {name: object() for name in [*features.arguments(), "block_sizes"]}
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(RuntimeError, match="stop"):
        torchattn.flash_attention(q, q, q, **marked)
    assert given.keys() == marked.keys() and all(given[name] is marked[name] for name in marked)


# A static option added the way a developer adds one (in a copy of the package): its Feature appended to
# torchattn/call/features.py and its Options field in torchattn/call/request.py; for python -m torchattn.aot, its Flag
# and its Attention field. No other file is edited; the call then runs through everything derived from the declaration.
NEW_OPTION = {
    "call/features.py": ("", """
FEATURES.append(Feature(
    name="sharpness", arguments=(("sharpness", 1.0),), check=lambda call, x: (positive_float("sharpness", x, 1.0),),
    fields=(option("sharpness", "float"),), used=lambda r: r.options.sharpness != 1.0,
    tuned=lambda r: r.options.sharpness))
"""),
    "call/request.py": ("    # Every call's.\n    block_sizes", "    sharpness: float\n"),
    "aot/flags.py": ("", """
FLAGS += (Flag(feature="sharpness", name="sharpness", field="sharpness", default=1.0,
               arguments=lambda x, a: dict(sharpness=x), parse=float),)
"""),
    "aot/attention.py": ("\n    def request(", "    sharpness: float = 1.0\n"),
}
CALLS = """
import dataclasses, json, torch
import torchattn
from torchattn import api, backends
from torchattn.call import tune_cache
from torchattn.aot import Attention
from torchattn.aot.__main__ import parse_args
assert torchattn.__file__.startswith(%r), torchattn.__file__
q = torch.randn(1, 2, 16, 8, dtype=torch.float64)
request = api.validated(q, q, q, sharpness=2.0)
seen = dict(option=request.options.sharpness,
            schema="float sharpness" in str(torch.ops.torchattn.attention_forward.default._schema),
            refusals={name: backend.refusal(request) for name, backend in backends.BACKENDS.items()},
            unused=torchattn.explain(q, q, q).backend, key=dict(tune_cache.Key.of(request).features)["sharpness"],
            aot=Attention(batch=1, q_heads=2, kv_heads=2, q_len=16, kv_len=16, head_dim=8,
                          sharpness=3.0).request().options.sharpness,
            flag=parse_args(["--generation", "v5e", "--q-heads", "2", "--seq-len", "16", "--head-dim", "8",
                             "--sharpness", "4"]).sharpness)
try:
    api.validated(q, q, q, sharpness=-1.0)
except ValueError as error:
    seen["bad"] = str(error)
reference = backends.BACKENDS["reference"]
backends.BACKENDS["reference"] = dataclasses.replace(reference, features=reference.features | {"sharpness"})
seen["declared"] = torchattn.explain(q, q, q, sharpness=2.0).backend
print(json.dumps(seen))
"""


def _printed_with_declaration(tmp_path, declaration: dict, script: str):
    """What ``script`` (``%r``: the copy's path) prints last, as JSON, run against a copy of the package in which
    each file of ``declaration`` ({path: (the text before which, text)}; "": at the end) has its text; no other
    file of the copy differs."""
    package = tmp_path / "torchattn"
    shutil.copytree(ROOT / "torchattn", package, ignore=shutil.ignore_patterns("__pycache__"))
    for path, (before, text) in declaration.items():
        source = (package / path).read_text()
        assert not before or source.count(before) == 1, f"{path}: {before!r} is where the text goes"
        (package / path).write_text(source + text if not before else source.replace(before, text + before))
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", script % str(package)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_static_option_declared_in_its_places_is_validated_carried_keyed_and_refused_until_served(tmp_path):
    seen = _printed_with_declaration(tmp_path, NEW_OPTION, CALLS)
    assert seen["option"] == 2.0 and seen["schema"]  # an Options field, through the custom ops
    assert seen["bad"] == "sharpness: expected a finite float > 0 or None, got -1.0"
    assert seen["key"] == 2.0  # the tune key
    assert seen["aot"] == 3.0 and seen["flag"] == 4.0  # torchattn.aot's Attention and its CLI flag
    reasons = seen["refusals"]
    assert reasons["reference"] == reasons["sdpa"] == "sharpness: not among the features it serves"
    assert all(reason for reason in reasons.values()), reasons  # every backend refuses the call
    assert seen["unused"] == "sdpa"  # a call that does not use it is served as before
    assert seen["declared"] == "reference"


# A second per-(q, kv) pair input, declared the same way (its Feature, its Tensors field): the backends' math reads
# such inputs by their role (each a term added to the logits, with its own gradient), so it needs no change there.
NEW_PAIR_INPUT = {
    "call/features.py": ("", """
FEATURES.append(Feature(
    name="bias2", arguments=(("bias2", None),), check=pair_tensor_check("bias2"),
    fields=(tensor("bias2", PAIRS, heads=True, grad=True),), used=lambda r: r.inputs.bias2 is not None))
"""),
    "call/request.py": ("    # The per-device tables.", "    bias2: torch.Tensor | None = None\n"),
}
PAIR_CALLS = """
import dataclasses, json, torch, torch_xla
import torchattn
from torchattn import api, backends
assert torchattn.__file__.startswith(%r), torchattn.__file__
xla = torch_xla.device()
g = torch.Generator().manual_seed(0)
errors = {}
for name, dtype, device in (("xla", torch.float64, xla), ("interpret", torch.float32, xla),
                            ("reference", torch.float64, "cpu"), ("sdpa", torch.float64, "cpu")):
    backend = backends.BACKENDS[name]
    backend = dataclasses.replace(backend, features=backend.features | {"bias2"})
    q, k, v = (torch.randn(1, 2, 80, 16, generator=g, dtype=dtype) for _ in range(3))
    full = torch.randn(1, 2, 80, 80, generator=g, dtype=dtype)
    row = torch.randn(1, 1, 1, 80, generator=g, dtype=dtype)  # broadcast over batch, heads and q rows
    leaves = [t.to(device).requires_grad_() for t in (q, k, v, full, row)]
    request = api.validated(*leaves[:3], causal=True, bias=leaves[3], bias2=leaves[4],
                            block_sizes=torchattn.BlockSizes(16, 128, 16, 128))
    out, _ = backends.run(request, backend)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    reference = [t.detach().double().requires_grad_() for t in (q, k, v, full, row)]
    want = torchattn.flash_attention(*reference[:3], causal=True, bias=reference[3] + reference[4],
                                     backend="reference")
    wanted = torch.autograd.grad(want, reference, torch.ones_like(want))
    errors[name] = [(out.cpu().double() - want).abs().max().item()] + [
        (got.cpu().double() - w).abs().max().item() for got, w in zip(grads, wanted)]
print(json.dumps(errors))
"""


@pytest.mark.xla  # the child runs the xla backend and the interpret kernels on XLA:CPU
def test_a_second_per_pair_input_declared_in_its_places_is_added_to_the_logits_by_every_backend(tmp_path):
    errors = _printed_with_declaration(tmp_path, NEW_PAIR_INPUT, PAIR_CALLS)
    # out, dq, dk, dv, then each pair input's gradient (the broadcast one summed over its broadcast dims),
    # against float64 with the two terms as one bias: float64 exact to rounding, float32 to its own.
    assert max(errors["xla"] + errors["reference"] + errors["sdpa"]) < 1e-10, errors
    assert max(errors["interpret"]) < 1e-4, errors
