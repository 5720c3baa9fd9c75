"""One spy on ``torchattn.flash_attention``, for tests that check what patches and the trainer pass it."""

import torchattn


def record_calls(monkeypatch) -> list[dict]:
    """Wraps ``torchattn.flash_attention`` for the rest of the test; returns the list that collects
    each call's keyword arguments (backend, dropout_p, dropout_seed, ...), in call order."""
    calls = []
    original = torchattn.flash_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(torchattn, "flash_attention", spy)
    return calls
