"""``python -m mimotron`` = the ``mimotron`` command."""

from mimotron.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
