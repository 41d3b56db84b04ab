"""Shared pieces of the tests: a tiny token file, a recorded Trainer run and its single-process reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from lightning_mgpu import LLMModule, MGPUStrategy
from lightning_mgpu.data import TokenFileDataModule
from lightning_mgpu.data.tokens import sample_starts
from lightning_mgpu.models import LlamaConfig
from lightning_mgpu.parallel.compile import MARK as COMPILED
from lightning_mgpu.parallel.context import ContextParallelAttention

TINY = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64)
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 16, 8, 2
OPTIM = dict(lr=3e-3, warmup_steps=2, max_steps=10, min_lr_ratio=0.1, weight_decay=0.1)
#: The length of a parity run: a wrong split shows in the first step's loss or gradient norm, a wrong optimizer, clipping
#: or schedule from the second; 4 steps cover the warm-up (2) and the start of the cosine decay (OPTIM's horizon is 10,
#: so the learning rate still changes every step). Each step costs 0.1-0.3 s under tensor or pipeline parallelism here.
STEPS = 4


def make_token_file(directory: Path, n_tokens: int = 20_000, vocab: int = 64, seed: int = 0) -> Path:
    """A token stream with learnable structure (a noisy repeating pattern) as a uint16 token file."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab, size=97)
    tokens = np.tile(pattern, n_tokens // len(pattern) + 1)[:n_tokens]
    noise = rng.random(n_tokens) < 0.1
    tokens[noise] = rng.integers(0, vocab, size=int(noise.sum()))
    path = Path(directory) / "tokens.u16"
    tokens.astype(np.uint16).tofile(path)
    return path


class Recorder(L.Callback):
    """Records, per optimizer step, the global loss the strategy returned and the engine's grad norm."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[Optional[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) * trainer.accumulate_grad_batches)  # Lightning hands on the loss / N
        self.grad_norms.append(getattr(trainer.strategy, "last_grad_norm", None))


class SaveAtStep(L.Callback):
    """Writes a checkpoint after optimizer step ``step`` of a longer run, as a periodic checkpoint does: a save/resume
    test then needs the uninterrupted run and the resumed one only."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class DtypeProbe(L.Callback):
    """Records the dtype of the engine's parameters and of the first linear layer's output in training: the proof
    that a mixed-precision run really computed in that precision (its losses alone cannot tell)."""

    def __init__(self) -> None:
        self.param_dtype: Optional[str] = None
        self.activation_dtype: Optional[str] = None

    def on_train_start(self, trainer, pl_module) -> None:
        module = trainer.strategy.model.module
        self.param_dtype = str(next(module.parameters()).dtype)
        # nn.Linear or a parallel one; not inside a compiled block, where a hook that records would break its graph
        compiled = [name for name, m in module.named_modules() if getattr(m, COMPILED, None)]
        linear = next((m for name, m in module.named_modules() if "Linear" in type(m).__name__
                       and not any(name.startswith(c + ".") for c in compiled)), None)

        def record(_module, _inputs, output) -> None:
            self.activation_dtype = str(output.dtype)

        if linear is not None:
            linear.register_forward_hook(record)


def datamodule(token_file: Path, **kw: Any) -> TokenFileDataModule:
    args = dict(seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7, val_batches=1)
    args.update(kw)
    return TokenFileDataModule(token_file, **args)


def fit(rank: int, token_file: Path, devices: int, max_steps: int = STEPS, precision: str = "32-true",
        clip: Optional[float] = 0.3, ckpt_path: Optional[str] = None, save_to: Optional[str] = None,
        model: LlamaConfig = TINY, data: Optional[dict] = None, module: Optional[L.LightningModule] = None,
        callbacks: Optional[list] = None, validate: bool = False, accumulate: int = 1,
        trainer_kw: Optional[dict] = None, check_layout: bool = True, **strategy_kwargs: Any) -> dict:
    """One Trainer.fit on this process (one rank of ``devices``); returns what it recorded.

    With ``validate`` one validation batch runs after the last step and its ``val/loss`` is returned; ``check_layout``
    asserts the groups and the materialised count (:func:`assert_layout_applied`)."""
    recorder, probe = Recorder(), DtypeProbe()
    kw = dict(accelerator="cpu", devices=devices, strategy=MGPUStrategy(**strategy_kwargs), precision=precision,
              max_steps=max_steps, gradient_clip_val=clip, logger=False, accumulate_grad_batches=accumulate,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=1 if validate else 0, val_check_interval=max_steps if validate else None,
              check_val_every_n_epoch=None if validate else 1, num_sanity_val_steps=0,
              callbacks=[recorder, probe, *(callbacks or [])])
    trainer = L.Trainer(**{**kw, **(trainer_kw or {})})
    module = module or LLMModule(model, **OPTIM, global_batch_size=GLOBAL_BATCH)
    trainer.fit(module, datamodule(token_file, **(data or {})), ckpt_path=ckpt_path)
    if check_layout:
        assert_layout_applied(trainer, devices, strategy_kwargs)
    if save_to:
        trainer.save_checkpoint(save_to)
    result = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "rank": rank,
              "param_dtype": probe.param_dtype, "activation_dtype": probe.activation_dtype}
    if validate:
        result["val_loss"] = float(trainer.callback_metrics["val/loss"])
    pipeline = getattr(trainer.strategy, "pipeline", None)
    if pipeline is not None and pipeline.timeline is not None:
        result["timeline"] = pipeline.timeline.actions
    return result


