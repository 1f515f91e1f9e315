"""The `gpumem` command installed by pip: runs the C command line shipped
in the package (gpumem/bin/gpumem), or, in a source checkout, the one
`make build` made (build/gpumem)."""

import os
import sys

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def candidates():
    yield os.path.join(_PKG_DIR, "bin", "gpumem")
    yield os.path.join(os.path.dirname(os.path.dirname(_PKG_DIR)), "build", "gpumem")


def find():
    """The command line program's path, or None."""
    for path in candidates():
        if os.access(path, os.X_OK):
            return path
    return None


def main(argv=None):
    """Replaces this process with the command line program, given argv
    (default: this process's arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    tried = []
    for path in candidates():
        if os.access(path, os.X_OK):
            try:
                os.execv(path, [path] + args)
            except OSError as e:
                tried.append("  %s: %s" % (path, e))
        else:
            tried.append("  %s: no such executable" % path)
    sys.stderr.write(
        "gpumem: the command line program is missing; tried:\n%s\n"
        "Reinstall the package (pip install <gpumem checkout>) or run `make build` in the checkout.\n"
        % "\n".join(tried)
    )
    return 127


if __name__ == "__main__":
    sys.exit(main())
