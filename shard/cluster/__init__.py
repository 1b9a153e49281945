"""Many processes as one job: launch detection, the coordinator, joining, failing and the watchdog, exchanging values, process sets and preemption."""
