"""Muon that orthogonalises each weight matrix whole, whatever piece of it a rank steps.

Muon (momentum, then Newton-Schulz orthogonalisation of each weight matrix, then a decoupled-weight-decay step) is
``torch.optim.Muon``'s arithmetic here, step for step: the momentum and the update are elementwise and run on
whatever this rank holds (a tensor-parallel shard, a ZeRO partition); only the Newton-Schulz iteration, which a
shard of a matrix does not commute with, runs on the whole matrix, assembled by the :mod:`whole_matrices` object
bound to that tensor, and each rank keeps its piece of the result. Under ZeRO 1-2 a data-parallel rank
orthogonalises only the matrices that overlap its partition; the ranks of a tensor-parallel group, which assemble the
same matrices, split the iterations between them (:func:`orthogonalize_all`), and so do the data-parallel ranks of a
ZeRO-3 sub-group. The momentum stays sharded as the layout shards it. torch's private ``_zeropower_via_newtonschulz`` and ``_adjust_lr`` are called by name (torch is pinned):
they make one process of this optimizer and of ``torch.optim.Muon`` compute the same bits.

``torch.optim.Muon`` itself cannot do this: its step runs on the tensors it is handed (a flat ZeRO partition fails
its 2-D check, a tensor-parallel shard is orthogonalised on its own, which is another update).

:class:`MuonWithAdamW` adds AdamW groups for the parameters Muon is not for (embeddings, norms, the output head, a
router), as Muon's authors prescribe, in one optimizer (Lightning drives one under automatic optimisation).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.optim import _muon as torch_muon

from lightning_mgpu.optim.whole_matrices import SharedWork, Unsplit, whole_of_many

#: How a stepped tensor assembles (None: it is a parameter held whole).
MatricesOf = Callable[[torch.Tensor], Optional[Any]]


#: Hyperparameters of a Muon group (torch.optim.Muon's names and defaults).
MUON_DEFAULTS = {"momentum": 0.95, "nesterov": True, "ns_coefficients": (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B,
                 torch_muon.DEFAULT_C), "eps": torch_muon.EPS, "ns_steps": torch_muon.DEFAULT_NS_STEPS,
                 "adjust_lr_fn": None, "ns_dtype": None}


def orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    """Newton-Schulz of one whole matrix, returned in fp32 with Muon's shape-dependent LR factor folded in.

    In bf16 it is torch.optim.Muon's own function, so one process of either optimizer computes the same bits. bf16
    rounding makes the result a step function of its input: a gradient summed in another order (over data-parallel
    ranks) flips some roundings, and runs drift apart by about 1e-5 in loss within 10 steps of the tiny model.
    ``ns_dtype=torch.float32`` runs the same iteration in fp32 (torch's function fixes bf16). ``ns_dtype=None``
    (:class:`MuonWithAdamW`'s default) is bf16 on a GPU and fp32 on a CPU, where bf16 matmuls have no hardware path:
    one 768 x 256 matrix took 0.61 s in bf16 and 0.017 s in fp32 here (torch 2.13, one thread). A
    ``torch.optim.Muon`` group has no ``ns_dtype``: torch's bf16, as on one process."""
    dtype = group.get("ns_dtype", torch.bfloat16) or (torch.bfloat16 if update.is_cuda else torch.float32)
    if dtype == torch.bfloat16:
        ortho = torch_muon._zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"],
                                                       group["eps"])
    else:
        ortho = _newton_schulz(update.to(dtype), group["ns_coefficients"], group["ns_steps"], group["eps"])
    return ortho.float() * torch_muon._adjust_lr(1.0, group["adjust_lr_fn"], update.shape)


def _newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic iteration, operation for operation, in ``x``'s dtype."""
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x).clone()
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def owners(shapes: list[torch.Size], size: int) -> list[int]:
    """Which of ``size`` ranks orthogonalises each matrix: the costliest first (``min(n, m)^2 max(n, m)`` per
    iteration), each to the least loaded rank; every rank computes the same answer from the same shapes."""
    cost = [min(s) ** 2 * max(s) for s in shapes]
    loads, out = [0] * size, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        out[i] = min(range(size), key=lambda r: (loads[r], r))
        loads[out[i]] += cost[i]
    return out


