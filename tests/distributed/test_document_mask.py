"""Packed documents (``data.document_mask``) under tensor, sequence, context and pipeline parallelism and over
data-parallel replicas: loss, gradient norm and validation loss equal one process's, whose loss is the mean over the counted targets
(those not after an end-of-document token) of each global batch."""

from dataclasses import replace

from helpers import TINY, assert_parity, fit, in_turn, make_document_token_file, reference

from lightning_mgpu.testing import run_distributed

EOD = TINY.vocab_size - 1
DOCS = replace(TINY, n_layers=4, eod_token_id=EOD)  # 4 blocks: 4 stages for pp2 x 2 virtual
#: The mask changes the first step's loss and gradient norm; the steps after it see the updated weights.
STEPS = 3


def test_documents_match_single_process_with_tp_sp_pp_and_dp(tmp_path):
    tokens = make_document_token_file(tmp_path, EOD)  # documents of 2-23 tokens: 1-2 boundaries per 16-token sample
    expected = reference(tokens, steps=STEPS, clip=0.3, model=DOCS, val_batches=1)
    layouts = (
        # positions handed from stage to stage, across ranks and between a rank's own two stages; mask and vocabulary-
        # parallel loss on tensor-parallel ranks whose blocks see sequence shards
        dict(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
             pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2),
        # tensor parallelism without sequence parallelism; counted targets summed over two replicas
        dict(tensor_parallel_size=2, zero_stage=1),
        # context parallelism: positions from the whole sequence, each chunk's queries over the gathered keys of their
        # own documents, the counted targets of every chunk; over two replicas, and with positions handed between
        # pipeline stages (the first stage takes a chunk's tokens and their positions)
        dict(context_parallel_size=2, zero_stage=1),
        dict(context_parallel_size=2, pipeline_parallel_size=2),
    )
    calls = {i: (fit, (tokens, 4), dict(max_steps=STEPS, model=DOCS, validate=True, **layout))
             for i, layout in enumerate(layouts)}
    runs = run_distributed(in_turn, 4, calls)  # both layouts in one launch, one after the other
    for i, layout in enumerate(layouts):
        results = [r[i] for r in runs]
        assert_parity(results, expected)
        for r in results:
            assert abs(r["val_loss"] - expected["val_loss"]) < 1e-5, (layout, r["val_loss"], expected["val_loss"])
