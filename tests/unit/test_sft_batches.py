"""A collator's SFT batch read for pipeline stages and context shards: what travels, what is refused naming the key,
and the documents packed ``position_ids`` mean (checked against ``transformers``' own reading of them)."""

import pytest
import torch
from hf_helpers import CausalLM
from transformers.masking_utils import find_packed_sequence_indices

from lightning_mgpu.hf.context import _cut_inputs, _Documents
from lightning_mgpu.hf.documents import position_arguments
from lightning_mgpu.hf.hooks import HFHooks
from lightning_mgpu.hf.model import find_hf_model

IDS = torch.arange(1, 9).reshape(1, 8)
PACKED = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])


def test_a_mask_and_positions_travel_with_the_ids_and_bad_ones_are_refused_all_at_once():
    hooks = HFHooks(find_hf_model(CausalLM("llama")), None, None)
    mask = torch.ones_like(IDS)
    (ids, positions, padding), labels = hooks.pipeline_batch({"input_ids": IDS, "labels": IDS, "attention_mask": mask})
    assert ids is IDS and padding is mask and labels is IDS
    assert positions.tolist() == [list(range(8))] and positions.is_contiguous()  # the model's default positions
    assert hooks.pipeline_batch({"input_ids": IDS, "position_ids": PACKED})[0] == (IDS, PACKED)
    with pytest.raises(ValueError) as refused:
        hooks.pipeline_batch({"input_ids": IDS, "attention_mask": mask * 2, "position_ids": PACKED[:, :4],
                              "pixel_values": IDS})
    message = str(refused.value)
    assert "keys ['pixel_values'] that cannot travel between stages" in message
    assert "the position_ids has shape [1, 4], the token ids [1, 8]" in message
    assert "attention_mask holds values other than 0 and 1: give a padding mask" in message


def test_positions_start_a_document_where_transformers_finds_one():
    """Documents at each break of the positions, 0 1 2 | 0 1 | 0 1 2, as transformers' find_packed_sequence_indices
    reads them: query i sees key j when both are in one document and j <= i."""
    mask = position_arguments(PACKED, torch.float32)["attention_mask"][0, 0]
    docs = find_packed_sequence_indices(PACKED)[0]
    expected = [[0.0 if docs[i] == docs[j] and j <= i else torch.finfo(torch.float32).min for j in range(8)]
                for i in range(8)]
    assert mask.tolist() == expected
    seen = [[j for j in range(8) if mask[i, j] == 0] for i in range(8)]
    assert seen[4] == [3, 4] and seen[7] == [5, 6, 7]  # worked by hand


def test_context_parallelism_cuts_packed_positions_and_refuses_a_mask_with_holes_naming_the_key():
    documents = _Documents()
    cut = _cut_inputs(0, 2, documents)
    _, kwargs = cut(None, (), {"input_ids": IDS, "labels": IDS, "attention_mask": torch.ones_like(IDS),
                               "position_ids": torch.arange(8)[None]})
    assert "attention_mask" not in kwargs and kwargs["position_ids"].tolist() == [[0, 1, 6, 7]]  # chunks 0 and 3
    assert documents.keys is None  # one document: the chunks' causal attention
    _, kwargs = cut(None, (), {"input_ids": IDS, "position_ids": PACKED})
    assert kwargs["position_ids"].tolist() == [[0, 1, 1, 2]]  # tokens 0, 1, 6, 7 in their documents
    allowed = (documents.mask(torch.float32)[0, 0] == 0).int().tolist()
    # query token 6 (document 0 1 [2]) sees tokens 5 and 6, token 7 sees 5, 6 and 7; tokens 0 and 1 their own start
    assert allowed == [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0],
                       [0, 0, 0, 0, 0, 1, 1, 1]]
    holes = torch.ones_like(IDS)
    holes[0, 6:] = 0
    with pytest.raises(ValueError) as refused:
        cut(None, (), {"input_ids": IDS, "attention_mask": holes, "position_ids": PACKED[:, :4]})
    message = str(refused.value)
    assert "attention_mask has 2 padding position(s) (zeros): a padding mask with holes cannot be split" in message
    assert "position_ids have shape [1, 4]: give one position per token" in message


def test_a_frozen_stage_handing_on_positions_keeps_them_and_its_placeholder_gets_a_gradient():
    """A stage that trains nothing (adapters on later layers only) of packed documents returns (hidden, positions):
    the placeholder is added to the hidden states, the positions pass as they are."""
    from torch import nn

    from lightning_mgpu.parallel.frozen import hold_placeholder

    class Stage(nn.Module):
        def forward(self, x, positions):
            return x * 2, positions

    stage = Stage()
    placeholder = hold_placeholder(stage, torch.device("cpu"))
    x = torch.ones(1, 8, 4, requires_grad=True)
    hidden, positions = stage(x, PACKED)
    assert positions is PACKED and torch.equal(hidden, x * 2)
    hidden.sum().backward()
    assert placeholder.grad is not None and float(placeholder.grad) == 0.0
