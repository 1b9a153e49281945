"""Tokenizing throughput: `prepare_store` against `datasets`' map, same tokenizer, same processes;
prints figures, never passes or fails.

    python benchmarks/tokenizing.py                 # a ~64 MB JSONL corpus, every core
    python benchmarks/tokenizing.py --mb 8 --workers 2

1. corpus: the standard library's text cut into paragraphs, shuffled, ~16 KB documents, to --mb MB of JSONL;
2. tokenizer: a byte-level BPE of 8,192 ids trained with train_bpe on its first 8 MB;
3. shard: prepare_store(workers=N) into a token store (tokens/s from the call to the store opened);
4. datasets: Dataset.from_json(...).map(batched=True, num_proc=N) calling the same tokenizer's
   encode_batch (tokens/s from the call to the mapped dataset, its cache off);
5. datasets with the tokenizer as transformers wraps it (PreTrainedTokenizerFast loaded from the same
   folder, called on the batch as transformers' run_clm.py example does): the recipe most users run.
"""

import argparse
import json
import os
import random
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path


def write_corpus(path: Path, mb: int, seed: int = 0) -> int:
    """JSONL of shuffled stdlib paragraphs, ~16 KB each document, to `mb` MB; returns its documents."""
    paragraphs = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]:
        try:
            paragraphs += [p for p in f.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        except (UnicodeDecodeError, OSError):
            continue
    rng = random.Random(seed)
    n, size = 0, 0
    with open(path, "w") as out:
        while size < mb * 1_000_000:
            rng.shuffle(paragraphs)
            for k in range(0, len(paragraphs) - 20, 20):
                line = json.dumps({"text": "\n\n".join(paragraphs[k:k + 20])}) + "\n"
                out.write(line)
                n, size = n + 1, size + len(line)
                if size >= mb * 1_000_000:
                    break
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="corpus size in MB of JSONL (default 64)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="processes for both (default: every core)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    a = ap.parse_args()

    from datasets import Dataset, disable_caching
    from datasets.utils.logging import disable_progress_bar

    from shard.data.documents import iter_documents
    from shard.data.store import prepare_store
    from shard.data.tokenizers import train_bpe

    root = Path(tempfile.mkdtemp(prefix="shard-tokenize-bench-", dir=a.dir))
    try:
        corpus = root / "corpus.jsonl"
        docs = write_corpus(corpus, a.mb)
        size = corpus.stat().st_size
        texts, seen = [], 0
        for t in iter_documents([str(corpus)]):
            texts.append(t)
            seen += len(t)
            if seen > 8_000_000:
                break
        start = time.perf_counter()
        tok = train_bpe(texts, a.vocab, root / "tokenizer")
        print(f"corpus {size / 1e6:,.1f} MB JSONL, {docs:,} documents · BPE of {tok.vocab_size:,} ids trained on "
              f"{seen / 1e6:.1f} MB in {time.perf_counter() - start:.1f}s · {a.workers} process(es) on "
              f"{os.cpu_count()} cores")

        start = time.perf_counter()
        store = prepare_store([str(corpus)], tok, root / "store", workers=a.workers, progress=False)
        shard_secs = time.perf_counter() - start
        shard_rate = store.n_tokens / shard_secs
        print(f"shard prepare_store:   {store.n_tokens:,} tokens in {shard_secs:6.2f}s  {shard_rate:>12,.0f} tokens/s "
              f"({len(store.meta['shards'])} shards)")

        disable_caching()
        disable_progress_bar()
        rust = tok._tok
        eos = tok.eos_id

        def encode(batch):
            return {"ids": [e.ids + [eos] for e in rust.encode_batch(batch["text"], add_special_tokens=False)]}

        start = time.perf_counter()
        ds = Dataset.from_json(str(corpus), cache_dir=str(root / "hf-cache"))
        mapped = ds.map(encode, batched=True, num_proc=a.workers if a.workers > 1 else None,
                        remove_columns=["text"])
        hf_secs = time.perf_counter() - start
        hf_tokens = len(mapped.data.column("ids").combine_chunks().flatten())
        hf_rate = hf_tokens / hf_secs
        print(f"datasets map:          {hf_tokens:,} tokens in {hf_secs:6.2f}s  {hf_rate:>12,.0f} tokens/s")
        print(f"ratio: shard is {shard_rate / hf_rate:.2f}x datasets (same tokenizer, {a.workers} process(es))")

        from transformers import AutoTokenizer

        wrapped = AutoTokenizer.from_pretrained(str(root / "tokenizer"))

        def encode_wrapped(batch):
            return {"ids": [ids + [eos] for ids in wrapped(batch["text"])["input_ids"]]}

        start = time.perf_counter()
        ds = Dataset.from_json(str(corpus), cache_dir=str(root / "hf-cache-2"))
        mapped = ds.map(encode_wrapped, batched=True, num_proc=a.workers if a.workers > 1 else None,
                        remove_columns=["text"])
        tf_secs = time.perf_counter() - start
        tf_rate = len(mapped.data.column("ids").combine_chunks().flatten()) / tf_secs
        print(f"datasets map, transformers' tokenizer: {tf_secs:6.2f}s  {tf_rate:>12,.0f} tokens/s")
        print(f"ratio: shard is {shard_rate / tf_rate:.2f}x datasets with transformers' tokenizer (run_clm's recipe)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
