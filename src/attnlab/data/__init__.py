"""Datasets, tokenizers and synthetic tasks."""
from attnlab.data.batching import LMBatches, TokenBucketBatches, lm_eval_batches, pad_batch
from attnlab.data.datasets import (DATASETS, ChecksumError, DatasetSpec, DataUnavailableError, RemoteFile, data_dir,
                                   fetch, load_parallel, load_sentences, load_text)
from attnlab.data.tokenizers import CharTokenizer, TextTokenizer, load_tokenizer, train_bpe, train_wordpiece

__all__ = ["DATASETS", "DatasetSpec", "RemoteFile", "DataUnavailableError", "ChecksumError", "data_dir", "fetch",
           "load_text", "load_parallel", "load_sentences", "CharTokenizer", "TextTokenizer", "train_bpe",
           "train_wordpiece", "load_tokenizer", "LMBatches", "lm_eval_batches", "TokenBucketBatches", "pad_batch"]
