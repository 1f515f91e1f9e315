"""The build backend of the gpumem Python package (PEP 517), standard library only.

pyproject.toml at the repository root names this module (backend-path
python/backend), so `pip install <checkout>` and `pip wheel <checkout>` need
nothing from a package index, with or without build isolation: the backend
compiles libgpumem.so and the `gpumem` command line with the project's
CMake (targets gpumem and gpumem_cli of a Release build in a temporary
directory) and writes the wheel, a zip file, itself:

    gpumem/*.py, gpumem/_bootstrap/   the package (python/gpumem)
    gpumem/csrc/*.cpp                 C++ compiled against the installed torch at first use
    gpumem/predict/profiles/*.json    device profiles of the CPU recorder (gpumem.predict)
    gpumem/libgpumem.so               the library the package loads first
    gpumem/bin/gpumem                 the command line; the `gpumem` console
                                      script (gpumem._cli:main) runs it
    gpumem-VERSION.dist-info/         METADATA, WHEEL, entry_points.txt, RECORD

The wheel is tagged py3-none-<platform>: the package is pure Python over
ctypes, so any Python 3 of that platform can load the library.

An editable install (pip install -e) builds into the checkout's build/ (as
`make build` does) and installs a .pth file naming python/, so the package
runs from the checkout and finds build/libgpumem.so there.

GPUMEM_CMAKE_ARGS (split like a shell would) adds CMake arguments, e.g.
-DGPUMEM_CUDA_INCLUDE=/usr/local/cuda/include.
"""

import base64
import hashlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIR = os.path.join(ROOT, "python", "gpumem")
NAME = "gpumem"
SUMMARY = "A caching GPU memory allocator (C, over ctypes) with PyTorch and CuPy integration"
# Zip entries get this date, so that one source builds byte-identical wheels.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class BuildError(RuntimeError):
    pass


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def version():
    """CMakeLists.txt's project version, after checking that the package
    and the C header say the same."""
    cmakelists = _read(os.path.join(ROOT, "CMakeLists.txt"))
    cmake = re.search(r"project\(gpumem VERSION (\d+)\.(\d+)\.(\d+)", cmakelists)
    if not cmake:
        raise BuildError("gpumem build: no 'project(gpumem VERSION x.y.z' in CMakeLists.txt")
    text = ".".join(cmake.groups())
    py = re.search(r'^VERSION = "([^"]+)"', _read(os.path.join(PACKAGE_DIR, "_lib.py")), re.M)
    header = _read(os.path.join(ROOT, "include", "gpumem.h"))
    major = re.search(r"#define GPUMEM_VERSION_MAJOR (\d+)", header)
    minor = re.search(r"#define GPUMEM_VERSION_MINOR (\d+)", header)
    if not py or py.group(1) != text:
        raise BuildError(
            "gpumem build: python/gpumem/_lib.py's VERSION (%s) differs from CMakeLists.txt's %s"
            % (py.group(1) if py else "missing", text)
        )
    if not (major and minor) or (major.group(1), minor.group(1)) != cmake.groups()[:2]:
        raise BuildError(
            "gpumem build: include/gpumem.h's GPUMEM_VERSION_MAJOR/MINOR differ from CMakeLists.txt's %s" % text
        )
    return text


def _platform_tag():
    return re.sub(r"[^A-Za-z0-9]", "_", sysconfig.get_platform())


def _wheel_name():
    return "%s-%s-py3-none-%s.whl" % (NAME, version(), _platform_tag())


def _dist_info():
    return "%s-%s.dist-info" % (NAME, version())


def _metadata():
    return (
        "Metadata-Version: 2.1\n"
        "Name: %s\n"
        "Version: %s\n"
        "Summary: %s\n"
        "License: see the gpumem repository\n"
        "Requires-Python: >=3.8\n"
        "Classifier: Programming Language :: Python :: 3\n"
        "Classifier: Programming Language :: C\n"
        "Classifier: Operating System :: POSIX :: Linux\n"
        "Provides-Extra: torch\n"
        'Requires-Dist: torch>=2.1; extra == "torch"\n'
        "Provides-Extra: cupy\n"
        'Requires-Dist: cupy; extra == "cupy"\n'
        "Description-Content-Type: text/plain\n"
        "\n"
        "gpumem: a caching GPU memory allocator in C with PyTorch's vocabulary, "
        "used from Python over ctypes.\n"
        "Enable it for an unedited PyTorch program: python -m gpumem.torch script.py\n"
        "See README.md and docs/python.md in the gpumem repository.\n" % (NAME, version(), SUMMARY)
    )


def _wheel_file():
    return "Wheel-Version: 1.0\nGenerator: gpumem_build\nRoot-Is-Purelib: false\nTag: py3-none-%s\n" % _platform_tag()


_ENTRY_POINTS = "[console_scripts]\ngpumem = gpumem._cli:main\n"


