"""The parts of a ``transformers`` decoder that pipeline stages place, by the names its family gives them.

Families name them differently (Llama's ``embed_tokens``, ``layers``, ``norm``; GPT-NeoX's ``embed_in``,
``emb_dropout``, ``layers``, ``final_layer_norm``; GPT-J's ``wte``, ``drop``, ``h``, ``ln_f``; Phi's
``embed_dropout`` and ``final_layernorm``), so they are read from the config's ``base_model_pp_plan`` in order: the input embeddings, what
runs on the embeddings before the layers (dropout: the first stage's only), the one ``ModuleList`` of layers, and what
runs after them (the final norm: the last stage's only). A config without a pipeline plan (GraniteMoE) has them read
off the module structure: its input embeddings, its one ``ModuleList`` of ``num_hidden_layers`` layers, its dropouts
before, and its norms after; any other part holding parameters (GPT-2's position embeddings ``wpe``) cannot be placed
without knowing where the forward uses it, and is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn


@dataclass(frozen=True)
class DecoderParts:
    """The decoder's children by their role in the stages (names of ``base``'s children)."""

    embedding: str
    before: tuple[str, ...]  #: applied to the embeddings before the layers: on the first stage only
    layers: str
    after: tuple[str, ...]  #: applied after the layers (final norms): on the last stage only


def layers_name(base: nn.Module, config: Any) -> Optional[str]:
    """The name of the decoder's ``ModuleList`` of layers: the one its pipeline plan names, else its only
    ``ModuleList`` child of ``num_hidden_layers`` entries (None when there is no such one)."""
    plan = getattr(config, "base_model_pp_plan", None) or {}
    named = [name for name in plan if isinstance(getattr(base, name, None), nn.ModuleList)]
    if len(named) == 1:
        return named[0]
    n = getattr(config, "num_hidden_layers", None)
    found = [name for name, child in base.named_children() if isinstance(child, nn.ModuleList) and len(child) == n]
    return found[0] if len(found) == 1 else None


def decoder_parts(base: nn.Module, config: Any, kind: str) -> tuple[Optional[DecoderParts], list[str]]:
    """(the parts, []) of ``base`` (the decoder of a ``kind`` causal LM), or (None, every reason they cannot be
    read)."""
    plan = getattr(config, "base_model_pp_plan", None)
    embedding = next((name for name, child in base.named_children() if child is base.get_input_embeddings()), None)
    layers = layers_name(base, config)
    problems = []
    if embedding is None:
        problems.append(f"{kind}'s decoder holds no input embeddings of its own (get_input_embeddings())")
    if layers is None:
        problems.append(f"{kind}'s decoder holds no single ModuleList of its {config.num_hidden_layers} layers")
    if plan:
        problems += _plan_problems(base, list(plan), embedding, layers, kind)
    else:
        problems += _unplaced(base, embedding, layers, kind)
    if problems:
        return None, problems
    if plan:
        names = list(plan)
        at = names.index(layers)
        return DecoderParts(embedding, tuple(names[1:at]), layers, tuple(names[at + 1:])), []
    children = dict(base.named_children())
    before = tuple(name for name, child in children.items() if isinstance(child, nn.Dropout))
    after = tuple(name for name in children if _is_norm(name, children[name]))
    return DecoderParts(embedding, before, layers, after), []


def _plan_problems(base: nn.Module, names: list[str], embedding: Optional[str], layers: Optional[str],
                   kind: str) -> list[str]:
    """Why a pipeline plan's parts are not, in order, the embeddings, what runs before the layers, the layers and
    what runs after them."""
    missing = [name for name in names if not isinstance(getattr(base, name, None), nn.Module)]
    if missing:
        return [f"{kind}'s base_model_pp_plan names {names}, of which {missing} are not modules of its decoder"]
    if embedding is not None and names[0] != embedding:
        return [f"{kind}'s base_model_pp_plan starts with {names[0]!r}, not its input embeddings {embedding!r}"]
    if layers is not None and layers not in names:
        return [f"{kind}'s base_model_pp_plan names {names}, not its layers {layers!r}"]
    return []


def _unplaced(base: nn.Module, embedding: Optional[str], layers: Optional[str], kind: str) -> list[str]:
    """The parts with parameters of a decoder without a pipeline plan that are neither its embeddings, its layers nor
    a final norm: where its forward applies them is unknown, so no stage can be given them."""
    odd = [name for name, child in base.named_children() if name not in (embedding, layers)
           and any(True for _ in child.parameters()) and not _is_norm(name, child)]
    return [f"{kind}'s config carries no base_model_pp_plan and its decoder holds {odd} beside its embeddings "
            f"({embedding}), layers ({layers}) and final norm, which no stage can be given without knowing where its "
            "forward applies them"] if odd else []


def _is_norm(name: str, child: nn.Module) -> bool:
    """A final norm: a child with parameters whose name or class says norm."""
    return any(True for _ in child.parameters()) and any("norm" in s.lower() for s in (name, type(child).__name__))
