"""Measuring and planning layouts: the cost model, the HLO reader, compiled-step analysis, the planner, benchmarks, inspection and profiling."""
