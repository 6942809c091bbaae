"""Symbolic links in ckptd's data directory are never followed.

1. Drift trace: a LayerCheck rank with --record-trace whose drift.jsonl has
   been replaced by a symbolic link to a file elsewhere. ckptd opened the
   trace with std::ofstream by path and appended to the link's target; now
   the registration fails naming the path and the target is untouched.
2. Start-up: two rank directories replaced by symbolic links (to copies of
   them). ckptd failed with a bare ELOOP ("open dir rank-00000000") and,
   under systemd's Restart=on-failure, restarted forever; then it named one
   path per start, so N links took N restarts to find. Now one start exits
   with 78 (listed in the unit's RestartPreventExitStatus=) and names both
   full paths; the linked data is untouched.
3. `ckptctl export --out=` through a link in the middle of the path is
   refused, naming it (export_through_links).
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import harness  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
LC = ["--layers=3", "--layer-bytes=32K", "--policy=layercheck", "--record-trace"]


def export_through_links(d, root):
    """3. `ckptctl export --out=` with a symbolic link in the middle of the
    path (in a directory another user could write): ckptctl created the
    directories through the link and wrote the export where it pointed. Now
    every component is opened without following a link and the export is
    refused, naming the link; a path without one works, its new directories
    private."""
    elsewhere = os.path.join(root, "elsewhere-dir")
    os.makedirs(elsewhere)
    shared = os.path.join(root, "shared")
    os.makedirs(shared)
    os.symlink(elsewhere, os.path.join(shared, "link"))
    p = d.ctl_raw("export", "sl", "--out=" + os.path.join(shared, "link", "sub"))
    print("export through an intermediate link: exit %d: %s" % (p.returncode, p.stderr.strip()))
    assert p.returncode != 0, p.stdout
    assert "symbolic link" in p.stderr and os.path.join(shared, "link") in p.stderr, p.stderr
    assert os.listdir(elsewhere) == [], "the export went through the link: %s" % os.listdir(elsewhere)
    out = os.path.join(shared, "a", "b")
    p = d.ctl_raw("export", "sl", "--out=" + out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert os.path.exists(os.path.join(out, "rank-00000.safetensors")), os.listdir(out)
    for made in (os.path.join(shared, "a"), out):
        assert os.stat(made).st_mode & 0o777 == 0o700, (made, oct(os.stat(made).st_mode))


def main():
    root = harness.tempdir("ckpt-symlink-")
    d = harness.Daemon(os.path.join(root, "d"), extra=["--gc_interval_s=0"])
    try:
        d.start()
        out = harness.run_trainer(d, "sl", "--steps=5", *LC)
        assert out.returncode == 0, out.stdout + out.stderr
        out = harness.run_trainer(d, "sl2", "--steps=2", *LC)
        assert out.returncode == 0, out.stdout + out.stderr
        rank_dir = os.path.join(d.data, "jobs", "sl", "rank-00000000")
        trace = os.path.join(rank_dir, "drift.jsonl")
        assert os.path.getsize(trace) > 0, "no drift trace was written"

        # 1. The drift trace through a planted link.
        target = os.path.join(root, "elsewhere.txt")
        with open(target, "w") as f:
            f.write("not ckptd's\n")
        os.unlink(trace)
        os.symlink(target, trace)
        out = harness.run_trainer(d, "sl", "--steps=3", *LC)
        with open(target) as f:
            written = f.read()
        print("drift trace through a link: trainer exit %d, link target %s" % (
            out.returncode, "untouched" if written == "not ckptd's\n" else "WRITTEN"))
        assert written == "not ckptd's\n", "ckptd wrote through the link: %r" % written[:200]
        assert out.returncode != 0, out.stdout
        assert "drift.jsonl" in out.stderr and "symbolic link" in out.stderr, out.stderr
        os.unlink(trace)
        export_through_links(d, root)
        assert d.stop() == 0, d.log()

        # 2. Two rank directories that are links.
        rank_dir2 = os.path.join(d.data, "jobs", "sl2", "rank-00000000")
        moved, moved2 = os.path.join(root, "rank-copy"), os.path.join(root, "rank-copy-2")
        shutil.move(rank_dir, moved)
        os.symlink(moved, rank_dir)
        shutil.move(rank_dir2, moved2)
        os.symlink(moved2, rank_dir2)
        try:
            d.start()
            raise AssertionError("ckptd started with a symbolic link in its data directory")
        except RuntimeError:
            pass
        log = d.log()
        lines = [l for l in log.splitlines() if "symbolic link" in l]
        print("start-up with two linked rank directories: exit %d; %s" % (
            d.proc.returncode, lines[-1] if lines else "(no line)"))
        assert d.proc.returncode == 78, (d.proc.returncode, log[-2000:])
        for path in (rank_dir, rank_dir2):
            assert any(path in l for l in lines), (path, log[-2000:])
        assert os.listdir(moved) and os.listdir(moved2), "a linked directory was emptied"
        with open(os.path.join(REPO, "deploy", "systemd", "ckptd.service")) as f:
            assert "RestartPreventExitStatus=78" in f.read()
        return 0
    finally:
        d.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
