"""What needs hand-written SPMD code: pipeline schedules, ring attention (MoE dispatch is declarative)."""
