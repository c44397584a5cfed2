"""``carbonforge-runtime fetch KEY...`` (or ``--model REPO[@REVISION]``, ``--to DIR``)."""

from __future__ import annotations

import os
import sys

import typer

from carbonforge_runtime.cli.errors import run_guarded

FETCH_EPILOG = (
    "Air-gapped hosts: on a machine that reaches the hub, run `carbonforge-runtime fetch KEY --to DIR` "
    "(HF_TOKEN in the environment for a gated model); carry DIR to the host; serve with HF_HUB_OFFLINE=1 "
    "and HUGGINGFACE_HUB_CACHE pointing at DIR (the last line printed is the docker run command). "
    "Running fetch again downloads only what is missing. Every file is compared with the hub's listing "
    "(sha256 or Git blob id) and the commit with each file's sha256 is recorded in "
    "models--ORG--NAME/carbonforge-locks/COMMIT.json, which serving checks at every start. With "
    "HF_HUB_OFFLINE set, fetch downloads nothing, checks that the cache holds every file and hashes "
    "each against that lock."
)


def fetch_command(
    keys: list[str] = typer.Argument(None, metavar="KEY", show_default=False,
                                     help="Context keys whose recipes' weights to fetch (default: CF_CONTEXT_KEY)."),
    model: str | None = typer.Option(None, "--model", metavar="REPO[@REVISION]",
                                     help="Fetch this Hugging Face repository instead (for the full override)."),
    to: str | None = typer.Option(None, "--to", metavar="DIR",
                                  help="Fill this directory (a hub cache to carry to another host) instead of the "
                                  "cache the engine reads (HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE or HF_HOME/hub)."),
) -> None:
    """Download the files a recipe's engine reads (weights, config, tokenizer, chat template) into the hub cache.

    The recipe's revision (main when it pins none) is fetched with Hugging Face's own download code (resumed when a
    transfer breaks; HF_TOKEN and HF_ENDPOINT from the environment). A premium recipe needs a licence,
    as for serving. Ends with the docker run line that serves the result offline.
    """
    from carbonforge_runtime.runtime.fetch import fetch
    from carbonforge_runtime.settings import load_settings

    def run() -> None:
        fetch(keys or [], model, to, load_settings(os.environ), os.environ,
              say=lambda line: typer.echo(line), terminal=sys.stderr.isatty())

    run_guarded(run)
