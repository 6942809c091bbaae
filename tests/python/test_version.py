"""One version for the project: CMake's project VERSION (the top
CMakeLists.txt) is its only copy, and everything that states a version says
that one. Fails when any of these disagrees with it:
- pyproject.toml has no version of its own: the wheel's comes from that line
  through scikit-build-core's regex provider, run here on the file as the
  wheel build runs it (python.pip_install checks the installed wheel);
- ckpt.__version__ of the module in the build tree;
- the version ckptd's Status reports (ckptctl status);
- ckpt.pc in the build tree.

Run by ctest (PYTHONPATH=<build>/python); exits 77 (skipped) when the
module is not built.
"""

import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(TOP, "tests", "integration"))
import harness  # noqa: E402
from harness import check  # noqa: E402

try:
    import ckpt
except ImportError as e:  # pragma: no cover - reported as a skip
    print("skipping: %s" % e)
    sys.exit(77)


def cmake_version():
    with open(os.path.join(TOP, "CMakeLists.txt")) as f:
        found = re.findall(r"^project\(ckptd VERSION ([^ )]+)", f.read(), re.M)
    check(len(found) == 1, "CMakeLists.txt states one project VERSION: %s" % found)
    return found[0]


def wheel_version():
    """The version pyproject.toml gives the wheel."""
    import tomllib
    with open(os.path.join(TOP, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    project = meta["project"]
    check("version" not in project and "version" in project.get("dynamic", []),
          "pyproject.toml has no version of its own (project.dynamic names it)")
    settings = meta["tool"]["scikit-build"]["metadata"]["version"]
    check(settings.get("input") == "CMakeLists.txt",
          "the wheel's version is read from CMakeLists.txt: %s" % settings)
    provider = dict(settings)
    name = provider.pop("provider")
    check(name == "scikit_build_core.metadata.regex", "by the provider %s" % name)
    try:
        from scikit_build_core.metadata import regex
    except ImportError:
        # Without scikit-build-core: its regex, as it applies it.
        with open(os.path.join(TOP, settings["input"])) as f:
            return re.search(settings["regex"], f.read(), re.MULTILINE).group("value")
    cwd = os.getcwd()
    os.chdir(TOP)  # the provider reads `input` relative to the project, as the build does
    try:
        return regex.dynamic_metadata("version", provider)
    finally:
        os.chdir(cwd)


def daemon_version():
    root = harness.tempdir("ckpt-version-")
    d = harness.Daemon(root).start()
    try:
        version = d.ctl("status")["version"]
        assert d.stop() == 0, d.log()[-2000:]
        return version
    finally:
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


def pc_version():
    path = os.path.join(harness.BUILD, "cmake", "ckpt.pc")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return re.search(r"^Version: (\S+)$", f.read(), re.M).group(1)


def main():
    want = cmake_version()
    check(re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", want) is not None,
          "the project VERSION is MAJOR.MINOR.PATCH: %s" % want)
    got = {"pyproject.toml (wheel)": wheel_version(), "ckpt.__version__": ckpt.__version__,
           "ckptd Status": daemon_version()}
    pc = pc_version()
    if pc is not None:
        got["ckpt.pc"] = pc
    for what, version in got.items():
        check(version == want, "%s says %s, CMakeLists.txt %s" % (what, version, want))
    return 0


if __name__ == "__main__":
    sys.exit(main())
