"""Backends serve only the call features they declare (torchattn/features.py): a feature added to the
declaration is refused by every backend, by name, until one declares it."""

import dataclasses

import pytest
import torch

import torchattn
from torchattn import backends, features
from torchattn.api import validated
from torchattn.backend import Backend


@pytest.fixture
def new_feature(monkeypatch):
    """A feature every call uses, declared at runtime as a new static option would be."""
    feature = features.Feature("sharpness", lambda request: True)
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
