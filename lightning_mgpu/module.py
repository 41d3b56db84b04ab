"""LLMModule: causal-LM pre-training as a LightningModule (AdamW, warm-up + cosine, loss and perplexity)."""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import lightning as L
import torch
from torchmetrics import MeanMetric

from lightning_mgpu.engine.config import parameter_shape
from lightning_mgpu.hf.adapters import adapter_plan, unwrapped
from lightning_mgpu.hf.lora import ModelAdapters, initialise_adapters
from lightning_mgpu.hf.names import hf_path
from lightning_mgpu.hf.weights import HFWeights, load_hf, load_into
from lightning_mgpu.contract import parallel_context
from lightning_mgpu.problems import raise_problems
from lightning_mgpu.layout import ModelShape
from lightning_mgpu.lr_schedule import lr_multiplier
from lightning_mgpu.models.llama import Block, Llama, LlamaConfig, document_positions
from lightning_mgpu.models.llama import initial_value as llama_initial_value
from lightning_mgpu.models.llama_plan import llama_stages, llama_tp_plan
from lightning_mgpu.models.moe import set_loss_scale
from lightning_mgpu.optim.choice import build_optimizer
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.parallel.compile import compile_blocks
from lightning_mgpu.parallel.context import shard_sequence
from lightning_mgpu.parallel.cross_entropy import cross_entropy, gather_logits
from lightning_mgpu.parallel.pipeline import stage_container
from lightning_mgpu.parallel.tensor import ParallelNorm
from lightning_mgpu.parallel.token_batch import token_batch
from lightning_mgpu.planner.model_stats import model_flops_per_token


#: How the peak LR follows a changed global batch (``optim.lr_scaling``; None: it does not).
LR_SCALING = ("linear", "sqrt")


def lr_scaling_problems(rule: Optional[str], reference_batch_size: Optional[int],
                        global_batch_size: Optional[int] = 1) -> list[str]:
    """The rule of ``lr_scaling``: one of :data:`LR_SCALING` (or None), with the batch the LR was tuned for (asked by
    the module and by ``mgpu-train``'s validation)."""
    if rule is None:
        return []
    if rule not in LR_SCALING:
        return [f"optim.lr_scaling={rule!r} is unknown; choose null, {' or '.join(LR_SCALING)}"]
    if not global_batch_size or not reference_batch_size:
        return [f"optim.lr_scaling={rule!r} needs global_batch_size and optim.reference_batch_size (the batch the LR "
                f"was tuned for; got {global_batch_size} and {reference_batch_size})"]
    return []


def scaled_lr(lr: float, rule: Optional[str], global_batch_size: Optional[int], reference_batch_size: Optional[int]) -> float:
    """The peak LR after adapting it to a changed global batch (``linear``: x ratio; ``sqrt``: x sqrt(ratio))."""
    raise_problems("Invalid learning-rate scaling", lr_scaling_problems(rule, reference_batch_size, global_batch_size))
    if rule is None:
        return lr
    ratio = global_batch_size / reference_batch_size
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


#: The target id that the loss skips (PyTorch's default ``ignore_index``).
IGNORE_INDEX = -100


