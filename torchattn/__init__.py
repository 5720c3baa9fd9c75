"""torchattn: TPU-native flash attention for PyTorch/XLA with Pallas kernels."""

from . import _versions

_versions.check_versions()  # before importing torch: a mismatched torch/torch_xla pair fails here, clearly

from .runtimes import torchtpu  # noqa: E402

torchtpu.skip_metadata_server_without_tpu()  # before any backward: libtpu's 10-minute wait on a machine without TPU

from . import counters  # noqa: E402
from .api import explain, flash_attention  # noqa: E402
from .kernels.block_sizes import BlockSizes  # noqa: E402
from .spmd.context import balanced_order  # noqa: E402
from .semantics.dropout import dropout_mask  # noqa: E402
from .backends.reference import attention_reference  # noqa: E402
from .spmd.sharding import sharded  # noqa: E402
from .call.tune_cache import clear_tuned, tuned  # noqa: E402
from .tuning.search import tune  # noqa: E402

__version__ = "0.1.0"

__all__ = ["flash_attention", "explain", "BlockSizes", "dropout_mask", "attention_reference", "sharded",
           "balanced_order", "tune", "tuned", "clear_tuned", "counters", "__version__"]