# ---- compiling ---------------------------------------------------------------


def _run(cmd, log):
    log.write("gpumem build: %s\n" % " ".join(shlex.quote(c) for c in cmd))
    log.flush()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(proc.stdout)
    log.flush()
    if proc.returncode != 0:
        raise BuildError(
            "gpumem build: %s failed (exit %d); its output is above. The C build needs a C11 "
            "compiler, CMake >= 3.16, make and zlib (apt-get install build-essential cmake zlib1g-dev)."
            % (cmd[0], proc.returncode)
        )


def compile_native(build_dir, log=None):
    """Builds libgpumem.so and the gpumem program into build_dir; returns
    their paths."""
    log = log or sys.stderr
    cmake = shutil.which("cmake")
    if not cmake:
        raise BuildError(
            "gpumem build: cmake not found on PATH. Building the package compiles the C library "
            "with CMake: apt-get install cmake build-essential zlib1g-dev (or pip install cmake), "
            "then retry."
        )
    extra = shlex.split(os.environ.get("GPUMEM_CMAKE_ARGS", ""))
    _run([cmake, "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release"] + extra, log)
    jobs = str(os.cpu_count() or 2)
    _run([cmake, "--build", build_dir, "--target", "gpumem", "gpumem_cli", "-j", jobs], log)
    lib, exe = os.path.join(build_dir, "libgpumem.so"), os.path.join(build_dir, "gpumem")
    for path in (lib, exe):
        if not os.path.isfile(path):
            raise BuildError("gpumem build: the C build finished without %s" % path)
    return lib, exe


# ---- the wheel ---------------------------------------------------------------


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def _package_files():
    """(arcname, path) of the package's Python sources, the C++ it
    compiles against the installed torch (csrc/) and the JSON data files
    (the recorder's device profiles), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(PACKAGE_DIR):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and d != "bin")
        for f in sorted(filenames):
            if f.endswith((".py", ".cpp", ".json")):
                path = os.path.join(dirpath, f)
                out.append((NAME + "/" + os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/"), path))
    return out


def _write_wheel(wheel_directory, files):
    """files: (arcname, bytes, executable). Adds the dist-info and RECORD."""
    dist = _dist_info()
    files = list(files) + [
        (dist + "/METADATA", _metadata().encode(), False),
        (dist + "/WHEEL", _wheel_file().encode(), False),
        (dist + "/entry_points.txt", _ENTRY_POINTS.encode(), False),
        (dist + "/top_level.txt", (NAME + "\n").encode(), False),
    ]
    name = _wheel_name()
    path = os.path.join(wheel_directory, name)
    tmp = path + ".part"
    record = []
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for arcname, data, executable in files:
            info = zipfile.ZipInfo(arcname, date_time=_ZIP_DATE)
            info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
            record.append(_record_line(arcname, data))
        record.append(dist + "/RECORD,,")
        info = zipfile.ZipInfo(dist + "/RECORD", date_time=_ZIP_DATE)
        info.external_attr = (0o644 | 0o100000) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        zf.writestr(info, ("\n".join(record) + "\n").encode())
    os.replace(tmp, path)
    return name


def _file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# ---- PEP 517 hooks -------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version()  # the version checks fail fast, before compiling
    build_dir = tempfile.mkdtemp(prefix="gpumem-build-")
    try:
        lib, exe = compile_native(build_dir)
        files = [(arc, _file_bytes(p), False) for arc, p in _package_files()]
        files.append((NAME + "/libgpumem.so", _file_bytes(lib), True))
        files.append((NAME + "/bin/gpumem", _file_bytes(exe), True))
        return _write_wheel(wheel_directory, files)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    version()
    compile_native(os.path.join(ROOT, "build"))
    pth = (os.path.join(ROOT, "python") + "\n").encode()
    return _write_wheel(wheel_directory, [("_gpumem_editable.pth", pth, False)])


def _sdist_members():
    """The checkout's files as a clean clone has them: git's list when this
    is a git checkout, else every file outside build directories."""
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n and os.path.isfile(os.path.join(ROOT, n))]
        if names:
            return sorted(names)
    except (OSError, subprocess.CalledProcessError):
        pass
    names = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        dirnames[:] = [
            d for d in dirnames
            if not (rel == "." and (d == "build" or d.startswith("build-") or d.startswith(".")))
            and d != "__pycache__"
        ]
        names.extend(os.path.normpath(os.path.join(rel, f)) for f in filenames if not f.endswith(".pyc"))
    return sorted(names)


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (NAME, version())
    name = base + ".tar.gz"
    path = os.path.join(sdist_directory, name)
    with tarfile.open(path + ".part", "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in _sdist_members():
            tar.add(os.path.join(ROOT, rel), arcname=base + "/" + rel, recursive=False)
        data = _metadata().encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    os.replace(path + ".part", path)
    return name
