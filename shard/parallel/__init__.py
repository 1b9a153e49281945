"""What needs hand-written SPMD code: pipeline schedules, ring attention, the ragged all-to-all of dropless
expert parallelism (capacity-routed MoE dispatch is declarative)."""
