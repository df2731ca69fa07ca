"""Fused kernels (Triton) with torch fallbacks: attention and AdamW over flat buffers.

``kernels.attend.attention(q, k, v, causal=True)`` is the attention entry point; ``kernels.adam`` the AdamW
step over flat buffers. The package imports nothing from the floors above it (parallel, models, megazero):
a refused ``kernels.*`` value is a ``kernels.errors.UserError``, the project's one input error. Importing the
package itself loads neither torch nor triton.
"""


def resolve_kernels(kernels_cfg, device_type: str, head_dim: int | None = None) -> None:
    """Turn kernels.* = auto into the implementation this machine (and model: its attention head dim) runs;
    refuse 'triton' where it cannot (a UserError, one line naming the key and what is valid here)."""
    from megazero.kernels import adam, attend

    kernels_cfg.adam = adam.resolve_impl(kernels_cfg.adam, device_type)
    kernels_cfg.attention = attend.resolve_impl(kernels_cfg.attention, device_type, head_dim)