def expected_groups(rank: int, devices: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                    context_parallel_size: int = 1, replicas: int = 1, **_: Any) -> dict[str, list[int]]:
    """The members of ``rank``'s tp, cp, pp, dp and rep groups, of the data x context group ZeRO uses and of its
    replica, written out
    from the rank order docs/concepts/layout.md states (``tp = r % T``, ``cp = (r // T) % C``,
    ``pp = (r // (T * C)) % P``, ``dp = (r // (T * C * P)) % D``, replicas outermost), independently of
    ``ParallelLayout``."""
    T, C, P, R = tensor_parallel_size, context_parallel_size, pipeline_parallel_size, replicas
    D = devices // (T * C * P * R)
    t, c, p, d, k = rank % T, (rank // T) % C, (rank // (T * C)) % P, (rank // (T * C * P)) % D, rank // (T * C * P * D)

    def at(t_, c_, p_, d_, k_=k):
        return t_ + T * (c_ + C * (p_ + P * (d_ + D * k_)))

    return {"tp": [at(u, c, p, d) for u in range(T)], "cp": [at(t, u, p, d) for u in range(C)],
            "pp": [at(t, c, q, d) for q in range(P)], "dp": [at(t, c, p, e) for e in range(D)],
            "dp_cp": sorted(at(t, u, p, e) for e in range(D) for u in range(C)),
            "rep": [at(t, c, p, d, j) for j in range(R)],
            "replica": sorted(at(a, b, q, e) for a in range(T) for b in range(C) for q in range(P) for e in range(D))}


def assert_layout_applied(trainer: L.Trainer, devices: int, strategy_kwargs: dict) -> None:
    """The layout a test asked for is the one that ran: group members, ZeRO stage and data-parallel size of the
    engine, and (for a Llama) the local parameter count of this rank equal to the planner's count for it."""
    import torch.distributed as dist

    from lightning_mgpu.planner.model_stats import rank_parameters

    strategy, rank = trainer.strategy, trainer.global_rank
    for axis, members in expected_groups(rank, devices, **strategy_kwargs).items():
        got = sorted(dist.get_process_group_ranks(strategy.layout.group(axis)))
        assert got == members, f"rank {rank}: {axis} group {got}, expected {members}"
    engine = strategy.model
    assert engine.zero_optimization_stage() == strategy_kwargs.get("zero_stage", 0)
    D = len(expected_groups(rank, devices, **strategy_kwargs)["dp_cp"])  # ZeRO's group: data x context ranks
    assert engine.dp_world_size == D, (engine.dp_world_size, D)
    T = strategy_kwargs.get("tensor_parallel_size", 1)
    split = [p for p in engine.module.parameters() if getattr(p, "tensor_model_parallel", False)]
    assert bool(split) == (T > 1), f"rank {rank}: {len(split)} tensor-parallel parameters at tensor_parallel_size={T}"
    for p in split:  # each holds one T-th of its (padded) dimension
        shape = getattr(p, "ds_shape", p.shape)
        assert shape[p.partition_dim] * T >= p.full_size > (shape[p.partition_dim] - 1) * T, (shape, p.full_size)
    C = strategy_kwargs.get("context_parallel_size", 1)
    kernels = [m.kernel for m in engine.module.modules() if hasattr(m, "kernel")]
    swapped = [k for k in kernels if isinstance(k, ContextParallelAttention)]
    assert len(swapped) == (len(kernels) if C > 1 else 0), f"rank {rank}: {len(swapped)} of {len(kernels)} " \
        f"attention kernels are context-parallel at context_parallel_size={C}"
    config = getattr(trainer.lightning_module, "config", None)
    if isinstance(config, LlamaConfig):
        layout = strategy.layout
        ids = layout.stage_ids(layout.rank("pp"))
        expected = rank_parameters(config, layout.size("tp"), layout.size("pp"), len(ids), layout.rank("pp"),
                                   stage_ids=ids, boundaries=strategy_kwargs.get("pipeline_boundaries"))
        local = sum(getattr(q, "ds_numel", q.numel()) for q in engine.module.parameters())
        assert local == expected, f"rank {rank} holds {local} parameters; the planner counts {expected}"
        # the summary's figures: the whole model, counted over the ranks, and this rank's part
        assert (strategy.parameter_counts.total, strategy.parameter_counts.on_rank) == (config.num_parameters(), local)
        # Built on the meta device: this rank gave storage to its own share and nothing else.
        assert strategy.materialized_elements == expected, (strategy.materialized_elements, expected)


def assert_parity(results: list[dict], expected: dict, tol: float = 1e-5) -> None:
    """Every rank's per-step loss AND global gradient norm equal the single-process reference within ``tol``.

    The grad norm is what sees a gradient-scale bug: under clipping and AdamW a doubled gradient barely moves the
    loss (tests/distributed/test_zero_parity.py shows it)."""
    for r in results:
        assert len(r["losses"]) == len(expected["losses"]), (len(r["losses"]), len(expected["losses"]))
        loss_diff = max_abs_diff(r["losses"], expected["losses"])
        assert loss_diff < tol, f"rank {r.get('rank')}: loss differs by {loss_diff:.3g}"
        norm_diff = max_abs_diff(r["grad_norms"], expected["grad_norms"])
        assert norm_diff < tol, f"rank {r.get('rank')}: grad_norm differs by {norm_diff:.3g}"


#: How far a bf16-mixed loss curve may sit from fp32, relative to the loss: half a bf16 ulp (2**-9, bf16 keeps 8
#: significant bits), the rounding of one bf16 value of the loss's size. Measured gaps with fp32 master weights and fp32
#: gradient reduction (ZeRO 1-3) stay near 1e-4 relative over 5-10 steps; a run whose bf16 error compounds, e.g.
#: DeepSpeed's ZeRO-0 bf16 optimizer (about 6e-3 relative after 4 steps), does not fit.
BF16_RELATIVE_TOLERANCE = 2.0**-9


def assert_bf16_curve(results: list[dict], expected: dict) -> None:
    """bf16 really ran (bf16 parameters in the engine, bf16 activations) and every step's loss stays within
    ``BF16_RELATIVE_TOLERANCE`` of the fp32 reference."""
    for r in results:
        assert r["param_dtype"] == "torch.bfloat16" and r["activation_dtype"] == "torch.bfloat16", r
        assert len(r["losses"]) == len(expected["losses"])
        for step, (got, want) in enumerate(zip(r["losses"], expected["losses"])):
            assert abs(got - want) <= BF16_RELATIVE_TOLERANCE * abs(want), (step, got, want)


def global_batches(token_file: Path, steps: int, global_batch: int = GLOBAL_BATCH, seq_len: int = SEQ_LEN,
                   seed: int = 7, val_fraction: float = 0.01, validation: bool = False):
    """The global batches ``[global_batch, seq_len + 1]`` the data module serves, in order, as one tensor each
    (with ``validation``, those of its held-out tail, drawn with ``seed + 1``)."""
    tokens = np.memmap(token_file, dtype=np.uint16, mode="r")
    split = int(len(tokens) * (1.0 - val_fraction))
    part, seed = (tokens[split:], seed + 1) if validation else (tokens[:split], seed)
    for step in range(steps):
        starts = sample_starts(seed, step, global_batch, len(part), seq_len)
        yield torch.from_numpy(np.stack([part[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def reference(token_file: Path, steps: int = STEPS, clip: Optional[float] = 0.3, model: LlamaConfig = TINY,
              global_batch: int = GLOBAL_BATCH, seq_len: int = SEQ_LEN, seed: int = 7, optim: Optional[dict] = None,
              val_fraction: float = 0.01, val_batches: int = 0, accumulate: int = 1,
              optimizers: Optional[Callable] = None) -> dict:
    """The same training, written as a plain single-process PyTorch loop over whole global batches; with
    ``val_batches``, also the mean loss over that many validation batches after the last step. With ``accumulate``,
    one optimizer step per that many global batches (gradients averaged over them); ``losses`` has one entry per
    batch and ``grad_norms`` one per optimizer step. A model with ``eod_token_id`` (documents) does not count the
    target after an end-of-document token: each batch's loss is the mean over the targets it counts.
    ``optimizers(model, optim)``: (optimizer, scheduler) built by the test instead of the module's own."""
    module = LLMModule(model, **(optim or OPTIM), global_batch_size=global_batch)
    module.configure_model()
    optimizer, scheduler = optimizers(module.model, optim) if optimizers else configured_optimizer(module)
    losses, norms = [], []
    for i, batch in enumerate(global_batches(token_file, steps * accumulate, global_batch, seq_len, seed,
                                             val_fraction)):
        logits = module.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), counted_targets(batch, model).flatten())
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate:
            continue
        norm = torch.nn.utils.clip_grad_norm_(module.model.parameters(), clip if clip else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        norms.append(norm.item())
    out = {"losses": losses, "grad_norms": norms}
    if val_batches:
        with torch.no_grad():
            val = [F.cross_entropy(module.model(b[:, :-1]).flatten(0, 1), counted_targets(b, model).flatten()).item()
                   for b in global_batches(token_file, val_batches, global_batch, seq_len, seed, val_fraction, True)]
        out["val_loss"] = sum(val) / len(val)
    return out


def configured_optimizer(module: LLMModule) -> tuple:
    """(optimizer, scheduler) of ``module.configure_optimizers()``."""
    configured = module.configure_optimizers()
    return configured["optimizer"], configured["lr_scheduler"]["scheduler"]


def counted_targets(batch: torch.Tensor, model: LlamaConfig) -> torch.Tensor:
    """The next-token targets of ``batch``; with documents (``model.eod_token_id``) the target after each
    end-of-document input is -100, which ``F.cross_entropy`` skips (written here independently of LLMModule)."""
    targets = batch[:, 1:]
    if model.eod_token_id is None:
        return targets
    return targets.masked_fill(batch[:, :-1] == model.eod_token_id, -100)


def max_abs_diff(a: list, b: list) -> float:
    assert len(a) == len(b), f"lengths differ: {len(a)} vs {len(b)}"
    return max(abs(x - y) for x, y in zip(a, b))


#: The end-of-document token of the test tokenizer (found by name, as in GPT-2's vocabulary).
TEST_EOD = "<|endoftext|>"


def corpus_text(n_bytes: int = 300_000) -> str:
    """About ``n_bytes`` of the built-in corpus (the standard library's source), whole files, in a fixed order."""
    from lightning_mgpu.data.corpus import stdlib_source_files

    parts, size = [], 0
    for path in stdlib_source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= n_bytes:
            break
    return "".join(parts)


def make_tokenizer(directory: Path, vocab_size: int = 512, n_bytes: int = 300_000) -> Path:
    """A byte-level BPE tokenizer (``vocab_size`` ids, ``<|endoftext|>`` among them) trained with the tokenizers
    package on a slice of the built-in corpus, saved as ``directory/tokenizer.json``; returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TEST_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus_text(n_bytes)
    tok.train_from_iterator((text[i:i + 10_000] for i in range(0, len(text), 10_000)), trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def make_document_token_file(directory: Path, eod: int, n_tokens: int = 20_000, seed: int = 0,
                             lengths: tuple[int, int] = (3, 24)) -> Path:
    """A packed stream of documents as mgpu-prepare writes one: :func:`make_token_file`'s stream with ids below
    ``eod``, cut into documents of ``lengths[0]``-``lengths[1]`` tokens, each ended by ``eod``; ``documents.u16``."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, eod, size=97)
    tokens = np.tile(pattern, n_tokens // len(pattern) + 1)[:n_tokens]
    noise = rng.random(n_tokens) < 0.1
    tokens[noise] = rng.integers(0, eod, size=int(noise.sum()))
    ends = np.cumsum(rng.integers(lengths[0], lengths[1] + 1, size=n_tokens // lengths[0]))
    tokens[ends[ends < n_tokens]] = eod
    path = Path(directory) / "documents.u16"
    tokens.astype(np.uint16).tofile(path)
    return path


def in_turn(rank: int, calls: dict[str, tuple]) -> dict[str, Any]:
    """Each ``name: (fn, args, kwargs)`` run as ``fn(rank, *args, **kwargs)`` one after the other on this rank, each
    building its own Trainer; what each returned, by name. One launch of ``run_distributed`` then serves many runs of
    one world size: a launch's first run pays the rank's start (its first collectives, first kernels, pages copied
    from the parent), which the runs after it do not pay again."""
    return {name: fn(rank, *args, **kwargs) for name, (fn, args, kwargs) in calls.items()}


class MeasureBeforeSecondStep(L.Callback):
    """Adam moments exist (made by step 1) and step 2's gradients are not yet freed: the model-state peak, the bytes
    of the live tensors the engine's module holds (``lightning_mgpu.testing.live_tensor_bytes``)."""

    def __init__(self) -> None:
        self.bytes = None

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        from lightning_mgpu.testing import live_tensor_bytes

        if trainer.global_step == 1:
            self.bytes = live_tensor_bytes(trainer.strategy.model.module)
