"""``--help`` that shows each option's default once: after the help text, unless the text already states it.

One formatter for every ``privfl`` command that builds its own parser (``privfl train``, ``sweep``, ``demo``, ...,
``privfl attack audit``). An option's help text states its default itself, with the word "default", where the parser's
default is not what applies (``None`` standing for the method's own setting, say) or reads better written out (a list
as typed on the command line); the formatter then adds nothing.
"""

from __future__ import annotations

import argparse
import re

_STATES_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where there is none to show (``None``, an unset flag, an empty
    list) or the help text already states it (says "default")."""

    @staticmethod
    def shows(action: argparse.Action) -> bool:
        """Whether the formatter appends ``action``'s default to its help."""
        default = action.default     # by identity: 0 is a default to show, False (an unset flag) is not
        if not action.option_strings or any(default is v for v in (None, False, argparse.SUPPRESS)) \
                or default in ([], ()):
            return False
        return not _STATES_DEFAULT.search(action.help or "")

    def _get_help_string(self, action: argparse.Action) -> str:
        if not self.shows(action):
            return action.help or ""
        return (action.help + " " if action.help else "") + "(default: %(default)s)"


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` and each of its sub-commands' parsers formatting ``--help`` with :class:`DefaultsHelp`."""
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(dict.fromkeys(action.choices.values()))
    for each in parsers:
        each.formatter_class = DefaultsHelp
        for action in each._actions:   # argparse formats no help line for an option without help text
            if action.help is None and DefaultsHelp.shows(action):
                action.help = "(default: %(default)s)"
    return parser
