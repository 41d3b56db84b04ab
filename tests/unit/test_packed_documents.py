"""Packed documents (``LlamaConfig.eod_token_id``): attention stays within a document, positions restart, the loss
skips the target after an end-of-document token, and the planner counts what the mask keeps for backward."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lightning_mgpu import LLMModule
from lightning_mgpu.models import Llama, LlamaConfig
from lightning_mgpu.models.llama import document_positions
from lightning_mgpu.parallel.checkpointing import checkpoint_blocks
from lightning_mgpu.planner.memory import activation_bytes, document_mask_bytes
from lightning_mgpu.testing import saved_tensor_bytes

EOD = 0
CFG = LlamaConfig(vocab_size=64, n_layers=3, eod_token_id=EOD)


def documents(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    """Documents of random ids (never EOD), each ended by EOD."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(1, 64, (n,), generator=g), torch.tensor([EOD])]) for n in lengths]


def test_positions_restart_after_each_end_of_document():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9],
                           [EOD, 1, 2, 3, 4, 5, 6, 7]])
    assert document_positions(tokens, EOD).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1],
                                                        [0, 0, 1, 2, 3, 4, 5, 6]]


def test_a_packed_document_is_computed_as_if_it_were_alone():
    """Document 2's logits in a packed sample equal its logits as a sample of its own (mask and restarted positions),
    and do not change when document 1's tokens do."""
    torch.manual_seed(0)
    model = Llama(CFG)
    first, second, third = documents(6, 9, 4)
    packed = torch.cat([first, second, third])[None]
    alone = model(second[None])[0]
    logits = model(packed)[0]
    span = slice(len(first), len(first) + len(second))
    assert torch.allclose(logits[span], alone, atol=1e-5), (logits[span] - alone).abs().max()
    other_first = torch.cat([documents(6, seed=1)[0], second, third])[None]
    assert torch.allclose(model(other_first)[0, len(first):], logits[len(first):], atol=1e-6)
    # Without the mask document 1 leaks into document 2, so the comparison above can fail.
    plain = Llama(replace(CFG, eod_token_id=None))
    plain.load_state_dict(model.state_dict())
    assert (plain(packed)[0, span] - alone).abs().max() > 1e-2


def test_one_document_is_the_causal_model():
    """A sample without an end-of-document token is one document: the masked path is the plain causal model."""
    torch.manual_seed(0)
    masked = Llama(CFG)
    plain = Llama(replace(CFG, eod_token_id=None))
    plain.load_state_dict(masked.state_dict())
    tokens = torch.randint(1, 64, (2, 24))
    assert torch.allclose(masked(tokens), plain(tokens), atol=1e-5)


def test_recomputed_blocks_give_the_same_gradients_with_documents():
    torch.manual_seed(0)
    plain = Llama(CFG)
    ckpt = Llama(replace(CFG, activation_checkpointing="full"))
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(ckpt.layers, "full") == len(ckpt.layers)
    tokens = torch.cat(documents(5, 7, 6))[None].repeat(2, 1)
    for m in (plain, ckpt):
        m(tokens).square().mean().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_loss_skips_the_target_after_an_end_of_document_token():
    module = LLMModule(CFG)
    module.configure_model()
    batch = torch.cat(documents(5, 7, 6))[None].repeat(2, 1)
    inputs, targets = module.pipeline_batch(batch)
    skipped = inputs == EOD
    assert skipped.sum() == 2 * 2  # per sample two EODs are inputs; the third is its last token, an input to nothing
    assert (targets[skipped] == -100).all() and torch.equal(targets[~skipped], batch[:, 1:][~skipped])
    logits = module.model(inputs)
    counted = F.cross_entropy(logits[~skipped], batch[:, 1:][~skipped])
    assert torch.allclose(module.loss(batch), counted)
    assert LlamaConfig(vocab_size=64).eod_token_id is None  # the default: no documents, every target counts


def test_bad_end_of_document_id_is_refused():
    with pytest.raises(ValueError, match=r"eod_token_id=64 is not a token id of vocab_size=64"):
        LlamaConfig(vocab_size=64, eod_token_id=64)


def _saved_bytes(cfg: LlamaConfig, tokens: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward, each storage once, leaving out parameters and buffers."""
    model = Llama(cfg)
    return saved_tensor_bytes([model], lambda: model(tokens))


@pytest.mark.parametrize("n_layers", [2, 4])
def test_planner_counts_what_the_mask_keeps_for_backward(n_layers):
    """Measured: the masked forward saves exactly the planner's document bytes more than the causal one (fp32: 4-byte
    bias), once per forward whatever the number of blocks, since the blocks share one bias."""
    cfg = replace(CFG, n_layers=n_layers)
    b, s = 2, 40
    tokens = torch.randint(1, 64, (b, s))
    tokens[:, ::7] = EOD
    extra = _saved_bytes(cfg, tokens) - _saved_bytes(replace(cfg, eod_token_id=None), tokens)
    assert extra == document_mask_bytes(cfg, s, b, element_bytes=4) == 4 * b * s * s + 4 * b * s * cfg.head_dim


def test_planner_adds_one_mask_per_chunk_and_micro_batch_in_flight():
    big = replace(LlamaConfig.from_name("llama3_8b"), eod_token_id=128001)
    plain = replace(big, eod_token_id=None)
    s, b = 8192, 1
    mask = document_mask_bytes(big, s, b)
    assert mask == 2 * s * s + 4 * s * big.head_dim  # 134 MB: bf16 bias and fp32 rotary tables
    for tp, pp, virtual, sp, chunks in ((1, 1, 1, False, 1), (8, 1, 1, True, 1), (2, 4, 1, False, 4),
                                        (2, 4, 2, True, 4 * (1 + 3 / 8) * 2)):
        extra = activation_bytes(big, s, b, tp, pp, virtual, sp, False) - activation_bytes(plain, s, b, tp, pp,
                                                                                          virtual, sp, False)
        assert extra == pytest.approx(mask * chunks), (tp, pp, virtual)
    # context parallel 2: each rank keeps its s/2 queries' rows of the bias over the whole sequence's keys (and s/2
    # rotary rows): half the mask
    extra = activation_bytes(big, s, b, 1, 1, 1, False, False, 2) - activation_bytes(plain, s, b, 1, 1, 1, False,
                                                                                      False, 2)
    assert extra == pytest.approx((2 * (s // 2) * s + 4 * (s // 2) * big.head_dim) * b)
