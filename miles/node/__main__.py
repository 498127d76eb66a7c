"""`python -m miles.node recipe.toml [--set k=v ...]`: this node's daemon, as `miles run` starts it."""

import sys

def main(argv: list[str] | None = None) -> int:
    from miles.cli import main as cli_main
    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
