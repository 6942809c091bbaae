"""The README's metrics table is the one the code generates."""
import subprocess
import sys

ckptd, readme = sys.argv[1], sys.argv[2]
table = subprocess.run([ckptd, "--dump-metrics-table"], capture_output=True, text=True,
                       check=True).stdout
text = open(readme).read()
begin, end = "<!-- metrics-table:begin -->\n", "<!-- metrics-table:end -->"
block = text[text.index(begin) + len(begin):text.index(end)]
if block != table:
    print("README.md's metrics table is out of date; regenerate it from\n"
          "  build/daemon/ckptd --dump-metrics-table")
    sys.exit(1)
print("README metrics table matches (%d metrics)" % (table.count("\n") - 2))
