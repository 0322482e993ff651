"""Every flag of every ``agentrl`` subcommand says what it does (``--help`` is the flag reference)."""

from __future__ import annotations

import argparse

from agentrl import cli


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_flag_of_every_subcommand_has_help():
    missing = []
    for path, parser in _parsers(cli.build_parser()):
        parser.format_help()  # a stray % in a help text fails here
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and not (action.help or "").strip():
                missing.append(f"agentrl {' '.join(path)} {action.option_strings[0]}")
    assert not missing, "flags without help: " + ", ".join(missing)


def test_train_help_lists_the_algorithm_knobs():
    train = dict(_parsers(cli.build_parser()))[("train",)].format_help()
    for flag in ("--eps-clip", "--kl-loss-coef", "--use-tis", "--advantage-estimator", "--lr"):
        assert flag in train
