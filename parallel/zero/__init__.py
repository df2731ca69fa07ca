"""ZeRO data parallelism as composed parts; see ``parallel.zero.optimizer``."""
from megazero.parallel.zero.grads import grad_precision
from megazero.parallel.zero.layout import Bucket, BucketLayout
from megazero.parallel.zero.optimizer import DTYPES, ZeroOptimizer
from megazero.parallel.zero.policy import StagePolicy

__all__ = ["Bucket", "BucketLayout", "DTYPES", "StagePolicy", "ZeroOptimizer", "grad_precision"]
