"""``--help`` stands alone: every demo flag described with its default, no internal design
file cited, no reStructuredText markup in what users read."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import paramserver
from paramserver.cli.demos.digits_demo import compression_note
from paramserver.cli.main import LONG_RUNNING, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["demo", "torch-demo", "worker"])
def test_every_flag_has_a_description_naming_its_default(command: str) -> None:
    for action in _subparsers()[command]._actions:
        if isinstance(action, argparse._HelpAction) or action.dest in ("log_format",):
            continue
        assert action.help, f"{command} {action.option_strings} has no description"
        default = action.default
        if action.required or default in (None, False, argparse.SUPPRESS):
            continue
        shown = (
            ",".join(default)
            if isinstance(default, list)
            else f"{default:g}"
            if isinstance(default, float)
            else str(default)
        )
        assert re.search(rf"default:? {re.escape(shown)}\b", action.help), (
            f"{command} {action.option_strings}: default {shown} not in {action.help!r}"
        )


def test_torch_demo_offers_no_framework_flag() -> None:
    flags = {s for a in _subparsers()["torch-demo"]._actions for s in a.option_strings}
    assert "--framework" not in flags
    assert "--framework" in {s for a in _subparsers()["demo"]._actions for s in a.option_strings}


def test_no_help_or_docstring_cites_an_internal_design_file() -> None:
    root = Path(paramserver.__file__).parent
    hits = [
        f"{p.relative_to(root)}:{n}"
        for p in root.rglob("*.py")
        if "_pb2" not in p.name
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"DESIGN|STYLE\.md|cases/", line)
    ]
    assert hits == []
    texts = [build_parser().format_help()] + [p.format_help() for p in _subparsers().values()]
    for text in texts:
        assert "DESIGN" not in text


def test_the_top_level_description_is_plain_text() -> None:
    text = build_parser().description or ""
    assert text and not re.search(r"``|:class:|:func:|:mod:|:meth:", text)


def test_the_demo_says_when_compression_is_on() -> None:
    assert compression_note("none", 0.1) == ""
    assert compression_note("topk", 0.1) == ", compression topk (0.1 of entries, error feedback)"
    assert "compression fp16" in compression_note("fp16", 0.1)


def test_long_running_commands_take_the_log_flags_after_their_name_too() -> None:
    for name, sub in _subparsers().items():
        flags = {s for a in sub._actions for s in a.option_strings}
        if name in LONG_RUNNING:
            assert {"--log-level", "--log-format"} <= flags, name
    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "DEBUG", "serve"]).log_level == "DEBUG"
    assert parser.parse_args(["serve"]).log_level == "INFO"
    # after the subcommand wins over before it
    both = parser.parse_args(["--log-level", "DEBUG", "serve", "--log-level", "ERROR"])
    assert both.log_level == "ERROR"
