"""ZeRO data parallelism as composed parts; see ``parallel.zero.optimizer``."""
from parallel.zero.grads import grad_precision
from parallel.zero.layout import Bucket, BucketLayout
from parallel.zero.optimizer import DTYPES, ZeroOptimizer
from parallel.zero.policy import StagePolicy

__all__ = ["Bucket", "BucketLayout", "DTYPES", "StagePolicy", "ZeroOptimizer", "grad_precision"]
