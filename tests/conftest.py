import os
import sys
from pathlib import Path

# Triton decides interpreted vs compiled when a function is decorated (its own tl.* at `import triton`
# included), so the mode must be set before anything imports triton. The kernel tests run Triton on CPU
# tensors through the interpreter; real runs pick kernels with kernels.* = auto | fused | triton | torch (adam).
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
