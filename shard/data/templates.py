"""Chat templates rendered within bounds. A template is code that comes with a tokenizer's files; transformers'
sandboxed Jinja environment keeps it from the machine's files and Python's insides, but not from its memory
or time (`{{ 'x' * 10**9 }}` took 15 GB, loops nested over `range(10**5)` ran for hours). So a rendering
here may output at most RENDER_CHARS characters, may build no text or list longer than that with `*`,
`+` or `~` (nor an integer of more than MAX_INT_BITS bits with `**`), and may take at most
RENDER_SECONDS: a timer interrupts it, where it runs on the main thread (shard's commands do; elsewhere
the size bounds alone hold). The environment is transformers' own (its filters, globals and sandbox),
overlaid with the operators intercepted. Filters that build text (`center`, `indent`, `format` ...) are
bounded by the output count and the timer only."""

import contextlib
import functools
import signal
import threading
import types

RENDER_CHARS = 1 << 24  # 16,777,216 characters: a conversation far longer than any --seq trains on
RENDER_SECONDS = 10.0  # per rendering; a conversation's renders in milliseconds
MAX_INT_BITS = 1 << 16
_SIZED = (str, list, tuple)


class TemplateBound(Exception):
    """A rendering went past one of its bounds; the message says which, as the end of a sentence that
    starts with "the chat template"."""


def render(template: str, **context) -> str:
    """The template rendered with `context` (messages, add_generation_prompt, the special tokens ...),
    within the bounds; TemplateBound past one of them."""
    out, size, compiled = [], 0, _compiled(template)  # compiled before the timer starts (once a template)
    with _time_bound(RENDER_SECONDS):
        for piece in compiled.generate(**context):
            size += len(piece)
            if size > RENDER_CHARS:
                raise TemplateBound(f"output more than {RENDER_CHARS:,} characters, its bound")
            out.append(piece)
    return "".join(out)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    compiled = _environment().from_string(template)
    names = compiled.root_render_func.__globals__  # the compiled template's module: `~` calls its str_join
    for name in ("str_join", "markup_join"):
        names[name] = _bounded_join(names[name], "'~'")
    return compiled


@functools.lru_cache(maxsize=1)
def _environment():
    # here: transformers is the hf extra's, and takes over half a second to import
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # transformers' environment (a private name: its tests fail here first if it moves), without a template cache
    # of its own (_compiled is the cache, and bounds each template's joins once)
    env = _compile_jinja_template("").environment.overlay(cache_size=0)
    env.intercepted_binops = frozenset({"*", "+", "**"})
    env.call_binop = types.MethodType(_bounded_binop, env)
    env.concat = _bounded_join(env.concat, "a block")  # {% set x %}...{% endset %}, a macro's output
    return env


def _bounded_join(join, what: str):
    """`join` (Jinja's, of the pieces of a text), refused once the text passes RENDER_CHARS: a text doubled
    with `~` in a loop stops at twice the bound, not at the machine's memory."""
    def bounded(pieces):
        text = join(pieces)
        if len(text) > RENDER_CHARS:
            raise TemplateBound(f"built a text of {len(text):,} characters with {what}, past its bound of "
                                f"{RENDER_CHARS:,}")
        return text
    return bounded


def _bounded_binop(env, context, operator: str, left, right):
    """`*`, `+` and `**` as Jinja computes them, refused where the result would pass the bounds."""
    if operator == "**":
        if _whole(left) and _whole(right) and right > 0 and abs(left) > 1 and \
                right * abs(left).bit_length() > MAX_INT_BITS:
            raise TemplateBound(f"computed {left} ** {right}, past its bound of {MAX_INT_BITS:,} bits")
    else:
        size = _length(operator, left, right)
        if size > RENDER_CHARS:
            raise TemplateBound(f"built a {type(left).__name__} of {size:,} items with {operator!r}, past its "
                                f"bound of {RENDER_CHARS:,}")
    return env.binop_table[operator](left, right)


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _length(operator: str, left, right) -> int:
    """The length of `left operator right` where it is a text or a list (0 otherwise)."""
    if operator == "+":
        return len(left) + len(right) if isinstance(left, _SIZED) and isinstance(right, _SIZED) else 0
    if isinstance(left, _SIZED) and _whole(right):
        return len(left) * right
    if isinstance(right, _SIZED) and _whole(left):
        return len(right) * left
    return 0


@contextlib.contextmanager
def _time_bound(seconds: float):
    """A TemplateBound raised into the block after `seconds` (SIGALRM; the main thread only, where Python
    runs signal handlers). A timer set before (another bound's) is set again afterwards, less the time
    spent here."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TemplateBound(f"took more than {seconds:g} s, its bound")

    previous = signal.signal(signal.SIGALRM, expire)
    earlier, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier:
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (seconds - left), 1e-3))
