"""A user's LightningModule holding a ``transformers`` model wrapped by PEFT (LoRA), or a partly frozen one, and its
single-process reference: a plain PEFT loop over the same global batches.

What a user writes: ``get_peft_model(model, LoraConfig(...))`` in ``__init__``, ``training_step`` returning
``self.llm(input_ids=x, labels=x).loss``, SGD over the parameters that train. SGD (not AdamW) so that the adapter
weights after the last step can be compared to 1e-5: AdamW turns rounding noise in a near-zero gradient into a
full-size update."""

from __future__ import annotations

import re
from typing import Any, Optional

import lightning as L
import torch
from hf_helpers import CLIP, MICRO, Seen, tiny_model, token_ids
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUStrategy, parameter_shape

LORA_LR = 0.5
#: Parts frozen by a partial fine-tune without adapters: the embeddings, the first decoder layer's every weight.
PARTLY_FROZEN = ("model.embed_tokens.", "model.layers.0.")


def lora_model(family: str, n_layers: int = 2, targets: Any = "all-linear", base: Optional[str] = None,
               base_dtype: Optional[str] = None, **lora: Any) -> torch.nn.Module:
    """The tiny model of ``family`` (or the one saved in ``base``, loaded as a user loads a pretrained model; stored in
    ``base_dtype`` if given, while PEFT keeps the adapters in fp32) with LoRA adapters (rank 4, alpha 8, no dropout
    unless asked), as PEFT makes them."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = tiny_model(family, n_layers) if base is None else \
        transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    if base_dtype is not None:
        model = model.to(getattr(torch, base_dtype))
    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": targets, **lora}))


def partly_frozen_model(family: str, n_layers: int = 2) -> torch.nn.Module:
    """The tiny model with its embeddings and first decoder layer frozen (``requires_grad_(False)``)."""
    model = tiny_model(family, n_layers)
    for name, param in model.named_parameters():
        if name.startswith(PARTLY_FROZEN):
            param.requires_grad_(False)
    return model


def build(kind: str, family: str, n_layers: int, **lora: Any) -> torch.nn.Module:
    """``lora``: PEFT's LoRA; ``frozen``: :func:`partly_frozen_model`; ``full``: every weight trains."""
    if kind == "lora":
        return lora_model(family, n_layers, **lora)
    return partly_frozen_model(family, n_layers) if kind == "frozen" else tiny_model(family, n_layers)


def make_optimizer(params: list[torch.nn.Parameter], name: str) -> torch.optim.Optimizer:
    """SGD (the default: weights comparable after the last step), or AdamW (its moments in the checkpoints)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    return torch.optim.SGD(params, lr=LORA_LR)


class AdaptedLM(L.LightningModule):
    """PEFT as the user writes it: nothing about parallelism."""

    def __init__(self, kind: str, family: str, n_layers: int = 2, optimizer: str = "sgd", **lora: Any) -> None:
        super().__init__()
        self.llm = build(kind, family, n_layers, **lora)
        self.optimizer_name = optimizer

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.llm(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Over the parameters that train; with a name ending in ``:every``, over every parameter, the frozen ones
        included, as many users write it (the optimizer skips those without a gradient)."""
        name, _, every = self.optimizer_name.partition(":")
        params = list(self.parameters()) if every else [p for p in self.parameters() if p.requires_grad]
        return make_optimizer(params, name)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_ids(), batch_size=MICRO)


def canonical(name: str) -> str:
    """A parameter's name without the module, PEFT and stage prefixes: ``layers.0.self_attn.q_proj.lora_A...``."""
    match = re.search(r"(?:^|\.)((?:layers|embed_tokens|norm|lm_head)\b.*)$", name)
    return match.group(1) if match else name


def fit_adapted(rank: int, kind: str, family: str, devices: int, steps: int = 3, n_layers: int = 2,
                lora: Optional[dict] = None, save_to: Optional[str] = None, ckpt_path: Optional[str] = None,
                optimizer: str = "sgd", **strategy_kwargs: Any) -> dict:
    """One ``Trainer.fit`` of :class:`AdaptedLM`; what it saw, the local shapes, which parameters train, and the whole
    trained weights (rank 0) gathered from every shard and stage."""
    from lightning_mgpu.checkpoint.consolidate import consolidated_state_dict

    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**strategy_kwargs), max_steps=steps,
                        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[seen], limit_val_batches=0)
    module = AdaptedLM(kind, family, n_layers, optimizer, **(lora or {}))
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    strategy = trainer.strategy
    whole = consolidated_state_dict(strategy.model, strategy.layout, prefix="")
    params = dict(module.named_parameters())
    numel = {n: getattr(p, "ds_numel", p.numel()) for n, p in params.items()}
    return {"rank": rank, "batches": seen.batches, "losses": seen.losses, "grad_norms": seen.grad_norms,
            "shapes": {canonical(n): tuple(parameter_shape(p)) for n, p in module.named_parameters()},
            "trainable": sorted(canonical(n) for n, p in module.named_parameters() if p.requires_grad),
            "coords": {axis: strategy.layout.rank(axis) for axis in ("tp", "pp", "dp")},
            "trainable_elements": sum(numel[n] for n, p in params.items() if p.requires_grad),
            "frozen_elements": sum(numel[n] for n, p in params.items() if not p.requires_grad),
            "frozen_with_grads": [n for n, p in params.items() if not p.requires_grad and p.grad is not None],
            "master_elements": master_elements(strategy.model.optimizer),
            "zero_ranks": strategy.layout.size("dp_cp"),
            "dtypes": sorted({f"{p.dtype} {'trains' if p.requires_grad else 'frozen'}" for p in params.values()}),
            "weights": None if whole is None else {canonical(k): v for k, v in whole.items()}}


def master_elements(optimizer: Any) -> int:
    """The fp32 master elements a ZeRO 1-3 optimizer keeps on this rank (0 for ZeRO-0, which keeps none in fp32)."""
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(optimizer, "fp32_partitioned_groups_flat", None) or []
    return sum(flat.numel() for flat in flats)


def single_process_adapted(kind: str, family: str, batches: list[torch.Tensor], n_layers: int = 2,
                           lora: Optional[dict] = None, optimizer: str = "sgd") -> dict:
    """The same training as a plain loop: the model's own loss, the trainable parameters' norm before clipping at
    ``CLIP``, SGD; the weights after the last step."""
    model = build(kind, family, n_layers, **(lora or {}))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, optimizer)
    losses, norms = [], []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {canonical(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights, "model": model,
            "trainable": sorted(canonical(n) for n, p in model.named_parameters() if p.requires_grad)}
