"""``python -m switchyard``: the ``switchyard`` command (:func:`switchyard.cli.main`), for an environment whose
scripts folder is not on ``PATH``."""

from switchyard.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
