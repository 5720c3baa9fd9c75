"""torchattn: TPU-native flash attention for PyTorch/XLA with Pallas kernels."""

from . import _versions

_versions.check_versions()  # before importing torch: a mismatched torch/torch_xla pair fails here, clearly

from . import torchtpu  # noqa: E402

torchtpu.skip_metadata_server_without_tpu()  # before any backward: libtpu's 10-minute wait on a machine without TPU

from . import counters  # noqa: E402
from .api import explain, flash_attention  # noqa: E402
from .block_sizes import BlockSizes  # noqa: E402
from .context import balanced_order  # noqa: E402
from .dropout import dropout_mask  # noqa: E402
from .reference import attention_reference  # noqa: E402
from .sharding import sharded  # noqa: E402
from .tune_cache import clear_tuned, tuned  # noqa: E402
from .tuning import tune  # noqa: E402

__version__ = "0.1.0"

__all__ = ["flash_attention", "explain", "BlockSizes", "dropout_mask", "attention_reference", "sharded",
           "balanced_order", "tune", "tuned", "clear_tuned", "counters", "__version__"]
