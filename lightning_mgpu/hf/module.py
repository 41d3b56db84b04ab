"""``HFCausalLM``: a LightningModule around a ``transformers`` causal LM directory, as ``mgpu-train model=hf
model.path=DIR`` trains it (usable from Python too).

It is what a user would write: the model from ``from_pretrained`` (``config.json`` and ``*.safetensors``; no remote
code, no pickled weights), wrapped by PEFT's LoRA when ``adapters`` asks (:mod:`lightning_mgpu.hf.lora`), its own
``labels=`` loss, AdamW over what trains with the package's warm-up and cosine schedule. The parallel
hooks come from the model's config (:mod:`lightning_mgpu.hf.hooks`); the two this module defines itself are the
pipeline batch and loss of the package's data modules, whose batches are ``[batch, seq + 1]`` tokens: the first
``seq`` are the input and the last ``seq`` the targets (``shift_labels``), so every token of a sample has its target,
as in ``LLMModule``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_mgpu.contract import parallel_context
from lightning_mgpu.engine.config import parameter_shape
from lightning_mgpu.hf import lora
from lightning_mgpu.hf.decoder import layers_name
from lightning_mgpu.hf.documents import document_arguments, document_positions, items_per_part
from lightning_mgpu.hf.model import find_hf_model
from lightning_mgpu.hf.router_loss import last_stage_loss
from lightning_mgpu.hf.weights import PretrainedSlices, real_buffers
from lightning_mgpu.lr_schedule import lr_multiplier
from lightning_mgpu.optim.choice import build_optimizer
from lightning_mgpu.parallel.token_batch import token_batch


def load_causal_lm(path: str, on_meta: bool = False) -> torch.nn.Module:
    """The causal LM of a local directory: its weights from ``*.safetensors`` only (``use_safetensors=True``: a
    pickled ``*.bin`` is never read) and no code from the directory (``trust_remote_code=False``). ``on_meta``: the
    structure only, its parameters without storage (buffers computed from the config), for each rank to read its own
    slices into (:class:`~lightning_mgpu.hf.weights.PretrainedSlices`) or for a dry run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    if on_meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
        real_buffers(model)
        return model
    return AutoModelForCausalLM.from_pretrained(path, config=config, use_safetensors=True, trust_remote_code=False,
                                                local_files_only=True, dtype=torch.float32)


