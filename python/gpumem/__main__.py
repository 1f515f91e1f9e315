"""python -m gpumem ARGS: the `gpumem` command line program shipped in the
package (gpumem/bin/gpumem, or build/gpumem in a source checkout), run with
ARGS, as the `gpumem` command pip installs runs it.

`python -m gpumem --version` prints the program's version; a program that
does not know the option (or none at all) leaves the answer to the
package, which is the same version: the library and the program are built
together."""

import subprocess
import sys

from . import _cli
from ._lib import VERSION


def _version():
    path = _cli.find()
    if path is not None:
        try:
            done = subprocess.run(
                [path, "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=30
            )
            if done.returncode == 0 and done.stdout.strip():
                sys.stdout.write(done.stdout.decode("utf-8", "replace"))
                return 0
        except (OSError, subprocess.SubprocessError):
            pass
    print("gpumem %s" % VERSION)
    return 0


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        return _version()
    return _cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
