"""What needs hand-written SPMD code: pipeline schedules, ring attention, dropless MoE routing per device
and its expert-parallel exchange, with the ragged all-to-all it moves tokens by (capacity-routed MoE
dispatch is declarative)."""
