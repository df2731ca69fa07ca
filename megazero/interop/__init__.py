"""Hugging Face interop: the layout tables (hf_layout), a folder's config.json (hf_config), import of weights
(hf_import) and export of a checkpoint as a Hugging Face model folder (export)."""
