"""Many processes as one job: launch detection (`launch`), joining and leaving the job with its watchdog
(`runtime`), named process sets (`process_sets`); the coordinator, exchanges and the MPI bridge beside them."""

from shard._api import lazy_api

__getattr__, __dir__, __all__ = lazy_api("shard.cluster", {}, modules=("launch", "process_sets", "runtime"))
