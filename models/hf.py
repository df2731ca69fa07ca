"""What an architecture's spec says about Hugging Face folders: the name and layout change of each parameter
(:class:`Link`), and the one row (:class:`HfSpec`) that holds its model types, tensor names and config keys.

The tables themselves are each architecture's (``models.gpt2_spec``, ``models.llama_hf``); the generic machinery
that reads, writes and checks folders with them is ``megazero.interop``. Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig


@dataclass(frozen=True)
class Link:
    """One megazero parameter: its full shape here, its HF tensor name, and the layout change
    (``megazero.interop.hf_layout``'s doc); ``alt``: transformers 5's own name of it, where a folder may hold that
    instead (``experts``: their stack, ``part`` 0 or 1 the gate or up half of a stacked gate_up, -1 all of it)."""

    shape: tuple[int, ...]
    hf: str
    kind: str = "copy"
    alt: str = ""
    part: int = -1


def expert_keys(link: Link) -> list[str]:
    """The HF names of an ``experts`` link's E tensors, expert 0 first."""
    assert link.kind == "experts", link
    return [link.hf.format(e=e) for e in range(link.shape[0])]


class HfFields(Protocol):
    """Typed, range-checked reads of an untrusted config.json (``megazero.interop.hf_config`` makes them): the
    spec's reader asks for keys through it, so every value is checked and every refusal is one line."""

    raw: dict
    where: str

    def get(self, key: str, kind: type, default: Any = None) -> Any: ...

    def shown(self, value: Any) -> str: ...

    def nested(self, raw: dict, prefix: str) -> "HfFields": ...


@dataclass(frozen=True)
class HfSpec:
    """An architecture as Hugging Face folders hold it. ``classes``: each HF model_type it is written or read as
    -> its class, in the order a message lists them; ``titles``: model_type -> how a message names it."""

    classes: Mapping[str, str]
    titles: Mapping[str, str]
    activation: tuple[str, tuple[str, ...]]  # config.json's activation key and the values megazero computes
    model_type: Callable[["ModelConfig", str], str]  # (resolved config, where) -> the model_type written; refusals
    links: Callable[["ModelConfig", str], dict[str, Link]]  # every parameter -> its Link, for a model_type
    config: Callable[["ModelConfig", str], dict]  # the config.json keys of that model_type (but the common ones)
    read: Callable[[dict, HfFields, str], dict[str, Any]]  # a folder's config.json -> megazero's model keys
    buffers: Callable[["ModelConfig"], list[str]]  # tensors folders hold that are no parameters (never read)
    tokenizer_class: Optional[str] = None  # the transformers class of a sentencepiece tokenizer.model, if any
    zero_biases: bool = False  # HF's class always has biases: a bias-free model is written with zero ones
