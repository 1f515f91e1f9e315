"""Where gpumem keeps and finds code it loads: the PyTorch libraries it
compiles (gpumem.torch) live in a cache directory, and loading one runs its
code as the user. So the cache is a directory of the user's alone, and a
library is loaded only from where no other user could have put or changed
it (docs/security.md):

- cache_dir(): $GPUMEM_CACHE_DIR, else $XDG_CACHE_HOME/gpumem or
  ~/.cache/gpumem, else <tmp>/gpumem-<uid>; created 0700, and on every use
  checked to be a directory owned by this user (or root) that nobody else
  can write, nor any directory above it (a sticky one, as /tmp, aside). One
  that fails is refused with a warning that names it and the next is tried;
  the last resort is a fresh private directory for this process alone. A
  name in /tmp is guessable: another user may have made it first and put a
  library in it.
- check_library(path): before a cached library is loaded: a regular file,
  not a link, owned by this user or root, writable by nobody else, in a
  directory that passes the same checks. UnsafePathError (an OSError) says
  why, naming the path.
"""

import atexit
import os
import shutil
import stat
import tempfile
import warnings


class UnsafePathError(OSError):
    """A directory or file gpumem would load code from, or write code to,
    that another user could have made or could change."""


def _owner_ok(uid):
    return uid == os.geteuid() or uid == 0


def _why_untrusted(path, st, strict):
    """Why path (lstat st) is not trusted, or None. strict: the path itself
    (a file, or the directory it is in); otherwise a directory above, where
    the sticky bit keeps others from renaming what is not theirs."""
    if stat.S_ISLNK(st.st_mode):
        return "%s is a symbolic link" % path
    if not _owner_ok(st.st_uid):
        return "%s belongs to uid %d, not to this user (uid %d) or root" % (path, st.st_uid, os.geteuid())
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and (strict or not st.st_mode & stat.S_ISVTX):
        return "other users can write %s (mode %04o)" % (path, stat.S_IMODE(st.st_mode))
    return None


def _check_chain(path, strict_levels):
    """Checks path (resolved, absolute) and every directory above it; the
    last strict_levels components (path itself, its directory...) may not be
    writable by others even when sticky."""
    parts = []
    p = path
    while True:
        parts.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for i, p in enumerate(parts):  # from path up to "/"
        try:
            st = os.lstat(p)
        except OSError as e:
            raise UnsafePathError("cannot check %s: %s" % (p, e.strerror or e)) from None
        why = _why_untrusted(p, st, i < strict_levels)
        if why:
            raise UnsafePathError("refusing %s: %s" % (path, why))


def private_dir(path):
    """path as a directory of this user's alone: made 0700 when missing,
    then checked (every call). Returns its resolved path. UnsafePathError
    when it fails a check; OSError when it cannot be made."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafePathError("cannot check %s: %s" % (path, e.strerror or e)) from None
    if stat.S_ISLNK(st.st_mode) and not _owner_ok(st.st_uid):
        raise UnsafePathError("refusing %s: a symbolic link of uid %d" % (path, st.st_uid))
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise UnsafePathError("refusing %s: not a directory" % path)
    _check_chain(real, 1)
    if not os.access(real, os.W_OK | os.X_OK):
        raise OSError("cannot write %s" % real)
    return real


_fresh = None


def _fresh_dir():
    """A new private directory for this process (mkdtemp: 0700, a name
    nobody could have guessed), removed at exit."""
    global _fresh
    if _fresh is None or not os.path.isdir(_fresh):
        _fresh = tempfile.mkdtemp(prefix="gpumem-%d-" % os.getuid())
        atexit.register(shutil.rmtree, _fresh, True)
    return _fresh


def cache_dir():
    """The directory for compiled libraries (see the module's text)."""
    candidates = []
    env = os.environ.get("GPUMEM_CACHE_DIR")
    if env:
        candidates.append(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        candidates.append(os.path.join(xdg, "gpumem"))
    candidates.append(os.path.join(tempfile.gettempdir(), "gpumem-%d" % os.getuid()))
    for path in candidates:
        try:
            return private_dir(path)
        except UnsafePathError as e:
            warnings.warn("gpumem: not using the cache directory %s: %s" % (path, e), RuntimeWarning,
                          stacklevel=3)
        except OSError:
            pass  # cannot be made (no home): the next one
    return _fresh_dir()


def check_library(path):
    """Raises UnsafePathError unless the library at path may be loaded:
    a regular file owned by this user or root that nobody else can write,
    in a directory likewise, below directories likewise."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafePathError("cannot check %s: %s" % (path, e.strerror or e)) from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError("refusing to load %s: it is a symbolic link" % path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError("refusing to load %s: not a regular file" % path)
    try:
        _check_chain(os.path.realpath(path), 2)
    except UnsafePathError as e:
        raise UnsafePathError("refusing to load %s: %s" % (path, str(e).split(": ", 1)[-1])) from None
