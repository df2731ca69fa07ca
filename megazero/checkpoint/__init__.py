"""Checkpoints stored per logical parameter, loadable into any layout: DCP I/O (store), the background
writer (writer), meta.json checks (meta), the allow-list unpickler (unpickle) and the tensor layout (layout)."""
