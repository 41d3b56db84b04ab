"""Offline data: the built-in corpus, the user's text/JSONL files, pre-tokenised token files and directories
(``mgpu-prepare``), blends of them, conversations packed for fine-tuning (``mgpu-prepare --chat``), and tokenizers by
path."""

from lightning_mgpu.data.batching import BatchPlan
from lightning_mgpu.data.blend import Blend
from lightning_mgpu.data.corpus import BYTE_VOCAB_SIZE, decode_bytes, encode_bytes
from lightning_mgpu.data.sft import SFTDataModule
from lightning_mgpu.data.tokenizer import Tokenizer
from lightning_mgpu.data.tokens import StdlibCorpusDataModule, TextFilesDataModule, TokenFileDataModule

__all__ = ["BYTE_VOCAB_SIZE", "BatchPlan", "Blend", "SFTDataModule", "StdlibCorpusDataModule", "TextFilesDataModule",
           "TokenFileDataModule", "Tokenizer", "decode_bytes", "encode_bytes"]