class LLMModule(L.LightningModule):
    """Next-token prediction on batches of token windows ``[batch, seq_len + 1]``.

    ``training_step`` returns the mean loss of one (micro-)batch. With :class:`MGPUStrategy` the
    strategy runs the micro-batches of a global batch and hands ``on_train_batch_end`` the loss averaged
    over the whole global batch, which is what ``train/loss`` logs.

    Packed documents: a model config with ``eod_token_id`` (``LlamaConfig(..., eod_token_id=ID)``) keeps attention
    within documents and restarts positions (see :class:`LlamaConfig`), and the loss skips the target that follows
    an end-of-document token (the first token of the next document cannot be predicted from the previous one:
    Megatron's ``eod_mask_loss``). The loss is then the mean over the counted targets of the whole global batch, as
    if one process computed it at once; :meth:`_tokens_per_microbatch` says how micro-batches and replicas get there.

    Adapters: ``adapters=dict(kind="lora", rank=16, alpha=32, dropout=0.0, targets="all-linear")`` (the CLI's
    ``adapters`` group; ``modules_to_save`` and ``seed`` optional) puts PEFT's LoRA layers into the model and freezes
    its base (:class:`~lightning_mgpu.hf.lora.ModelAdapters`); start it from a pretrained directory with ``init_from``.
    """

    def __init__(self, model: LlamaConfig | dict | str = "tiny", lr: float = 3e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, warmup_steps: int = 10,
                 max_steps: int = 1000, min_lr_ratio: float = 0.1,
                 lr_scaling: Optional[Literal["linear", "sqrt"]] = None, reference_batch_size: Optional[int] = None,
                 global_batch_size: Optional[int] = None, init_seed: int = 0,
                 init_from: Optional[str] = None, optimizer: Literal["adamw", "muon"] = "adamw",
                 muon_momentum: float = 0.95, muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto",
                 adapters: Optional[dict] = None) -> None:
        super().__init__()
        if isinstance(model, str):
            model = LlamaConfig.from_name(model)
        elif isinstance(model, dict):
            model = LlamaConfig(**model)
        self.config = model
        self.save_hyperparameters({"model": model.to_dict(), "lr": lr, "weight_decay": weight_decay,
                                   "betas": tuple(betas), "eps": eps, "warmup_steps": warmup_steps,
                                   "max_steps": max_steps, "min_lr_ratio": min_lr_ratio, "lr_scaling": lr_scaling,
                                   "reference_batch_size": reference_batch_size,
                                   "global_batch_size": global_batch_size, "init_seed": init_seed,
                                   "init_from": init_from, "optimizer": optimizer, "muon_momentum": muon_momentum,
                                   "muon_ns_dtype": muon_ns_dtype, "adapters": adapters})
        self.peak_lr = scaled_lr(lr, lr_scaling, global_batch_size, reference_batch_size)
        self.model: Optional[Llama] = None
        #: LoRA over the model (``adapters={"kind": "lora", ...}``, the CLI's ``adapters`` group): base frozen
        self._adapters = (ModelAdapters(adapters, int(adapters.get("seed", 0)),
                                        base=str(hf_path(init_from).resolve()) if init_from else "")
                          if adapters and adapters.get("kind", "none") != "none" else None)
        self._hf_weights: Optional[HFWeights] = None
        self.val_nll = MeanMetric()  # token-weighted mean loss; val/ppl = exp of it
        self.tokens_seen = 0
        self._loss_tokens: Optional[torch.Tensor] = None  # counted targets per micro-batch of the current batch

    def configure_model(self) -> None:
        """Build the model. Initial weights depend only on ``init_seed`` and each parameter's name. Under MGPUStrategy
        this runs on the meta device and the strategy asks :meth:`initial_value` for each rank's share only."""
        if self.model is not None:
            return
        self.model = Llama(self.config, init_seed=self.hparams.init_seed)
        real = not self.model.output.weight.is_meta  # a real build, not MGPUStrategy's (which parallelize finishes)
        if real and self.hparams.init_from:  # whole weights (one process)
            _, state = load_hf(hf_path(self.hparams.init_from))
            load_into(self.model, state)
        if self._adapters is not None:
            self.model = self._adapters.inject(self.model)
            if real:
                initialise_adapters(self.model, self._adapters.seed, prefix="model.")
        if real:
            mode, blocks = self.checkpointed_blocks()
            checkpoint_blocks(blocks, mode)
            backend, blocks = self.compiled_blocks()
            if backend is not None:
                compile_blocks(blocks, backend)

    def checkpointed_blocks(self) -> tuple[str, list[torch.nn.Module]]:
        """(``config.activation_checkpointing``, this rank's transformer blocks): applied by ``parallelize`` under
        MGPUStrategy, by :meth:`configure_model` otherwise."""
        return self.config.activation_checkpointing, [m for m in self.model.modules() if isinstance(m, Block)]

    def compiled_blocks(self) -> tuple[Optional[str], list[torch.nn.Module]]:
        """(the ``torch.compile`` backend of ``config.compile``, or None; this rank's transformer blocks): applied after
        activation checkpointing, by ``parallelize`` under MGPUStrategy and by :meth:`configure_model` otherwise."""
        backend = self.config.compile_backend if self.config.compile else None
        return backend, [m for m in self.model.modules() if isinstance(m, Block)]

    def checkpoint_record(self) -> dict:
        """Nothing beside Lightning's state (the model config is in the hyper-parameters), but with adapters their
        record, which keeps the frozen base out of the checkpoint."""
        return {} if self._adapters is None else self._adapters.record(prefix="model.")

    def initial_value(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        """Part ``index`` of parameter ``name``'s initial value (``model.layers.0.attention.wq.weight``, whole shape
        ``shape``): the slice of a Hugging Face checkpoint's tensor (``init_from``; only that slice is read), or of the
        seeded initialisation."""
        if self._adapters is not None:
            return self._adapters.initial_value(name, shape, index, self._base_initial_value)
        return self._base_initial_value(name, shape, index)

    def _base_initial_value(self, name: str, shape: torch.Size, index: tuple[slice, ...]) -> torch.Tensor:
        own = name.removeprefix("model.")
        if self.hparams.init_from:
            if self._hf_weights is None:
                self._hf_weights = HFWeights(hf_path(self.hparams.init_from))
            return self._hf_weights.read(own, shape, index)
        if len(shape) == 3:  # stacked experts: draw only the experts of ``index[0]``
            return llama_initial_value(self.config, own, shape, self.hparams.init_seed, index[0])[:, index[1], index[2]]
        return llama_initial_value(self.config, own, shape, self.hparams.init_seed)[index]

    def on_fit_start(self) -> None:
        self._hf_weights = None  # the shards are materialised: close the checkpoint's memory-mapped files

    @property
    def model_shape(self) -> ModelShape:
        """The numbers that constrain how the model may be split (checked by MGPUStrategy)."""
        return ModelShape.of(self.config)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """How MGPUStrategy splits the model when ``tensor_parallel_size > 1``."""
        plan = llama_tp_plan(prefix="model.", config=self.config)
        if self._adapters is None:
            return plan
        plan, problems = adapter_plan(self, plan)
        raise_problems("LoRA under tensor parallelism", problems)
        return plan

    # -------------------------------------------------------------- pipeline parallelism (MGPUStrategy)
    def pipeline_stages(self, stage_ids: list[int], num_stages: int,
                        boundaries: Optional[list[int]] = None) -> torch.nn.ModuleDict:
        """Keep only the given stages of the model: ``self.model`` becomes their container (returned)."""
        self.model = stage_container(llama_stages(self.model, stage_ids, num_stages, boundaries))
        return self.model

    def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(first stage's input, last stage's target) of a batch as the loader yields it (token windows, bare or in a
        list or tuple with labels, :func:`token_batch`): with context parallelism, this rank's chunks of them. With
        documents, the target after each end-of-document input is :data:`IGNORE_INDEX`: marking it in the target is
        what lets the last pipeline stage, which never sees the input tokens, skip it. With documents and context
        parallelism the first stage's input is (this rank's tokens, their positions in their documents): a chunk cannot
        tell where its documents start, so the positions are taken from the whole sequence before it is split."""
        inputs, targets = self._next_tokens(batch)
        eod = self.config.eod_token_id
        if eod is not None and self._context_coordinates()[1] > 1:
            inputs, targets, positions = self.context_parallel_batch(inputs, targets, document_positions(inputs, eod))
            return (inputs, positions), targets
        return self.context_parallel_batch(inputs, targets)

    def _next_tokens(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the whole sequences: each next token the target, none after an end of document."""
        tokens, labels = token_batch(batch)
        inputs, targets = tokens[:, :-1], (tokens if labels is None else labels)[:, 1:]
        eod = self.config.eod_token_id
        return inputs, targets if eod is None else targets.masked_fill(inputs == eod, IGNORE_INDEX)

    def context_parallel_batch(self, *sequences: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This context rank's chunks of each ``[batch, seq]`` tensor (all of them without context parallelism).

        Every context rank gets the same samples (they are one replica) and each takes its two chunks; the loss is
        then each rank's mean over its tokens, and the strategy's mean over the context ranks (equal token counts) is
        the mean over the sequence."""
        rank, size = self._context_coordinates()
        return tuple(shard_sequence(x, rank, size) for x in sequences)

    def _context_coordinates(self) -> tuple[int, int]:
        context = parallel_context(self)
        layout = context.layout if context is not None else None
        if layout is None or layout.size("cp") == 1:
            return 0, 1
        return layout.rank("cp"), layout.size("cp")

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch on the last stage (with documents: its part of the global batch's mean)."""
        head = unwrapped(next(stage.output for stage in self.model.values() if stage.output is not None))
        return self._loss(logits, targets, head)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        if self.config.eod_token_id is None:
            return cross_entropy(logits, targets, head=head)
        total = cross_entropy(logits, targets, head=head, ignore_index=IGNORE_INDEX, reduction="sum")
        counted = self._loss_tokens if self._loss_tokens is not None else _counted(targets).clamp(min=1)
        return total / counted

    def _pipeline(self):
        context = parallel_context(self)
        return context.pipeline if context is not None else None

    # ------------------------------------------------------------------------------------------- steps
    def forward(self, tokens: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Logits of token ids, or of (token ids, their positions in their documents): :meth:`pipeline_batch`."""
        return self.model(*tokens) if isinstance(tokens, tuple) else self.model(tokens)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss; the logits may be sharded over the vocabulary (tensor parallelism). With pipeline
        parallelism it runs the pipeline forward-only and every rank gets the loss."""
        pipeline = self._pipeline()
        if pipeline is not None:
            return pipeline.evaluate(*self.pipeline_batch(batch))
        inputs, targets = self.pipeline_batch(batch)
        return self._loss(self(inputs), targets, unwrapped(self.model.output))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        """``Llama.generate`` that also works tensor-parallel: every rank of a group must call it with the same
        prompt and generator; the vocabulary shards are gathered and, under sequence parallelism, the
        context is right-padded to a multiple of the group size."""
        if self._pipeline() is not None:
            raise NotImplementedError("generate() needs the whole model on each rank; it is not available with "
                                      "pipeline parallelism (pipeline_parallel_size > 1)")
        if self._context_coordinates()[1] > 1:
            raise NotImplementedError("generate() runs whole sequences on each rank; it is not available with "
                                      "context parallelism (context_parallel_size > 1)")
        head = unwrapped(self.model.output)
        sequence_parallel = any(isinstance(m, ParallelNorm) and m.sequence_parallel for m in self.model.modules())
        multiple = getattr(head, "tp_size", 1) if sequence_parallel else 1
        return self.model.generate(prompt, max_new_tokens, logits_hook=lambda logits: gather_logits(logits, head),
                                   seq_multiple=multiple, **kwargs)

    def training_step(self, batch: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        return self.loss(batch)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        # Counted as the step starts, not in on_train_batch_end: Lightning runs the callbacks' on_train_batch_end
        # (a periodic checkpoint among them) before the module's, so a count made there would be saved one step short.
        context = parallel_context(self)  # tensor/pipeline ranks share their replica's batch
        data_ranks = context.data_ranks if context is not None else self.trainer.world_size
        tokens = token_batch(batch)[0]
        global_batch = self.hparams.global_batch_size or tokens.shape[0] * data_ranks
        self.tokens_seen += global_batch * (tokens.shape[-1] - 1)
        if context is None and self.config.num_experts:  # as Lightning divides (and fp16 scales) each loss
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
            set_loss_scale(self.model, scale / self.trainer.accumulate_grad_batches)
        if self.config.eod_token_id is not None:
            self._loss_tokens = self._tokens_per_microbatch(batch, training=True)

    def _tokens_per_microbatch(self, batch: torch.Tensor, training: bool) -> torch.Tensor:
        """What each micro-batch divides its summed loss by: the counted targets of the whole global batch (this
        rank's batch summed over the data-parallel replicas) over the number of parts the strategy averages with equal
        weights, ``micro-batches x replicas``.

        MGPUStrategy weighs every micro-batch's loss and every replica's mean equally (the engine scales each backward
        by 1 / micro-batches and averages gradients over replicas; the logged loss is the same mean), so each part
        contributing ``its sum / this`` makes the loss and the gradients those of one process computing
        ``sum / counted`` over the global batch, whatever the layout and however the counted targets fall into
        micro-batches. Evaluation does the same over the pipeline's micro-batches (one part without a pipeline);
        ``val/loss``, averaged over replicas, is then each global batch's mean over its counted targets."""
        counted = _counted(self._next_tokens(batch)[1])  # whole sequences: every context rank's chunks
        context, pipeline = parallel_context(self), self._pipeline()
        replicas = context.replicas if context is not None else self.trainer.world_size
        if replicas > 1:  # tensor and pipeline ranks of a replica share its batch: sum over replicas only
            counted = self.trainer.strategy.reduce(counted, group=context.layout.group("dp") if context else None,
                                                   reduce_op="sum")
        if training:
            micro = context.num_microbatches if context is not None and self.automatic_optimization else 1
        else:
            micro = pipeline.n_microbatches if pipeline is not None else 1
        chunks = self._context_coordinates()[1]  # the strategy averages the context ranks' losses too
        return counted.clamp(min=1) / (micro * replicas * chunks)  # a batch of only skipped targets: 0 / 1

    def on_train_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int) -> None:
        self._loss_tokens = None  # a later direct call of loss() averages over its own batch
        loss = (outputs["loss"] if isinstance(outputs, dict) else outputs).detach().float()
        loss = loss * self.trainer.accumulate_grad_batches  # Lightning divides it by accumulate_grad_batches
        self.log("train/loss", loss, prog_bar=True, on_step=True)
        context = parallel_context(self)
        grad_norm = context.last_grad_norm if context is not None else None
        if grad_norm is not None:  # the global norm before clipping: a gradient-scale bug shows here, not in the loss
            self.log("train/grad_norm", float(grad_norm), on_step=True)
        # Each self.log costs Lightning ~5 ms of bookkeeping on a CPU (measured, benchmarks/overhead.py): log the
        # progress-bar value every step and the rest only on the steps the logger writes.
        if self.trainer.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            self.log_dict({"train/ppl": torch.exp(loss), "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                           "train/tokens_seen": float(self.tokens_seen)}, on_step=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Model training FLOPs per token at ``seq_len`` (for MFU; see ``lightning_mgpu.callbacks``)."""
        return model_flops_per_token(self.config, seq_len)

    def on_validation_batch_start(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.config.eod_token_id is not None:
            self._loss_tokens = self._tokens_per_microbatch(batch, training=False)

    def on_validation_batch_end(self, outputs: Any, batch: torch.Tensor, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._loss_tokens = None

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self.loss(batch)
        # With documents each rank's loss is its share of the global batch's mean (see _tokens_per_microbatch):
        # equal weights give that mean, as the default's equal token counts do.
        weight = token_batch(batch)[0][:, 1:].numel() if self.config.eod_token_id is None else 1.0
        self.val_nll.update(loss.detach().float(), weight=weight)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        # the metric syncs itself, so every rank holds the global value; averaging equal values over the ranks
        # (sync_dist) changes nothing, and Lightning warns about an epoch-level value logged without it
        self.log("val/ppl", torch.exp(self.val_nll.compute()), sync_dist=True)
        self.val_nll.reset()

    def configure_optimizers(self):
        hp = self.hparams
        trained = ((name, p) for name, p in self.model.named_parameters() if p.requires_grad)  # frozen: no state
        optimizer = build_optimizer(trained, parameter_shape, hp.get("optimizer", "adamw"),
                                    self.peak_lr, hp.weight_decay, tuple(hp.betas), hp.eps, hp.get("muon_momentum", 0.95),
                                    hp.get("muon_ns_dtype", "auto"), fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, hp.warmup_steps, hp.max_steps, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_callbacks(self) -> list:
        """A model with experts logs their load (``lightning_mgpu.callbacks.experts``) in whatever Trainer runs it."""
        if not self.config.num_experts:
            return []
        from lightning_mgpu.callbacks.experts import ExpertLoad

        return [ExpertLoad()]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))


def _counted(targets: torch.Tensor) -> torch.Tensor:
    """How many targets the loss counts, as a float tensor."""
    return (targets != IGNORE_INDEX).sum().float()
