"""Installs the build tree into a temporary prefix and uses it as an outside
user would. Standard library only.

  test_install.py BUILD_DIR SOURCE_DIR

  (a) cmake --install BUILD_DIR --prefix TMP, and the layout is checked;
  (b) tests/install/external is configured with find_package(ckpt CONFIG) and
      built, and the same main.cc is built with `pkg-config --cflags --libs ckpt`;
  (c) the installed sbin/ckptd is started on a temporary socket and data
      directory; both programs train a two-layer job against it and restore
      it in a new connection; the installed ckptctl reads the plan;
  (d) systemd-analyze verify passes on the installed unit, whose ExecStart
      runs the installed daemon and config;
  (e) /usr/bin/python3 imports the installed module `ckpt`;
  (f) a second install keeps an edited config; the installed install.sh
      --dry-run finds the installed files.
Every step has a timeout; the daemon is killed on any failure. The prefix is
removed on success and kept (its path printed) on failure.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402  (socket_accepts)

STEP_TIMEOUT = 240


def log(msg):
    print(msg, flush=True)


def run(cmd, timeout=STEP_TIMEOUT, env=None, cwd=None, check=True):
    log("$ " + " ".join(cmd))
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                         cwd=cwd)
    if check and out.returncode != 0:
        raise AssertionError("exit %d:\n%s%s" % (out.returncode, out.stdout, out.stderr))
    return out


def cache_vars(build):
    """The CMakeCache.txt entries of the build tree, name -> value."""
    values = {}
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            line = line.strip()
            if not line or line[0] in "#/" or "=" not in line or ":" not in line.split("=")[0]:
                continue
            key, value = line.split("=", 1)
            values[key.split(":")[0]] = value
    # GNUInstallDirs caches an empty DATADIR meaning "DATAROOTDIR".
    values["CMAKE_INSTALL_DATADIR"] = (values.get("CMAKE_INSTALL_DATADIR")
                                       or values.get("CMAKE_INSTALL_DATAROOTDIR") or "share")
    return values


def under(prefix, d):
    return d if os.path.isabs(d) else os.path.join(prefix, d)


class Daemon:
    def __init__(self, ckptd, root):
        self.socket = os.path.join(root, "run", "ckptd.sock")
        self.log_path = os.path.join(root, "ckptd.log")
        self.args = [ckptd, "--socket=" + self.socket, "--data_dir=" + os.path.join(root, "data"),
                     "--staging_pool_bytes=%d" % (64 << 20), "--staging_chunk_bytes=1048576",
                     "--shutdown_grace_ms=5000", "--metrics_address=127.0.0.1:0"]
        os.makedirs(os.path.dirname(self.socket), exist_ok=True)
        self.proc = None

    def start(self, timeout=60):
        log("$ " + " ".join(self.args))
        with open(self.log_path, "a") as f:
            self.proc = subprocess.Popen(self.args, stdout=f, stderr=f)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("ckptd exited with %d" % self.proc.returncode)
            if harness.socket_accepts(self.socket):
                return
            time.sleep(0.05)
        raise AssertionError("ckptd did not accept calls within %d s" % timeout)

    def stop(self, timeout=60):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("ckptd did not stop within %d s of SIGTERM" % timeout)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def log_text(self):
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError:
            return ""


def check_layout(prefix, c, have_python):
    """(a) Every installed piece is where the README says."""
    expect = [
        under(prefix, c["CMAKE_INSTALL_SBINDIR"]) + "/ckptd",
        under(prefix, c["CMAKE_INSTALL_BINDIR"]) + "/ckptctl",
        under(prefix, c["CMAKE_INSTALL_INCLUDEDIR"]) + "/ckpt/client.h",
        under(prefix, c["CMAKE_INSTALL_INCLUDEDIR"]) + "/ckpt/v1/ckpt.pb.h",
        under(prefix, c["CMAKE_INSTALL_LIBDIR"]) + "/cmake/ckpt/ckptConfig.cmake",
        under(prefix, c["CMAKE_INSTALL_LIBDIR"]) + "/cmake/ckpt/ckptConfigVersion.cmake",
        under(prefix, c["CMAKE_INSTALL_LIBDIR"]) + "/pkgconfig/ckpt.pc",
        under(prefix, c["CKPT_SYSTEMD_UNIT_DIR"]) + "/ckptd.service",
        under(prefix, c["CMAKE_INSTALL_SYSCONFDIR"]) + "/ckptd/ckptd.conf",
        under(prefix, c["CMAKE_INSTALL_DATADIR"]) + "/ckptd/ckptd.conf",
        under(prefix, c["CMAKE_INSTALL_DATADIR"]) + "/ckptd/prometheus/prometheus.yml",
        under(prefix, c["CMAKE_INSTALL_DATADIR"]) + "/ckptd/grafana/ckptd-dashboard.json",
        under(prefix, c["CMAKE_INSTALL_DATADIR"]) + "/ckptd/install.sh",
    ]
    for lib in ("ckpt_client", "ckpt_base", "ckpt_proto"):
        expect.append(under(prefix, c["CMAKE_INSTALL_LIBDIR"]) + "/lib%s.a" % lib)
    if have_python:
        expect.append(under(prefix, c["CKPT_PYTHON_INSTALL_DIR"]) + "/ckpt/__init__.py")
    missing = [p for p in expect if not os.path.exists(p)]
    if missing:
        raise AssertionError("not installed:\n  " + "\n  ".join(missing))
    log("layout: %d expected files present" % len(expect))


def build_consumers(source, prefix, work, c):
    """(b) The example program, once through CMake and once through pkg-config."""
    external = os.path.join(source, "tests", "install", "external")
    launcher = shutil.which("ccache")
    cmd = ["cmake", "-S", external, "-B", os.path.join(work, "cmake-build"),
           "-DCMAKE_PREFIX_PATH=" + prefix, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
           "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    if launcher:
        cmd.append("-DCMAKE_CXX_COMPILER_LAUNCHER=" + launcher)
    out = run(cmd)
    found = [l for l in out.stdout.splitlines() if "ckpt " in l and " from " in l]
    log("  " + (found[0].strip() if found else "(no ckpt line in the configure output)"))
    want = os.path.join(under(prefix, c["CMAKE_INSTALL_LIBDIR"]), "cmake", "ckpt")
    if not found or os.path.realpath(want) not in found[0] and want not in found[0]:
        raise AssertionError("find_package(ckpt) did not use %s:\n%s" % (want, out.stdout))
    run(["cmake", "--build", os.path.join(work, "cmake-build")])
    via_cmake = os.path.join(work, "cmake-build", "ckpt_consumer")

    pc_env = {"PKG_CONFIG_PATH": os.path.join(under(prefix, c["CMAKE_INSTALL_LIBDIR"]), "pkgconfig")}
    version = run(["pkg-config", "--modversion", "ckpt"], env=pc_env).stdout.strip()
    flags = run(["pkg-config", "--cflags", "--libs", "ckpt"], env=pc_env).stdout.split()
    log("  pkg-config ckpt %s" % version)
    via_pc = os.path.join(work, "ckpt_consumer_pc")
    cxx = os.environ.get("CXX", "c++")
    cmd = ([launcher] if launcher else []) + [cxx, "-std=c++17", "-O2",
                                              os.path.join(external, "main.cc"), "-o", via_pc]
    run(cmd + flags)
    return via_cmake, via_pc


def verify_unit(prefix, c, work):
    """(d) The installed unit runs the installed daemon and passes systemd-analyze."""
    unit = under(prefix, c["CKPT_SYSTEMD_UNIT_DIR"]) + "/ckptd.service"
    ckptd = under(prefix, c["CMAKE_INSTALL_SBINDIR"]) + "/ckptd"
    conf = under(prefix, c["CMAKE_INSTALL_SYSCONFDIR"]) + "/ckptd/ckptd.conf"
    with open(unit) as f:
        execs = [l.strip() for l in f if l.startswith("ExecStart=")]
    want = "ExecStart=%s --config=%s" % (ckptd, conf)
    if execs != [want]:
        raise AssertionError("%s: ExecStart lines %s, want [%s]" % (unit, execs, want))
    log("  " + want)
    tool = shutil.which("systemd-analyze")
    if tool is None:
        log("  SKIP systemd-analyze verify: systemd-analyze not installed")
        return
    # The unit's directory is read-only for a packaged install; verify from a
    # scratch directory so that nothing is written next to it.
    out = run([tool, "verify", unit], cwd=work, check=False, timeout=120)
    output = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or output:
        raise AssertionError("systemd-analyze verify %s exited %d:\n%s"
                             % (unit, out.returncode, output))
    log("  systemd-analyze verify: clean")


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    build, source = (os.path.abspath(a) for a in sys.argv[1:])
    c = cache_vars(build)
    have_python = bool(c.get("CKPT_PYTHON_INSTALL_DIR"))
    tmp = tempfile.mkdtemp(prefix="ckpt-install-", dir=os.environ.get("CKPT_TEST_TMP", "/tmp"))
    prefix = os.path.join(tmp, "prefix")
    daemon = None
    ok = False
    try:
        log("== (a) cmake --install into %s" % prefix)
        out = run(["cmake", "--install", build, "--prefix", prefix])
        log("  %d files installed" % sum(1 for l in out.stdout.splitlines() if "Installing:" in l))
        check_layout(prefix, c, have_python)

        log("== (b) an outside program against the installed client library")
        via_cmake, via_pc = build_consumers(source, prefix, tmp, c)

        log("== (c) the installed ckptd serves both programs")
        ckptd = under(prefix, c["CMAKE_INSTALL_SBINDIR"]) + "/ckptd"
        daemon = Daemon(ckptd, os.path.join(tmp, "daemon"))
        daemon.start()
        for exe, job in ((via_cmake, "install-cmake"), (via_pc, "install-pkgconfig")):
            out = run([exe, "--socket=" + daemon.socket, "--job=" + job], timeout=120,
                      check=False)
            for line in out.stdout.splitlines():
                log("  " + line)
            if out.returncode != 0:
                raise AssertionError("%s exited %d:\n%s" % (exe, out.returncode, out.stderr))
        ckptctl = under(prefix, c["CMAKE_INSTALL_BINDIR"]) + "/ckptctl"
        plan = json.loads(run([ckptctl, "--socket=" + daemon.socket, "--json", "--timeout=30",
                               "plan", "install-cmake"], timeout=60).stdout)
        log("  ckptctl plan install-cmake: %s" % json.dumps(plan, sort_keys=True)[:200])
        rc = daemon.stop()
        if rc != 0:
            raise AssertionError("ckptd exited %s on SIGTERM" % rc)
        log("  ckptd stopped cleanly")

        log("== (d) the installed systemd unit")
        verify_unit(prefix, c, tmp)

        log("== (e) the installed Python module")
        if not have_python:
            log("  SKIP: this build has no Python module")
        else:
            pydir = under(prefix, c["CKPT_PYTHON_INSTALL_DIR"])
            out = run(["/usr/bin/python3", "-c", "import ckpt, ckpt._ckpt; print(ckpt.__file__)"],
                      env={"PYTHONPATH": pydir, "PYTHONDONTWRITEBYTECODE": "1"}, cwd=tmp,
                      timeout=60)
            where = out.stdout.strip()
            if not where.startswith(pydir + "/"):
                raise AssertionError("imported ckpt from %s, not from %s" % (where, pydir))
            log("  import ckpt: %s" % where)

        log("== (f) reinstalling keeps an edited config; install.sh --dry-run")
        conf = under(prefix, c["CMAKE_INSTALL_SYSCONFDIR"]) + "/ckptd/ckptd.conf"
        with open(conf, "a") as f:
            f.write("\n# edited by the operator\n")
        with open(conf) as f:
            edited = f.read()
        out = run(["cmake", "--install", build, "--prefix", prefix])
        with open(conf) as f:
            if f.read() != edited:
                raise AssertionError("a second cmake --install overwrote the edited " + conf)
        log("  " + next(l.strip() for l in out.stdout.splitlines() if l.find("Keeping:") >= 0))
        # The installed copy finds its prefix from where it lies.
        out = run([under(prefix, c["CMAKE_INSTALL_DATADIR"]) + "/ckptd/install.sh", "--dry-run"],
                  timeout=60)
        for line in out.stdout.splitlines():
            log("  | " + line)
        if "conf  " + conf not in out.stdout:
            raise AssertionError("install.sh --dry-run did not find the installed config")
        ok = True
        log("PASS")
        return 0
    finally:
        if daemon is not None:
            daemon.kill()
            if not ok:
                log("ckptd log:\n" + daemon.log_text()[-4000:])
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log("FAIL; kept %s" % tmp)


if __name__ == "__main__":
    sys.exit(main())
