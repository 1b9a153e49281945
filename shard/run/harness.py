"""A checkpoint's model as lm-eval's backend (shard.training.harness.ShardLM): its weights placed on a
mesh by the training rules, its tokenizer (the one that travels with the run; bytes for a 256-token
model that names none). Serves `shard eval --tasks` and benchmarks/harness.py."""

from collections.abc import Callable
from pathlib import Path

from shard.errors import ShardError

DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for weights whose context nothing records


def harness_lm(weights_path: str | Path, cfg, mesh_spec, devices, batch: int, max_length: int | None = None,
               notice: Callable[[str], None] = lambda message: None):
    """ShardLM over the weights at `weights_path` (a shard checkpoint or a Hugging Face folder) on the
    mesh `mesh_spec` of `devices`, with `cfg`'s rules; `batch` rows a batch. `max_length`: the longest
    sequence scored (default: the weights' max_position_embeddings, else the run's data.seq_len, else
    DEFAULT_MAX_LENGTH)."""
    from shard.data.tokenizers import ByteTokenizer
    from shard.run.inference import load_model
    from shard.run.tokenizer import tokenizer_folder
    from shard.training.harness import ShardLM  # lm-eval, or a one-line error
    from shard.training.scoring import Scorer

    loaded = load_model(weights_path, cfg, mesh_spec, devices)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ShardError(f"{weights_path} has a {loaded.model.vocab_size}-token vocabulary and no tokenizer goes "
                         "with it (none in its run dir's tokenizer/ or hf/ folder): benchmark tasks are text")
    if isinstance(tokenizer, ByteTokenizer) and tokenizer_folder(weights_path) is None:
        notice(f"{weights_path} names no tokenizer: reading the tasks' text as bytes (its vocabulary is 256)")
    if max_length is None:
        max_length = _context(weights_path)
    scorer = Scorer(loaded.spec, loaded.layout, loaded.params, batch, loaded.router_bias)
    return ShardLM(scorer, tokenizer, max_length)


def _context(weights_path) -> int:
    from shard.run import weights
    from shard.run.hf_config import read_json
    from shard.run.hf_side import side_files_of

    side = side_files_of(weights_path)
    limit = read_json(side / "config.json").get("max_position_embeddings") if side and (
        side / "config.json").is_file() else None
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    saved = weights.saved_run_config(weights_path)
    return saved.data.seq_len if saved is not None else DEFAULT_MAX_LENGTH
