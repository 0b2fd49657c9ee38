"""A tokenizer's chat template compiled before any rank starts.

``transformers`` compiles the chat template only when a sample is first rendered: a
syntax error in it surfaced after launch, as a ``jinja2`` message naming no file with a
traceback in every rank. :func:`check_chat_template` compiles it up front in ``jinja2``'s
sandbox (the environment ``transformers`` renders in; compiling runs nothing) and reports
a syntax error in one line naming the file that holds the template and the line.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
"""Where a tokenizer folder may keep its chat template, in ``transformers``' order."""


def template_source(folder: Path, given: bool) -> str:
    """The file a tokenizer's template came from, for messages.

    Args:
        folder: the tokenizer folder.
        given: the template was passed in code, not read from the folder.
    """
    if given:
        return f"the chat_template given for {folder}"
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            return str(folder / name)
    return str(folder)


def check_chat_template(template: str, folder: Path, given: bool = False) -> None:
    """Compile a chat template; a syntax error is one line naming its file.

    Args:
        template: the Jinja source.
        folder: the tokenizer folder (``data.tokenizer``).
        given: the template was passed in code (it replaces the folder's own).

    Raises:
        ValueError: ``<file>: the chat template does not compile: <error> (line N)``.
    """
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The extension transformers enables for its templates ({% generation %} blocks)
    # is not needed to parse them, but unknown tags would be errors: allow loopcontrols
    # and declare transformers' generation tags as no-op.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _generation_extension()])
    try:
        env.parse(template)
    except TemplateSyntaxError as exc:
        line = f" (line {exc.lineno} of the template)" if exc.lineno else ""
        raise ValueError(f"{template_source(folder, given)}: the chat template does not "
                         f"compile: {exc.message}{line}") from None


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
