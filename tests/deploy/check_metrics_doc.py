"""docs/metrics.md's metrics table is the one the code generates.

Usage: check_metrics_doc.py CKPTD DOC
Compares the block between the metrics-table markers of DOC with the output of
`CKPTD --dump-metrics-table`; exits 1 when they differ.
"""
import subprocess
import sys

ckptd, doc = sys.argv[1], sys.argv[2]
table = subprocess.run([ckptd, "--dump-metrics-table"], capture_output=True, text=True,
                       check=True).stdout
text = open(doc).read()
begin, end = "<!-- metrics-table:begin -->\n", "<!-- metrics-table:end -->"
if begin not in text or end not in text:
    print("%s has no metrics-table markers" % doc)
    sys.exit(1)
block = text[text.index(begin) + len(begin):text.index(end)]
if block != table:
    print("%s's metrics table is out of date; regenerate it from\n"
          "  build/daemon/ckptd --dump-metrics-table" % doc)
    sys.exit(1)
print("%s: metrics table matches (%d metrics)" % (doc, table.count("\n") - 2))
