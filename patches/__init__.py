"""torchattn inside Hugging Face transformers models, through transformers' own extension points.

    import patches                       # registers "torchattn"
    model = AutoModel.from_pretrained(path, attn_implementation="torchattn")
    # or, on a loaded model:
    handle = patches.patch(model, backend="auto")
    patches.unpatch(model)
    with patches.patched(model): ...
"""

from .families import UNSUPPORTED, VERIFIED
from .options import PatchOptions
from .patching import PatchHandle, patch, patched, unpatch
from .registration import NAME, register

register()

__all__ = ["register", "patch", "unpatch", "patched", "PatchHandle", "PatchOptions", "NAME", "VERIFIED",
           "UNSUPPORTED"]