class HFCausalLM(L.LightningModule):
    """Train the ``transformers`` causal LM in ``path`` on batches of ``[batch, seq + 1]`` token ids."""

    def __init__(self, path: str, lr: float = 3e-4, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, warmup_steps: int = 10, max_steps: int = 1000, min_lr_ratio: float = 0.1,
                 activation_checkpointing: str = "none", optimizer: str = "adamw", muon_momentum: float = 0.95,
                 muon_ns_dtype: str = "auto", adapters: Optional[dict] = None, seed: int = 0,
                 eod_token_id: Optional[int] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.llm: Optional[torch.nn.Module] = None
        self._slices: Optional[PretrainedSlices] = None
        self._items: Optional[torch.Tensor] = None  # num_items_in_batch of this step's micro-batches (documents)

    def configure_model(self) -> None:
        """Under ``MGPUStrategy`` (which builds on the meta device because :meth:`initial_value` is defined) only the
        structure is built, and each rank reads its own slices; elsewhere ``from_pretrained`` loads it whole."""
        if self.llm is None:
            on_meta = torch.empty(0).is_meta
            self.llm = load_causal_lm(str(Path(self.hparams.path)), on_meta=on_meta)
            if on_meta:
                self._slices = PretrainedSlices(self.hparams.path, self.llm, prefix="llm.")
            adapters = self.hparams.get("adapters")
            if adapters and adapters.get("kind", "none") != "none":  # PEFT wraps it; what the base's files hold freezes
                self.llm = lora.with_lora(self.llm, adapters)
                if not on_meta:
                    lora.initialise_adapters(self.llm, self.hparams.get("seed", 0), prefix="llm.")

    def initial_value(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Part ``index`` of parameter ``name`` (``llm.model.layers.0.mlp.up_proj.weight``), read from the directory's
        safetensors: only that slice is read."""
        if self._slices is None:
            raise RuntimeError("initial_value is asked only after configure_model built the model on the meta device")
        if lora.is_adapter(name):
            return lora.adapter_value(name, shape, self.hparams.get("seed", 0))[index]
        return self._slices(lora.base_name(name), shape, index)

    def on_fit_start(self) -> None:
        if self._slices is not None and self._slices.read:
            rank_zero_info(f"{self.hparams.path}: rank 0 read {self._slices.read:,} of the model's "
                           f"{self._slices.total:,} parameter elements (its own slices)")
            self._slices.close()

    def loss(self, batch: Any) -> torch.Tensor:
        """The model's own ``labels=`` loss. With ``eod_token_id`` (packed documents, e.g. ``data=sft``): attention
        within each document, positions restarting at each, the target after an end-of-document token skipped, and
        ``num_items_in_batch`` the global batch's counted targets (:mod:`lightning_mgpu.hf.documents`)."""
        context = parallel_context(self)
        if context is not None and context.pipeline is not None:  # validation: the stages' forward, every rank
            return context.pipeline.evaluate(*self.pipeline_batch(batch))
        inputs, targets = self._inputs_targets(batch)
        eod, extra = self.hparams.get("eod_token_id"), {}
        if eod is not None:  # under context parallelism the positions alone: the documents follow the split there
            split = context is not None and context.layout is not None and context.layout.size("cp") > 1
            extra = {"position_ids": document_positions(inputs, eod)} if split else \
                document_arguments(inputs, eod, next(self.llm.parameters()).dtype)
            extra["num_items_in_batch"] = self._items if self._items is not None else \
                (targets != -100).sum().clamp(min=1)
        return self.llm(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False, **extra).loss

    def _inputs_targets(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = token_batch(batch)
        inputs = ids[:, :-1]
        targets = (ids if labels is None else labels)[:, 1:].contiguous()  # transformers' loss views the labels flat
        eod = self.hparams.get("eod_token_id")
        return inputs, targets if eod is None else targets.masked_fill(inputs == eod, -100)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.hparams.get("eod_token_id") is not None:
            self._items = items_per_part(self, self._inputs_targets(batch)[1], training=True)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.hparams.get("eod_token_id") is not None:
            self._items = items_per_part(self, self._inputs_targets(batch)[1], training=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        return self.loss(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        self._items = None
        loss = (outputs["loss"] if isinstance(outputs, dict) else outputs).detach().float()
        self.log("train/loss", loss * self.trainer.accumulate_grad_batches, prog_bar=True, on_step=True)
        context = parallel_context(self)
        if context is not None and context.last_grad_norm is not None:
            self.log("train/grad_norm", float(context.last_grad_norm), on_step=True)

    def checkpointed_blocks(self) -> tuple[str, list[torch.nn.Module]]:
        """(``activation_checkpointing``: none | selective | full, the decoder layers this rank holds): ``parallelize``
        makes each recompute in backward (``lightning_mgpu.parallel.checkpointing``), as for ``LLMModule``'s blocks."""
        found = find_hf_model(self)  # the causal LM, also inside PEFT's wrappers
        layers = getattr(found.base, layers_name(found.base, found.config) or "layers")
        return self.hparams.activation_checkpointing, list(layers)

    # ---------------------------------------------- the package's batches through pipeline stages
    def pipeline_batch(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """(the first stage's input, the targets); with ``eod_token_id`` the input is ``(ids, positions)``: the
        positions restart at each document and travel with the hidden states, every stage masks attention by them."""
        inputs, targets = self._inputs_targets(batch)
        eod = self.hparams.get("eod_token_id")
        return (inputs if eod is None else (inputs, document_positions(inputs, eod))), targets

    def pipeline_loss(self, logits: Any, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss of the last stage's logits (and its load-balancing loss where the stage formed one)."""
        extra = {} if self._items is None else {"num_items_in_batch": self._items}  # documents: the global count
        return last_stage_loss(self.llm, logits, lambda out: self.llm.loss_function(
            logits=out, labels=targets, shift_labels=targets, vocab_size=self.llm.config.vocab_size, **extra))

    def configure_optimizers(self) -> dict:
        hp = self.hparams
        # what trains, not a frozen base; from the module, which also holds a frozen pipeline stage's placeholder
        trained = [(name.removeprefix("llm."), p) for name, p in self.named_parameters() if p.requires_grad]
        optimizer = build_optimizer(trained, parameter_shape, hp.get("optimizer", "adamw"), hp.lr,
                                    hp.weight_decay, tuple(hp.betas), hp.eps, hp.get("muon_momentum", 0.95),
                                    hp.get("muon_ns_dtype", "auto"))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, hp.warmup_steps, hp.max_steps, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sampled continuation of ``prompt`` (every rank the same, with the same generator); the logits gathered over
        a vocabulary split by tensor parallelism. Not with sequence, context or pipeline parallelism."""
        from lightning_mgpu.parallel.cross_entropy import gather_logits

        tokens, head = prompt, self.llm.get_output_embeddings()
        for _ in range(max_new_tokens):
            logits = gather_logits(self.llm(input_ids=tokens).logits[:, -1], head).float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens
