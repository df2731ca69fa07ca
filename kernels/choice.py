"""Which kernel implementation a run uses: ``kernels.* = auto`` resolved for this machine and model.

The kernels (``megazero.kernels``): fused attention and AdamW (Triton, with torch fallbacks; a fused CPU AdamW),
grouped expert matmuls and Newton–Schulz. ``attend.attention(q, k, v, causal=True)`` is the attention entry
point; ``adam`` the AdamW step over flat buffers. Nothing here imports from the floors above (parallel,
models, the rest of megazero): a refused ``kernels.*`` value is an ``errors.UserError``, the project's one input
error. Importing this module loads neither torch nor triton.
"""


def resolve_kernels(kernels_cfg, device_type: str, head_dim: int | None = None, documents: bool = False) -> None:
    """Turn kernels.* = auto into the implementation this machine (and model: its attention head dim; the data:
    a document mask) runs;
    refuse 'triton' where it cannot (a UserError, one line naming the key and what is valid here)."""
    from megazero.kernels import adam, attend, norm

    kernels_cfg.adam = adam.resolve_impl(kernels_cfg.adam, device_type)
    kernels_cfg.norm = norm.resolve_impl(kernels_cfg.norm, device_type)
    kernels_cfg.attention = attend.resolve_impl(kernels_cfg.attention, device_type, head_dim, documents)
