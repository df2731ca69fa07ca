"""The architectures, one row each, keyed by ``model.arch``: a new architecture is its spec's file and a row here.

Every question about an architecture goes through :func:`spec_of` (or ``ModelConfig.spec``); nothing outside
models/ compares ``model.arch`` with a name.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

from megazero.models.gpt2_spec import GPT2
from megazero.models.llama_spec import LLAMA
from megazero.models.spec import ModelSpec

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

SPECS = MappingProxyType({spec.name: spec for spec in (
    GPT2,
    LLAMA,
)})


def spec_of(cfg: "ModelConfig") -> ModelSpec:
    """The spec of ``cfg.arch`` (a checked config names one of :data:`SPECS`)."""
    assert cfg.arch in SPECS, (cfg.arch, tuple(SPECS))
    return SPECS[cfg.arch]


def spec_named(name: object) -> Optional[ModelSpec]:
    """The spec of an architecture's name from an untrusted source (a checkpoint's meta.json), or None."""
    return SPECS.get(name) if isinstance(name, str) else None


def spec_of_hf(model_type: str) -> ModelSpec:
    """The spec whose Hugging Face classes include ``model_type`` (one of :func:`hf_classes`)."""
    found = [spec for spec in SPECS.values() if model_type in spec.hf.classes]
    assert len(found) == 1, (model_type, found)
    return found[0]


def hf_classes() -> dict[str, str]:
    """Every Hugging Face model_type megazero reads or writes -> its class, architecture by architecture."""
    return {kind: cls for spec in SPECS.values() for kind, cls in spec.hf.classes.items()}


def hf_titles() -> dict[str, str]:
    """Every Hugging Face model_type -> how a message names it (GPT-2, Qwen3-MoE)."""
    return {kind: title for spec in SPECS.values() for kind, title in spec.hf.titles.items()}


def names_where(flag: str) -> str:
    """The architectures with the spec flag ``flag`` set, as a message lists them ("llama")."""
    return " | ".join(name for name, spec in SPECS.items() if getattr(spec, flag))
