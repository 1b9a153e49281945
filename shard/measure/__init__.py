"""Measuring and planning layouts: the cost model (`costs`, `memory`: pure formulas), compiled-step
analysis (`analyze`), every parameter's layout (`inspection`), the planner, benchmarks and profiling."""

from shard._api import lazy_api

__getattr__, __dir__, __all__ = lazy_api("shard.measure", {
    "analyze": "shard.measure.analysis", "inspect_config": "shard.measure.inspection",
}, modules=("costs", "memory", "inspection", "profiling"))