def orthogonalize_all(wholes: list[torch.Tensor], group: dict, shares: Sequence[SharedWork] = ()
                      ) -> list[torch.Tensor]:
    """:func:`orthogonalize` of each whole matrix. With ``shares`` (nested groups of ranks that assemble the same
    matrices: a ZeRO-3 data-parallel group, then a tensor-parallel group), each rank of the first computes its
    :func:`owners` share, split further over the rest, and one all-gather per group hands every rank all results:
    the work is divided by the groups' sizes where it was repeated on each rank."""
    shares = [s for s in shares if s is not None and s.size > 1]
    if not shares or not wholes:
        return [orthogonalize(w, group) for w in wholes]
    share = shares[0]
    owner = owners([w.shape for w in wholes], share.size)
    lengths = [sum(w.numel() for w, o in zip(wholes, owner) if o == r) for r in range(share.size)]
    mine = orthogonalize_all([w for w, o in zip(wholes, owner) if o == share.rank], group, shares[1:])
    flat = wholes[0].new_zeros(max(lengths), dtype=torch.float32)
    flat[:lengths[share.rank]] = torch.cat([m.reshape(-1) for m in mine]) if mine else flat[:0]
    gathered = [torch.empty_like(flat) for _ in range(share.size)]
    dist.all_gather(gathered, flat, group=share.group)
    offsets, out = [0] * share.size, []
    for w, o in zip(wholes, owner):
        out.append(gathered[o][offsets[o]:offsets[o] + w.numel()].view(w.shape))
        offsets[o] += w.numel()
    return out


def muon_group_step(group: dict, state: dict, matrices_of: MatricesOf, share: Optional[SharedWork] = None) -> None:
    """One Muon step of ``group``'s tensors (``torch.optim.Muon``'s single-tensor step, with the orthogonalisation
    over whole matrices, assembled for all of the group's tensors at once)."""
    lr, momentum = group["lr"], group["momentum"]
    items = []
    for param in group["params"]:
        if param.grad is None:
            continue
        grad, kept = param.grad, state[param]
        buffer = kept.setdefault("momentum_buffer", torch.zeros_like(grad, memory_format=torch.preserve_format))
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        items.append((param, matrices_of(param) or Unsplit(param.shape), update))
    # a ZeRO-3 sub-group (one flat tensor) is assembled alike on every rank of its data-parallel group
    shares = [getattr(items[0][1], "share", None) if len(items) == 1 else None, share]
    directions = orthogonalize_all(whole_of_many([(m, u) for _, m, u in items]), group, shares)
    used = 0
    for param, matrices, _ in items:
        mine, used = directions[used:used + matrices.count], used + matrices.count
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(matrices.local(mine).reshape(param.shape), alpha=-lr)
        kept = state[param]
        kept["step"] = kept.get("step", torch.tensor(0.0)) + 1  # checkpoints read a step count from the state


