"""Data for GPT pretraining: what the trainer asks for, built once and cached.

``build_data`` (``build``) turns the ``data`` config section into a :class:`GPTData` (``gpt_data``):

* ``data.paths`` lists raw text (files or directories, see ``documents``) or
  preprocessed prefixes (``PREFIX.bin`` + ``PREFIX.idx``); empty means the
  built-in corpus (the Python standard library, see ``corpus``). An entry
  may be a mapping ``{path, weight, name}``: the sources are then blended by
  weight (``blend``), else by their sizes. Each source keeps its own
  validation split, evaluated and reported under its name.
* ``data.tokenizer`` is a Hugging Face ``tokenizer.json`` (the ids a model
  imported from the Hub was trained on), a sentencepiece ``.model``, or
  ``'train'`` (a BPE of ``model.vocab_size`` pieces trained on the raw text,
  ``tokenizer_training``). ``Tokenizer.load`` (``tokenizer``) tells the two files apart.
* Tokenizers, tokenised datasets and the built-in corpus go to
  ``data.cache_dir`` under names that hash their inputs (``cache_plan``), so a
  changed input is rebuilt and an unchanged one is reused.

``python -m megazero.data.preprocess`` tokenises text into a dataset prefix ahead of a run (``preprocess``).

This file is only the package's face: the names callers import from ``megazero.data``. No module of the
package imports it.
"""

from megazero.data.build import build_data
from megazero.data.gpt_data import GPTData
from megazero.data.tokenizer import Tokenizer

__all__ = ["GPTData", "build_data", "Tokenizer"]
