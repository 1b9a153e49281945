"""The tokenizer travels with the run: saved in the run dir (`tokenizer/`, beside the checkpoints) when
a run first starts, so `shard generate --prompt`, `shard eval` and `shard export-hf` find it from a
checkpoint without being told. A model imported from Hugging Face keeps its folder's tokenizer among
the side files (shard.run.hf_side.SIDE_DIR), which is read when the run dir has no tokenizer of its own. An
export's tokenizer_config.json names the special tokens shard read the data with (name_special_tokens)."""

import json
from pathlib import Path

from shard.data.tokenizers import (BYTE_FILE, BYTE_VOCAB, HF_FILE, SP_FILE, ByteTokenizer, HuggingFaceTokenizer,
                                   Tokenizer, load_tokenizer, read_json_object)
from shard.errors import ShardError
from shard.paths import TOKENIZER_DIR


def run_tokenizer(cfg, source=None) -> Tokenizer | None:
    """The tokenizer a config's data is read with (None: synthetic data, which has none); `source`: the
    data's description (shard.data.sources.DataSource), where the caller has it."""
    from shard.data.sources import SYNTHETIC, data_source

    source = source or data_source(cfg)
    if source.kind == SYNTHETIC:
        return None
    return load_tokenizer(source.tokenizer)


def save_run_tokenizer(cfg, run_dir: Path, source=None) -> None:
    """Keep the run's tokenizer in run_dir/tokenizer (once: a resumed run keeps the one it started with)."""
    tok = run_tokenizer(cfg, source)
    if tok is not None and not (run_dir / TOKENIZER_DIR).exists():
        tok.save(run_dir / TOKENIZER_DIR)


def check_run_tokenizer(cfg, run_dir: Path, source=None) -> None:
    """A resumed run reads its data with the tokenizer it started with (its run dir's): another one
    would give its ids other meanings, silently."""
    saved_dir = run_dir / TOKENIZER_DIR
    if not saved_dir.is_dir():
        return
    tok = run_tokenizer(cfg, source)
    saved = load_tokenizer(str(saved_dir))
    if tok is not None and tok.fingerprint != saved.fingerprint:
        raise ShardError(f"the run in {run_dir} trained with the {saved.kind} tokenizer {saved.fingerprint} (its "
                         f"tokenizer/ folder), and this start reads its data with the {tok.kind} tokenizer "
                         f"{tok.fingerprint}: give --tokenizer {saved_dir}, or start a new run")


def with_weights_tokenizer(cfg):
    """A run that starts from weights (init_from) reads its data with the tokenizer they came with
    (tokenizer_folder): data.tokenizer becomes it where none was given, and a given one that is another
    tokenizer is refused, since the weights' ids mean their own tokens. Weights that name no tokenizer
    leave the config as it is."""
    import dataclasses

    folder = tokenizer_folder(cfg.init_from)
    if folder is None:
        return cfg
    if not cfg.data.tokenizer:
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(folder)))
    given, theirs = load_tokenizer(cfg.data.tokenizer), load_tokenizer(str(folder))
    if (given.kind, given.fingerprint) != (theirs.kind, theirs.fingerprint):
        raise ShardError(f"--tokenizer {cfg.data.tokenizer} is the {given.kind} tokenizer {given.fingerprint}, not the "
                         f"{theirs.kind} tokenizer {theirs.fingerprint} the weights in {cfg.init_from} came with "
                         f"({folder}): leave out --tokenizer to read the data with theirs")
    return cfg


def tokenizer_folder(weights: str | Path) -> Path | None:
    """The folder of the tokenizer that goes with some weights: a Hugging Face folder itself, or for a
    shard checkpoint its run dir's tokenizer/ (else the side files it imported); None when none says."""
    from shard.run.checkpoint import find_checkpoint
    from shard.run.hf_config import is_hf_dir
    from shard.run.hf_side import SIDE_DIR

    if is_hf_dir(weights):
        candidates = [Path(weights)]
    else:
        run_dir = find_checkpoint(weights)[0].parent
        candidates = [run_dir / TOKENIZER_DIR, run_dir / SIDE_DIR]
    for folder in candidates:
        if any((folder / name).is_file() for name in (HF_FILE, SP_FILE, BYTE_FILE)):
            return folder
    return None


def tokenizer_for(weights: str | Path, vocab_size: int) -> Tokenizer | None:
    """The tokenizer of some weights (tokenizer_folder); bytes for a 256-token model that names none;
    None when there is none to be found."""
    folder = tokenizer_folder(weights)
    if folder is not None:
        tok = load_tokenizer(str(folder))
        if tok.vocab_size > vocab_size:
            raise ShardError(f"the tokenizer in {folder} has {tok.vocab_size:,} ids, more than the model's vocabulary "
                             f"of {vocab_size:,}: it is not this model's")
        return tok
    return ByteTokenizer() if vocab_size == BYTE_VOCAB else None


def copy_tokenizer(weights: str | Path, out: Path) -> bool:
    """Write the tokenizer of some weights into `out` (export-hf) unless `out` holds one already (the side
    files') or it is the byte tokenizer (Hugging Face has no file for it); whether it wrote one. Either way
    a tokenizer.json in `out` ends up with a tokenizer_config.json naming its special tokens
    (name_special_tokens)."""
    folder = tokenizer_folder(weights)
    wrote = False
    if folder is not None and not any((out / name).is_file() for name in (HF_FILE, SP_FILE)):
        tok = load_tokenizer(str(folder))
        if not isinstance(tok, ByteTokenizer):
            tok.save(out)
            wrote = True
    name_special_tokens(out)
    return wrote


def name_special_tokens(folder: Path) -> None:
    """Give the Hugging Face tokenizer in `folder` (an export) the tokenizer_config.json transformers
    needs to know its end-of-text token (and a class to load it with, its BOS and PAD), where its own
    does not say or it has none: AutoTokenizer then has the eos_token shard trained with, which lm-eval's
    `hf` backend and generation need. Keys the config has are kept; nothing is written when none is
    missing."""
    if not (folder / HF_FILE).is_file():
        return
    tok = HuggingFaceTokenizer(folder / HF_FILE)
    config = tok.transformers_config()
    if not tok.config_path.is_file() or read_json_object(tok.config_path) != config:
        tok.config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
