"""A real Prometheus server (Debian's) scrapes a live ckptd with the shipped
scrape config and alert rules, while two training jobs run: the dashboard's
per-job queries return exactly one series per training job, keyed by
ckpt_job (a label named `job` arrives as exported_job and the panels go
empty). Exits 77 (skipped) when the prometheus binary is missing."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
DEPLOY = os.path.join(HERE, "..", "..", "deploy")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port, expr):
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (port, urllib.parse.urlencode({"query": expr}))
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def dashboard_queries():
    """The dashboard's queries that break series out per training job, with
    its variables set to match everything."""
    with open(os.path.join(DEPLOY, "grafana", "ckptd-dashboard.json")) as f:
        text = f.read()
    exprs = set()
    for e in re.findall(r'"expr": "((?:[^"\\]|\\.)*)"', text):
        e = json.loads('"%s"' % e)
        if "ckpt_layer_" in e:
            exprs.add(e.replace("$instance", ".*").replace("$ckpt_job", ".*"))
    return sorted(exprs)


def main():
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("skipping: no prometheus binary")
        return 77
    root = harness.tempdir("ckpt-prom-")
    procs = []
    d = None
    try:
        d = harness.Daemon(root).start()
        address = d.ctl("status")["metrics_address"]
        for job in ("alpha", "beta"):
            procs.append(subprocess.Popen(
                harness.trainer_cmd(d, job, "--layers=3", "--layer-bytes=16K", "--steps=1000000",
                                    "--compute-ms=20", "--quiet"),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        # The shipped config and rules; only the target and the intervals change.
        with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
            config = f.read()
        assert "'localhost:9464'" in config, "the shipped config changed shape"
        config = config.replace("'localhost:9464'", "'%s'" % address)
        config = re.sub(r"(scrape_interval|evaluation_interval): 15s", r"\1: 1s", config)
        config = config.replace("scrape_timeout: 10s", "scrape_timeout: 1s")
        with open(os.path.join(root, "prometheus.yml"), "w") as f:
            f.write(config)
        shutil.copy(os.path.join(DEPLOY, "prometheus", "ckptd-alerts.yml"), root)
        port = free_port()
        procs.append(subprocess.Popen(
            [prometheus, "--config.file=" + os.path.join(root, "prometheus.yml"),
             "--storage.tsdb.path=" + os.path.join(root, "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % port, "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, "prometheus.log"), "w")))

        exprs = dashboard_queries()
        assert len(exprs) >= 3, exprs
        per_job = 'max by (ckpt_job) (ckpt_layer_staleness_steps{instance=~".*"})'
        deadline = time.time() + 90
        result = []
        while time.time() < deadline:
            try:
                result = query(port, per_job)
            except OSError:
                result = []  # not listening yet
            if len(result) == 2:
                break
            time.sleep(0.5)  # a poll with a deadline
        jobs = sorted(r["metric"].get("ckpt_job", "") for r in result)
        assert jobs == ["alpha", "beta"], (result, open(os.path.join(root, "prometheus.log")).read())
        # The scrape job stays the target's; nothing was renamed.
        assert not query(port, "count({exported_job!=\"\"})"), "a label was renamed on scrape"
        assert query(port, 'up{job="ckptd"}')[0]["value"][1] == "1"
        for expr in exprs:
            series = query(port, expr)
            assert series, "dashboard query returns nothing: " + expr
            found = {s["metric"].get("ckpt_job") for s in series}
            assert found == {"alpha", "beta"}, (expr, found)
        print("prometheus %s: %d dashboard queries, each with series of ckpt_job alpha and beta"
              % (subprocess.run([prometheus, "--version"], capture_output=True,
                                text=True).stdout.split()[2], len(exprs)))
        return 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if d is not None:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
