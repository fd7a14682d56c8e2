"""`python -m restopo`, and the `restopo` console script (run): restopo.cli.main(), ended
through restopo.worker.exit_with (under torchrun, an exit past torch's teardown)."""
import sys

from .worker import exit_with, speaks_for_all


def cli() -> int:
    """main()'s exit status; a Ctrl-C while the CLI imports, before main takes Ctrl-C, said
    as the stop it is, not as a KeyboardInterrupt's traceback."""
    try:
        from .cli import main
    except KeyboardInterrupt:
        if speaks_for_all():
            print("restopo: interrupted", file=sys.stderr)
        return 130
    return main()


def run() -> None:
    exit_with(cli())


if __name__ == "__main__":
    exit_with(cli())
