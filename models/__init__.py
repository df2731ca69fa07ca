"""The model: one pipeline stage of a GPT-2 or Llama transformer, built from ``parallel``'s tensor-parallel layers.

``stage`` (the stage container and what it declares to data parallelism), ``block`` (the one pre-norm block),
``parts`` (which norm, attention and MLP each architecture uses), ``gpt2`` and ``llama`` (those parts),
``split`` (the parallel state the parts are built with), ``init`` (layout-free initial values), ``build``
(meta-device build, materialisation, parameter count), ``arch`` (what ``model.arch`` implies).
"""
