"""`pip install .` builds the Python client through CMake (pyproject.toml,
scikit-build-core): the wheel holds ckpt, the package ckpt.torch (every
module of python/ckpt/torch), ckpt.hf, the compiled module and its type
stubs; its version is the project's (CMakeLists.txt), in the wheel's name,
its installed metadata and ckpt.__version__; and the installed package (not
the build tree's) protects a training loop against a real ckptd: three
steps, then a restore in a new process gives back the weights and optimizer
state exactly.

Builds with the project's virtual environment (--no-build-isolation: its
scikit-build-core and pybind11), ccache when installed. Exits 77 when the
interpreter has no pip or no scikit-build-core.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(TOP, "tests", "integration"))
import harness  # noqa: E402

TRAIN = r'''
import importlib.metadata, json, sys, torch, ckpt
from ckpt import torch as ckpt_torch
assert ckpt.__file__.startswith(sys.argv[3]), ckpt.__file__
assert ckpt_torch.__file__.startswith(sys.argv[3]), ckpt_torch.__file__
print(json.dumps({"version": ckpt.__version__, "metadata": importlib.metadata.version("ckpt")}))
torch.manual_seed(int(sys.argv[4]))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
run = ckpt_torch.attach(model, opt, ckpt.Client(sys.argv[1]), job_id="pip")
if sys.argv[2] == "train":
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
    run.wait_durable()
else:
    print(json.dumps({"restored": run.restore().target_step}))
state = [t.tolist() for p in model.parameters()
         for t in [p] + [v for k, v in sorted(opt.state[p].items())]]
print(json.dumps({"state": state}))
run.close()
'''


def main():
    probe = subprocess.run([sys.executable, "-c", "import pip, scikit_build_core, pybind11"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print("skipping: no pip, scikit-build-core or pybind11 here: " + probe.stderr.strip())
        return 77
    root = harness.tempdir("ckpt-pip-")
    env = dict(os.environ)
    if shutil.which("ccache"):
        env.update(CMAKE_C_COMPILER_LAUNCHER="ccache", CMAKE_CXX_COMPILER_LAUNCHER="ccache",
                   CCACHE_BASEDIR=TOP, CCACHE_NOHASHDIR="true")
        env.setdefault("CCACHE_DIR", os.path.expanduser("~/.cache/ckpt-ccache"))
    env.pop("PYTHONPATH", None)  # the installed package, not the build tree's
    wheels = os.path.join(root, "wheels")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "--disable-pip-version-check", "-w", wheels, TOP],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = [os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl")]
    names = zipfile.ZipFile(wheel).namelist()
    package = ["ckpt/torch/" + n for n in sorted(os.listdir(os.path.join(TOP, "python", "ckpt",
                                                                         "torch")))
               if n.endswith(".py")]
    assert "ckpt/torch/__init__.py" in package, package
    for want in ["ckpt/__init__.py", "ckpt/hf.py", "ckpt/_ckpt.pyi", "ckpt/py.typed"] + package:
        assert want in names, (want, names)
    with open(os.path.join(TOP, "CMakeLists.txt")) as f:
        version = re.search(r"^project\(ckptd VERSION ([^ )]+)", f.read(), re.M).group(1)
    assert os.path.basename(wheel).startswith("ckpt-%s-" % version), (wheel, version)
    assert any(n.startswith("ckpt/_ckpt.") and n.endswith(".so") for n in names), names
    print("ok: %s holds %s" % (os.path.basename(wheel), sorted(names)))
    site = os.path.join(root, "site")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                        "--disable-pip-version-check", "--target", site, wheel],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    daemon = harness.Daemon(root).start()
    try:
        script = os.path.join(root, "train.py")
        with open(script, "w") as f:
            f.write(TRAIN)
        run_env = dict(env, PYTHONPATH=site)
        outs = []
        for mode, seed in (("train", 1), ("restore", 2)):
            p = subprocess.run([sys.executable, script, daemon.socket, mode, site, str(seed)],
                               capture_output=True, text=True, env=run_env, timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
            outs.append(p.stdout.strip().splitlines())
        want = '{"version": "%s", "metadata": "%s"}' % (version, version)
        assert outs[0][0] == want and outs[1][0] == want, (outs[0][0], want)
        print("ok: the installed package is version %s (ckpt.__version__ and its metadata)"
              % version)
        assert outs[1][1] == '{"restored": 3}', outs[1][1]
        assert outs[0][-1] == outs[1][-1], "the restored weights and state differ"
        print("ok: the installed package trained 3 steps and restored them exactly in a new "
              "process")
    finally:
        daemon.stop()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
