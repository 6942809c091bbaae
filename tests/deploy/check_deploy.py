"""Checks of the files under deploy/: the default config is in sync with the
binary, and the systemd unit passes `systemd-analyze verify` and stays within
an exposure budget of `systemd-analyze security`. Standard library only.

  check_deploy.py config-sync CKPTD CONF
  check_deploy.py systemd-verify CKPTD CONF UNIT
  check_deploy.py systemd-security CKPTD CONF UNIT [--max-exposure=3.0]

Exit codes: 0 pass, 1 fail, 77 skip (no systemd-analyze).
"""

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
# What the shipped unit names; the checks run a copy pointing at the build.
INSTALLED_CKPTD = "/usr/local/bin/ckptd"
INSTALLED_CONF = "/etc/ckptd/ckptd.conf"


def config_sync(ckptd, conf):
    out = subprocess.run([ckptd, "--dump-default-config"], capture_output=True, timeout=60)
    if out.returncode != 0:
        print("%s --dump-default-config exited %d:\n%s"
              % (ckptd, out.returncode, out.stderr.decode(errors="replace")))
        return 1
    with open(conf, "rb") as f:
        shipped = f.read()
    if out.stdout == shipped:
        print("%s matches `ckptd --dump-default-config`" % conf)
        return 0
    diff = difflib.unified_diff(
        shipped.decode(errors="replace").splitlines(keepends=True),
        out.stdout.decode(errors="replace").splitlines(keepends=True),
        fromfile=conf, tofile="ckptd --dump-default-config")
    sys.stdout.writelines(diff)
    print("\n%s is out of date with the option table. Regenerate it:\n"
          "  build/daemon/ckptd --dump-default-config > deploy/ckptd.conf" % conf)
    return 1


def quote(arg):
    return '"%s"' % arg if re.search(r"\s", arg) else arg


def test_unit_copy(unit, ckptd, conf, tmp):
    """Writes the unit to tmp with ExecStart on the built binary and config."""
    with open(unit) as f:
        text = f.read()
    lines = text.splitlines(keepends=True)
    exec_lines = [i for i, l in enumerate(lines) if l.startswith("ExecStart=")]
    if len(exec_lines) != 1:
        raise SystemExit("%s: expected one ExecStart= line, found %d" % (unit, len(exec_lines)))
    i = exec_lines[0]
    line = lines[i]
    for installed in (INSTALLED_CKPTD, INSTALLED_CONF):
        if installed not in line:
            raise SystemExit("%s: ExecStart= no longer names %s; update %s"
                             % (unit, installed, os.path.abspath(__file__)))
    line = line.replace(INSTALLED_CKPTD, quote(os.path.abspath(ckptd)))
    line = line.replace("--config=" + INSTALLED_CONF,
                        quote("--config=" + os.path.abspath(conf)))
    lines[i] = line
    path = os.path.join(tmp, os.path.basename(unit))
    with open(path, "w") as f:
        f.writelines(lines)
    print("testing a copy with " + line.strip())
    return path


def analyze():
    tool = shutil.which("systemd-analyze")
    if tool is None:
        print("SKIP: systemd-analyze not installed")
    return tool


def systemd_verify(tool, unit_copy):
    out = subprocess.run([tool, "verify", unit_copy], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(unit_copy))
    output = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or output:
        # verify exits 0 on unknown keys and bad values; any output is a finding.
        print("systemd-analyze verify exited %d with output:\n%s" % (out.returncode, output))
        return 1
    print("systemd-analyze verify: clean")
    return 0


def systemd_security(tool, unit_copy, max_exposure):
    out = subprocess.run([tool, "security", "--offline=true", "--no-pager", unit_copy],
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(unit_copy))
    output = out.stdout + out.stderr
    m = re.search(r"Overall exposure level for \S+: ([0-9]+(?:\.[0-9]+)?)", output)
    if m is None:
        if re.search(r"unrecognized option|Unknown option", output):
            print("SKIP: this systemd-analyze has no --offline\n" + output)
            return SKIP
        print("no exposure score in systemd-analyze security output (exit %d):\n%s"
              % (out.returncode, output))
        return 1
    score = float(m.group(1))
    print(m.group(0))
    if score > max_exposure:
        print(output)
        print("exposure %.1f is above the budget %.1f" % (score, max_exposure))
        return 1
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", choices=["config-sync", "systemd-verify", "systemd-security"])
    p.add_argument("ckptd")
    p.add_argument("conf")
    p.add_argument("unit", nargs="?")
    p.add_argument("--max-exposure", type=float, default=3.0)
    a = p.parse_args()
    if a.check == "config-sync":
        return config_sync(a.ckptd, a.conf)
    if a.unit is None:
        p.error("%s needs UNIT" % a.check)
    tool = analyze()
    if tool is None:
        return SKIP
    with tempfile.TemporaryDirectory(prefix="ckpt-unit-") as tmp:
        unit_copy = test_unit_copy(a.unit, a.ckptd, a.conf, tmp)
        if a.check == "systemd-verify":
            return systemd_verify(tool, unit_copy)
        return systemd_security(tool, unit_copy, a.max_exposure)


if __name__ == "__main__":
    sys.exit(main())
