"""Tokens for training and evaluation: one description of a --data value (`describe_data`, `data_source`),
tokenizers, the token store, chat rows, windows and the global batch."""

from shard._api import lazy_api

__getattr__, __dir__, __all__ = lazy_api("shard.data", {
    "DataSource": "shard.data.sources", "describe_data": "shard.data.sources", "data_source": "shard.data.sources",
    "embedded_corpus_files": "shard.data.files",
    "Tokenizer": "shard.data.tokenizers", "ByteTokenizer": "shard.data.tokenizers",
    "load_tokenizer": "shard.data.tokenizers", "train_bpe": "shard.data.tokenizers",
    "padded_vocab": "shard.data.tokenizers", "encode": "shard.data.tokenizers",
    "prepare_store": "shard.data.store", "TokenStore": "shard.data.token_store",
    "ChatRenderer": "shard.data.chat",
})
