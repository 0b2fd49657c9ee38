"""A tokenizer's chat template compiled before any rank starts.

``transformers`` compiles the chat template only when a sample is first rendered: a
syntax error in it surfaced after launch, as a ``jinja2`` message naming no file with a
traceback in every rank. :func:`check_chat_template` compiles it up front in ``jinja2``'s
sandbox (the environment ``transformers`` renders in; compiling runs nothing) and reports
a syntax error in one line naming the file that holds the template and the line.

**A template that never finishes.** Compiling runs nothing, and ``jinja2``'s sandbox
bounds one ``range`` (100 000 items) but not loops nested in one another: a template
looping 10^10 times hung the launcher's data check with no word. :func:`check_template_renders`
renders the template once on a short conversation (a user turn and an assistant
reply) in the same sandbox with every ``for`` loop (and every call of a recursive
loop) counted: past :data:`RENDER_LOOP_LIMIT` iterations in all, the tokenizer is
refused in one line naming its folder. The bound counts iterations, not seconds, so the
verdict is the same on every machine. Any other error of that render is left to the
samples' own renders, which name the sample (a template may refuse a conversation).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
"""Where a tokenizer folder may keep its chat template, in ``transformers``' order."""


def template_source(folder: Path, given: bool | str) -> str:
    """The file a tokenizer's template came from, for messages.

    Args:
        folder: the tokenizer folder.
        given: the template was passed in code, not read from the folder; a string
            names where it came from (``data.chat_template='my.jinja'``).
    """
    if isinstance(given, str) and given:
        return given
    if given:
        return f"the chat_template given for {folder}"
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            return str(folder / name)
    return str(folder)


def check_chat_template(template: str, folder: Path, given: bool | str = False) -> None:
    """Compile a chat template; a syntax error is one line naming its file.

    Args:
        template: the Jinja source.
        folder: the tokenizer folder (``data.tokenizer``).
        given: the template was passed in code (it replaces the folder's own); a string
            names where it came from.

    Raises:
        ValueError: ``<file>: the chat template does not compile: <error> (line N)``.
    """
    from jinja2 import TemplateSyntaxError

    env = _environment()
    try:
        env.parse(template)
    except TemplateSyntaxError as exc:
        line = f" (line {exc.lineno} of the template)" if exc.lineno else ""
        raise ValueError(f"{template_source(folder, given)}: the chat template does not "
                         f"compile: {exc.message}{line}") from None


RENDER_LOOP_LIMIT = 100_000
"""Loop iterations the probe rendering of :func:`check_template_renders` may take."""
_GUARD = "mimotron_loop_guard"  # the global every loop's iterable is passed through
_PROBE = ({"role": "user", "content": "<image> what is in this picture"},
          {"role": "assistant", "content": "a cat sits on a mat"})  # fmt: skip


class _LoopLimit(Exception):
    """The probe rendering went past :data:`RENDER_LOOP_LIMIT` iterations."""


class _LoopBudget:
    """Passes a loop's items through, raising once the render's budget is spent."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def __call__(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.left -= 1
            if self.left < 0:
                raise _LoopLimit
            yield item


def check_template_renders(template: str, folder: Path, given: bool | str = False,
                           variables: Mapping[str, Any] | None = None) -> None:  # fmt: skip
    """Render a chat template once on a two-message conversation, loops counted.

    Args:
        template: the Jinja source (compiled already: :func:`check_chat_template`).
        folder: the tokenizer folder (``data.tokenizer``).
        given: the template was passed in code (it replaces the folder's own); a string
            names where it came from.
        variables: what ``transformers`` passes besides the messages (the special tokens).

    Raises:
        ValueError: the render took more than :data:`RENDER_LOOP_LIMIT` loop iterations.
    """
    from jinja2 import nodes

    env = _environment()
    tree = env.parse(template)

    def guarded(node: nodes.Expr) -> nodes.Expr:
        return nodes.Call(nodes.Name(_GUARD, "load"), [node], [], None, None)

    for loop in list(tree.find_all(nodes.For)):
        loop.iter = guarded(loop.iter)
        if loop.recursive:  # loop(items) runs the body again on items: counted too
            for call in _recursive_calls(loop):
                call.args[0] = guarded(call.args[0])
    env.globals[_GUARD] = _LoopBudget(RENDER_LOOP_LIMIT)
    try:
        env.from_string(tree).render(messages=list(_PROBE), tools=None, documents=None,
                                     add_generation_prompt=False, **dict(variables or {}))
    except _LoopLimit:
        raise ValueError(f"data.tokenizer={str(folder)!r}: the chat template "
                         f"({template_source(folder, given)}) did not finish rendering a "
                         f"two-message conversation within {RENDER_LOOP_LIMIT} loop "
                         "iterations: it loops (almost) for ever; fix its loops") from None
    except Exception:  # noqa: BLE001, S110 - the samples' renders report other errors
        pass


def _recursive_calls(loop: Any) -> list[Any]:
    """The ``loop(items)`` calls with an argument inside a recursive ``for``'s body."""
    from jinja2 import nodes

    return [call for node in loop.body for call in node.find_all(nodes.Call)
            if isinstance(call.node, nodes.Name) and call.node.name == "loop" and call.args]


def _environment() -> Any:
    """``transformers``' sandbox for chat templates, with its globals."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(format: str) -> str:  # noqa: A002 - transformers' signature
        import datetime

        return datetime.datetime.now().strftime(format)

    # The extension transformers enables for its templates ({% generation %} blocks)
    # is not needed to parse them, but unknown tags would be errors: allow loopcontrols
    # and declare transformers' generation tags as no-op.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _generation_extension()])
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


def _generation_extension() -> type:
    """A ``{% generation %}...{% endgeneration %}`` tag, as ``transformers`` defines it."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):  # noqa: ANN001, ANN202 - jinja2's extension protocol
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation
