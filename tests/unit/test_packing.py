"""Whole conversations packed by best-fit decreasing, and a packed document computing what it computes alone."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from lightning_mgpu.data.packing import best_fit_decreasing, lay_out
from lightning_mgpu.models.llama import Llama, LlamaConfig


def test_best_fit_decreasing_places_each_document_where_the_least_room_is_left():
    """By hand, capacity 10, lengths 6 5 4 3 2 2: 6 opens A (room 4), 5 opens B (5), 4 fits A exactly (0 < 5), 3 goes
    to B (room 2), 2 to B (0), 2 opens C. Broken once (worst fit: the most room), 4 went to B and this failed."""
    packing = best_fit_decreasing([2, 6, 3, 5, 2, 4], 10)
    assert packing.sequences == [[1, 5], [3, 2, 0], [4]]
    assert packing.efficiency == pytest.approx(22 / 30)
    with pytest.raises(ValueError, match="1 document\\(s\\) longer than the sequence \\(10 tokens\\).*--max-tokens 10"):
        best_fit_decreasing([11, 3], 10)


def test_lay_out_pads_with_the_end_of_document_token_and_no_answer():
    tokens = np.array([5, 6, 9, 7, 8, 9, 4, 9])
    mask = np.array([0, 1, 0, 0, 1, 0, 1, 0], dtype=np.uint8)
    starts = np.array([0, 3, 6, 8])
    packing = best_fit_decreasing([3, 3, 2], 7)
    ids, answer = lay_out(packing, tokens, mask, starts, 9, 0)
    assert ids.tolist() == [5, 6, 9, 7, 8, 9, 9] and answer.tolist() == [0, 1, 0, 0, 1, 0, 0]


def test_two_packed_documents_give_each_the_logits_it_has_alone():
    """Attention within a document and positions restarting at it (the model's eod_token_id): each of two packed
    documents gets, position by position, the logits it gets alone. Without eod_token_id the second differs by 5.8e-2."""
    eod = 63
    config = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                         eod_token_id=eod)
    model = Llama(config, init_seed=3)
    first, second = torch.tensor([3, 17, 40, 8, eod]), torch.tensor([12, 5, 30, 22, 9, 41, eod])
    packed = torch.cat([first, second, torch.tensor([eod, eod])])[None]
    with torch.no_grad():
        together = model(packed)[0]
        alone = [model(doc[None])[0] for doc in (first, second)]
    assert torch.allclose(together[:5], alone[0], atol=1e-6)
    assert torch.allclose(together[5:12], alone[1], atol=1e-6)
    plain = Llama(replace(config, eod_token_id=None), init_seed=3)
    with torch.no_grad():
        assert not torch.allclose(plain(packed)[0][5:12], plain(second[None])[0], atol=1e-3)
