"""Offline data: the built-in corpus, the user's text/JSONL files, and pre-tokenised token files."""

from lightning_mgpu.data.batching import BatchPlan
from lightning_mgpu.data.corpus import BYTE_VOCAB_SIZE, decode_bytes, encode_bytes
from lightning_mgpu.data.tokens import StdlibCorpusDataModule, TextFilesDataModule, TokenFileDataModule

__all__ = ["BYTE_VOCAB_SIZE", "BatchPlan", "StdlibCorpusDataModule", "TextFilesDataModule", "TokenFileDataModule",
           "decode_bytes", "encode_bytes"]
