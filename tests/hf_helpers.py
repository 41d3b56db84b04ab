"""A user's LightningModule holding a ``transformers`` causal LM as it is, with its own DataLoader, and its
single-process reference: what the tests of ``lightning_mgpu.hf`` share.

The module is what a Lightning user writes: ``training_step`` returns ``self.llm(input_ids=x, labels=x).loss``; no plan,
no pipeline hooks. Its tiny models are built here with random weights (nothing is downloaded)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUStrategy, parameter_shape

SEQ, SAMPLES, MICRO, VOCAB = 16, 64, 4, 64
LR, CLIP = 1e-2, 0.3

FAMILIES = {
    "llama": lambda **kw: transformers.LlamaConfig(**kw),
    "qwen2": lambda **kw: transformers.Qwen2Config(**kw),  # q/k/v biases
    "qwen3": lambda **kw: transformers.Qwen3Config(**kw),  # per-head q/k norms
    "mistral": lambda **kw: transformers.MistralConfig(sliding_window=6, **kw),  # a window shorter than the sequence
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                          **kw),  # every layer routes over 4 experts
    # Embeddings scaled by sqrt(hidden) in their own forward, a padding row (held by tensor rank 1 of 2), logits
    # soft-capped by the causal LM's forward after the head (at 2.0, so that losing it moves the loss; at 1.0 one
    # element of a gate_proj has a gradient near AdamW's eps, whose update then follows the rounding of a split sum),
    # sliding and full attention in turn (a window of 4 < 16 tokens), eager attention (transformers refuses sdpa with
    # Gemma 2's attention soft-capping)
    "gemma2": lambda **kw: transformers.Gemma2Config(**{**kw, "attn_implementation": "eager"}, pad_token_id=40,
                                                     final_logit_softcapping=2.0, sliding_window=4),
    # transformers' colwise_gather_output and rowwise_split_input styles: q/k/v and gate/up each one fused matmul
    "phi3": lambda **kw: transformers.Phi3Config(pad_token_id=None, **kw),
    # the same styles on separate q/k/v, whose norms span every head
    "olmo2": lambda **kw: transformers.Olmo2Config(pad_token_id=None, **kw),
    # a hybrid: each layer's `mixer` is Mamba, attention or an MLP, as the pattern says (plans only, not trained here)
    "nemotron_h": lambda **kw: transformers.NemotronHConfig(hybrid_override_pattern="M*-M", mamba_num_heads=4,
                                                            mamba_head_dim=8, n_groups=1, ssm_state_size=8, **kw),
    # a dense first layer, then routed and shared experts; its attention (latent, MLA) left whole by its plan
    "deepseek_v3": lambda **kw: transformers.DeepseekV3Config(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        **{**kw, "num_key_value_heads": kw["num_attention_heads"]}),
    # decoders whose parts have other names: GPT-NeoX's embed_in, emb_dropout, final_layer_norm and fused
    # query_key_value; Phi's embed_dropout and final_layernorm; GPT-J's wte, drop, h, ln_f (its special tokens outside
    # the tiny vocabulary dropped)
    "gpt_neox": lambda **kw: transformers.GPTNeoXConfig(**kw),
    "phi": lambda **kw: transformers.PhiConfig(**kw),
    "gptj": lambda **kw: transformers.GPTJConfig(rotary_dim=4, bos_token_id=None, eos_token_id=None, **kw),
    # no base_model_pp_plan: stages from its one ModuleList of layers; embeddings scaled in the decoder's forward and
    # logits scaled after the head (at 2.0, so that a later stage scaling its input again, or losing the last
    # scaling, moves the loss)
    "granitemoe": lambda **kw: transformers.GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2,
                                                             embedding_multiplier=2.0, logits_scaling=2.0, **kw),
}


def tiny_config(family: str, n_layers: int = 2, tied: bool = False) -> Any:
    return FAMILIES[family](vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            tie_word_embeddings=tied, attn_implementation="sdpa")


def tiny_model(family: str, n_layers: int = 2, tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(11)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, n_layers, tied))


def token_ids(samples: int = SAMPLES, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (samples, seq), generator=torch.Generator().manual_seed(3))


def masked_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels that differ from the ids: the first quarter of each row counts for nothing (-100), the same count in
    every row, so that micro-batch and replica means equal the global one."""
    labels = ids.clone()
    labels[:, :SEQ // 4] = -100
    return labels


#: How the user's training loader yields a batch: the bare tensor, a TensorDataset's ``[ids]``, or ``[ids, labels]``.
BATCHES = ("tensor", "list", "labelled")


def loader_batches(batches: str) -> Any:
    """The training set as a loader of ``batches`` (:data:`BATCHES`) reads it."""
    ids = token_ids()
    return {"tensor": ids, "list": TensorDataset(ids), "labelled": TensorDataset(ids, masked_labels(ids))}[batches]


def ids_and_labels(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What a user's training_step reads from each kind of batch."""
    if isinstance(batch, torch.Tensor):
        return batch, batch
    return batch[0], batch[-1]


def make_optimizer(model: torch.nn.Module, name: str = "adamw") -> torch.optim.Optimizer:
    """torch's AdamW, or Muon for the blocks' matrices with AdamW for the rest (the package's rule, fp32
    Newton-Schulz so that layouts compare tightly)."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    from lightning_mgpu.optim.choice import build_optimizer

    return build_optimizer(model.named_parameters(), parameter_shape, name, LR, 0.0, (0.9, 0.999), 1e-8,
                           muon_ns_dtype="float32")


class CausalLM(L.LightningModule):
    """What a user writes around a ``transformers`` model: nothing about parallelism."""

    def __init__(self, family: str, n_layers: int = 2, tied: bool = False, optimizer: str = "adamw",
                 batches: str = "tensor") -> None:
        super().__init__()
        self.llm = tiny_model(family, n_layers, tied)
        self.optimizer_name, self.batch_kind = optimizer, batches

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = ids_and_labels(batch)
        return self.llm(input_ids=ids, labels=labels).loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.llm(input_ids=batch, labels=batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.optimizer_name)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(loader_batches(self.batch_kind), batch_size=MICRO)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_ids(8)[:, :], batch_size=MICRO)


class Seen(L.Callback):
    """Per step: the batch this rank was given, the global loss the strategy returned and the global grad norm."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.grad_norms: list[Optional[float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append(ids_and_labels(batch)[0].clone())
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        self.grad_norms.append(trainer.strategy.last_grad_norm)


def fit_hf(rank: int, family: str, devices: int, steps: int = 3, n_layers: int = 2, validate: bool = False,
           ckpt_path: Optional[str] = None, save_to: Optional[str] = None, optimizer: str = "adamw",
           batches: str = "tensor", **strategy_kwargs: Any) -> dict:
    """One ``Trainer.fit`` of :class:`CausalLM` on this rank (from ``ckpt_path``; saved to ``save_to`` at the end),
    its loader yielding ``batches`` (:data:`BATCHES`); what it saw, the local shard sizes and the layout."""
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**strategy_kwargs), max_steps=steps,
                        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[seen],
                        limit_val_batches=1 if validate else 0, val_check_interval=steps if validate else None,
                        check_val_every_n_epoch=None if validate else 1)
    module = CausalLM(family, n_layers, optimizer=optimizer, batches=batches)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    layout = trainer.strategy.layout
    shapes = {name: tuple(parameter_shape(p)) for name, p in module.named_parameters()}
    out = {"rank": rank, "batches": seen.batches, "losses": seen.losses, "grad_norms": seen.grad_norms,
           "shapes": shapes, "coords": {axis: layout.rank(axis) for axis in ("tp", "pp", "dp")},
           "attention": module.llm.config._attn_implementation}
    if validate:
        out["val_loss"] = float(trainer.callback_metrics["val_loss"])
    return out


def global_batches(results: list[dict]) -> list[torch.Tensor]:
    """Each step's global batch: the batches of the data-parallel ranks (one per dp coordinate), in dp order."""
    by_dp = {r["coords"]["dp"]: r["batches"] for r in sorted(results, key=lambda r: r["rank"])}
    return [torch.cat([by_dp[d][step] for d in sorted(by_dp)]) for step in range(len(results[0]["batches"]))]


def single_process(family: str, batches: list[torch.Tensor], n_layers: int = 2,
                   validation: Optional[torch.Tensor] = None, optimizer: str = "adamw", labelled: bool = False) -> dict:
    """The same training written as a plain loop over the global batches: the model's own loss (over
    :func:`masked_labels` where ``labelled``), the global grad norm before clipping at ``CLIP``, torch's AdamW (or
    :func:`make_optimizer`'s Muon)."""
    model = tiny_model(family, n_layers)
    optimizer = make_optimizer(model, optimizer)
    losses, norms = [], []
    for batch in batches:
        loss = model(input_ids=batch, labels=masked_labels(batch) if labelled else batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "grad_norms": norms, "model": model}
    if validation is not None:
        with torch.no_grad():
            out["val_loss"] = model(input_ids=validation, labels=validation).loss.item()
    return out