def is_muon_group(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """A group Muon steps: every group of ``torch.optim.Muon``, the ``muon=True`` groups of :class:`MuonWithAdamW`."""
    return isinstance(optimizer, torch.optim.Muon) or bool(group.get("muon"))


#: The optimizer state Muon keeps per parameter (torch.optim.Muon's key).
MUON_STATE_KEYS = ("momentum_buffer",)


def tag_state_keys(optimizer: torch.optim.Optimizer) -> None:
    """Mark each parameter Muon steps with the state keys it keeps (``optimizer_state_keys``): layout-independent
    checkpoints save and reshard those instead of Adam's moments. Called before DeepSpeed replaces the groups'
    parameters with its flat partitions."""
    for group in optimizer.param_groups:
        if is_muon_group(optimizer, group):
            for param in group["params"]:
                param.optimizer_state_keys = MUON_STATE_KEYS


def muon_offload_problem(offload: str, key: str) -> str:
    """The rule: Muon does not run with its state offloaded. Its whole-matrix step gathers the offloaded partitions
    with the data-parallel group's collectives, which on GPUs (NCCL) take device tensors only; DeepSpeed's own Muon
    refuses optimizer offload too."""
    return (f"{key}={offload!r} with Muon: Muon's whole-matrix step gathers ZeRO partitions in device memory and "
            "cannot run on offloaded optimizer state; leave the optimizer in device memory (a higher zero_stage "
            "shards it further), or use AdamW")


def is_matrix_optimizer(optimizer: Any) -> bool:
    """An optimizer whose step needs whole matrices (Muon, alone or with AdamW groups)."""
    return isinstance(optimizer, (torch.optim.Muon, MuonWithAdamW))


def bind_whole_matrices(optimizer: torch.optim.Optimizer, matrices_of: MatricesOf,
                        share: Optional[SharedWork] = None) -> None:
    """Make ``optimizer`` orthogonalise whole matrices, each tensor it steps assembled by ``matrices_of``, the work
    split over ``share``.

    A ``torch.optim.Muon`` keeps its identity (its LR schedulers and Lightning hold it): its step is replaced by the
    whole-matrix one, run through torch's own step wrapper so that step hooks (``register_step_pre_hook``, global
    optimizer hooks) still fire. Its LR schedulers wrapped the old step to record that it ran (``_opt_called``); the
    new one records it too and carries their mark, so they neither warn nor wrap it again. A subclass with a step of
    its own is refused: replacing it would drop what it does."""
    if isinstance(optimizer, MuonWithAdamW):
        optimizer.matrices_of, optimizer.share = matrices_of, share
        return
    if type(optimizer).step is not torch.optim.Muon.step:
        raise ValueError(f"{type(optimizer).__name__} overrides torch.optim.Muon.step, which MGPUStrategy would have "
                         "to replace to orthogonalise whole matrices; return torch.optim.Muon or "
                         "lightning_mgpu.optim.MuonWithAdamW from configure_optimizers")

    @torch.no_grad()
    def whole_matrix_step(self: torch.optim.Optimizer, closure: Optional[Callable] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._opt_called = True
        for group in self.param_groups:
            muon_group_step(group, self.state, matrices_of, share)
        return loss

    step = types.MethodType(torch.optim.Optimizer.profile_hook_step(whole_matrix_step), optimizer)
    step.__func__._wrapped_by_lr_sched = True
    optimizer.step = step


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the groups marked ``muon=True`` (2-D weight matrices, or stacks of expert matrices), AdamW
    (``torch.optim.AdamW``'s own step) for the rest.

    Each group takes its kind's hyperparameters: Muon's (``momentum``, ``nesterov``, ``ns_steps``,
    ``adjust_lr_fn``, ...; ``eps`` is Newton-Schulz's) or AdamW's (``betas``, ``eps``, ...); ``lr`` and
    ``weight_decay`` are shared defaults. With ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's rule) one LR and one
    schedule serve both kinds.
    """

    def __init__(self, params: Iterable[dict], lr: float = 1e-3, weight_decay: float = 0.1,
                 muon: Optional[dict] = None, adamw: Optional[dict] = None) -> None:
        self._adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=lr, weight_decay=weight_decay,
                                        **(adamw or {}))
        muon_defaults = {**MUON_DEFAULTS, **(muon or {})}
        groups = []
        for group in params:
            kind = muon_defaults if group.get("muon") else self._adamw.defaults
            groups.append({**{k: v for k, v in kind.items() if k not in ("lr", "weight_decay")}, **group})
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        #: how each stepped tensor assembles into whole matrices (set by the engine; None: held whole)
        self.matrices_of: MatricesOf = lambda tensor: None
        self.share: Optional[SharedWork] = None  #: ranks that split the orthogonalisation (set by the engine)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("muon"):
                muon_group_step(group, self.state, self.matrices_of, self.share)
            else:  # AdamW's own step over this group and this optimizer's state (load_state_dict replaces it)
                self._adamw.param_groups, self._adamw.state = [group], self.state
                self._adamw.step()
        return loss
