"""megazero: pretrain transformers with tensor, pipeline, context, expert and ZeRO data parallelism.

``models/``, ``parallel/`` and ``kernels/`` sit beside this folder at the top of the source tree and are
imported only as ``megazero.models``, ``megazero.parallel`` and ``megazero.kernels``: an install maps them
there (pyproject.toml's ``package-dir``), and a source tree run without installing finds them through this
package's path (below). Only ``megazero`` is an import name of its own.

The three folders have no ``__init__.py``: with the tree's root on ``sys.path`` (``python pretrain.py``,
``python -m``, pytest, a script run from the root) a bare ``import kernels`` then finds an installed package
of that name before the folder, as Python prefers a regular package anywhere on the path to a namespace
portion. Hugging Face's ``kernels``, which transformers imports, is one.
"""
import os as _os

_TREE = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

if _os.path.isfile(_os.path.join(_TREE, "pyproject.toml")) and _os.path.isdir(_os.path.join(_TREE, "kernels")):
    __path__.append(_TREE)  # a source tree: megazero.kernels is <tree>/kernels, and so on
