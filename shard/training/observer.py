"""The loop's observers: console, metrics.jsonl, TensorBoard, profiler, checkpoints, signals. Each is an
`Observer` and overrides the hooks it needs; the rest do nothing. The loop itself prints and writes
nothing.

A method named like a hook (`on_*`) that is not one is an error when its class is made, so a misspelt
hook fails at once instead of never running.
"""


class Observer:
    """No-op hooks, called by `shard.training.loop.train` in this order: on_start, then per step on_step,
    saves_at, on_state, should_stop (and on_log for each logged record), then on_end or on_abort."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        unknown = sorted(n for n in vars(cls) if n.startswith("on_") and not hasattr(Observer, n))
        if unknown:
            hooks = ", ".join(n for n in vars(Observer) if n.startswith(("on_", "should_", "saves_")))
            raise TypeError(f"{cls.__name__}.{unknown[0]} is not an Observer hook (the hooks: {hooks})")

    def on_start(self, run) -> None:
        """Before the first step, with the prepared Run."""

    def on_step(self, step: int, outputs=None) -> None:
        """After each step: `outputs` is (state, metrics) as device values, not yet synced."""

    def saves_at(self, step: int, final: bool) -> bool:
        """Whether on_state will save at this step: the divergence guard then checks every step up to it
        first, so a diverged state is never saved."""
        return False

    def on_state(self, step: int, state: dict, position: int, metrics: dict, final: bool) -> None:
        """After each step, before the state is donated to the next one; `position` is the data stream's."""

    def should_stop(self) -> bool:
        """Asked after each step, and before each batch of an evaluation where every process evaluates:
        stop after the step (preemption, say)."""
        return False

    def on_log(self, record: dict) -> None:
        """Each logged record (step, loss, tokens/s, ...)."""

    def on_end(self, records: list[dict]) -> None:
        """The run ended as planned. Called in reverse order of on_start: the checkpoint saver has
        finished its last save before the console reports the run done."""

    def on_abort(self) -> None:
        """Instead of on_end, when the run or an on_end raised: let go of files and the display, report
        nothing."""
