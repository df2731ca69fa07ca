"""Hugging Face interop: the layout tables (hf_layout), import of weights (hf_import) and export of a
checkpoint as a Hugging Face model folder (export)."""
