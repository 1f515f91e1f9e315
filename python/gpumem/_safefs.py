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

Every file the Python side writes (the prediction command's recordings and
meta files, a Recording written to a path, a measured device profile) goes
through write_file(), with the rules of the C side's output files
(src/outfile.c): the data goes to a new file made beside the target with
O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, then renamed over the target, so
nothing that exists is ever opened for writing, followed or truncated.
What sits at the target first must be absent or a regular file of this
user's with one link that others cannot write; the directory must not be
writable by others, or be sticky and belong to this user or root (the
owner of a sticky directory may rename what others put there). The
directories gpumem makes for its own files (private_dir) are this user's
or root's and writable by nobody else, as is every directory above them
but sticky ones of this user or root; read_own() reads back only a
regular file of this user's with one link, not through a link.
"""

import atexit
import errno
import os
import secrets
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
        return "%s belongs to uid %d%s, not to this user (uid %d) or root" % (path, st.st_uid, _user_name(st.st_uid),
                                                                             os.geteuid())
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


def _user_name(uid):
    try:
        import pwd

        return " (%s)" % pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return ""


def _why_not_replaceable(dir_fd, name):
    """Why the name in dir_fd may not be replaced by a file of ours, or
    None (also when nothing is there)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return "cannot look at it: %s" % (e.strerror or e)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link, and gpumem never writes through one; remove it or choose a path in a " \
               "directory of your own"
    if not stat.S_ISREG(st.st_mode):
        return "it exists and is not a regular file"
    if st.st_uid != os.geteuid():
        return "it belongs to uid %d%s, not to this user (uid %d); its owner or root can remove it, or choose " \
               "a path in a directory of your own" % (st.st_uid, _user_name(st.st_uid), os.geteuid())
    if st.st_nlink != 1:
        return "it has %d hard links (another name of the same file); remove it first" % st.st_nlink
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "other users can write it (mode %04o); remove it first" % stat.S_IMODE(st.st_mode)
    return None


def _why_dir_unsafe(st):
    """Why files in a directory (fstat st) could be swapped by another
    user after they are written, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return "its directory can be written by every user and is not sticky (mode %04o): anyone could " \
               "replace the file" % mode
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP) and not _owner_ok(st.st_uid):
        return "its directory belongs to uid %d%s and others can write it (mode %04o): its owner could " \
               "replace the file" % (st.st_uid, _user_name(st.st_uid), mode)
    return None


def write_file(path, data, mode=0o600):
    """Writes data (bytes or str) to path as src/outfile.c does (see the
    module's text); returns path. UnsafePathError names the path and why
    it was refused; OSError when it cannot be written."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    path = os.fspath(path)
    directory, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise UnsafePathError("cannot write %s: it does not name a file" % path)
    dir_fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    tmp = None
    try:
        why = _why_dir_unsafe(os.fstat(dir_fd)) or _why_not_replaceable(dir_fd, name)
        if why:
            raise UnsafePathError("refusing to write %s: %s" % (path, why))
        fd = -1
        for _ in range(100):
            tmp = ".%s.%s" % (name[:200], secrets.token_hex(6))
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dir_fd)  # fmt: skip
                break
            except FileExistsError:
                tmp = None
        if fd < 0:
            raise OSError(errno.EEXIST, "cannot make a new file beside %s" % path)
        with os.fdopen(fd, "wb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise UnsafePathError("cannot write %s: the new file beside it is not as made" % path)
            if mode != 0o600:
                os.fchmod(f.fileno(), mode)
            f.write(data)
        # checked again: a name planted while the file was written is refused too
        why = _why_not_replaceable(dir_fd, name)
        if why:
            raise UnsafePathError("refusing to write %s: %s" % (path, why))
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        tmp = None
        return path
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        os.close(dir_fd)


def read_own(path, limit=1 << 31):
    """The bytes of a file this user made: a regular file, not a link, of
    this user, with one link, at most limit bytes. UnsafePathError names
    the path otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError("refusing to read %s: it is a symbolic link" % path) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError("refusing to read %s: not a regular file" % path)
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise UnsafePathError("refusing to read %s: gpumem did not make it (uid %d%s, %d links)"
                                  % (path, st.st_uid, _user_name(st.st_uid), st.st_nlink))  # fmt: skip
        if st.st_size > limit:
            raise UnsafePathError("refusing to read %s: %d bytes, more than %d" % (path, st.st_size, limit))
        return f.read(limit + 1)[:limit]


def fresh_private_dir(prefix):
    """A new directory of this user's alone under the temporary directory
    (mkdtemp: 0700, a name nobody could have guessed), checked as
    private_dir checks; the caller removes it."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        return private_dir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
