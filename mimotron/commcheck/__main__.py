"""``python -m mimotron.commcheck FOLDER``: replay a run's traces under NCCL's rules."""

from __future__ import annotations

import sys

from mimotron.commcheck.replay import replay_folder


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mimotron.commcheck FOLDER (the rank*.json traces of one run)")
        return 2
    report = replay_folder(args[0])
    print(f"{report.num_ops} operations replayed: {report.text}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
