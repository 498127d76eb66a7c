"""`python -m miles.node recipe.toml [--set k=v ...]`: this node's daemon, as `miles run` starts it."""

import sys

from miles.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
