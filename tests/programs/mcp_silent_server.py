"""A program started as an MCP server that never speaks MCP: it writes its pid, then sleeps or exits.

    python mcp_silent_server.py PID_FILE [sleep|exit]
"""

import os
import sys
import time

with open(sys.argv[1], "w") as f:
    f.write(str(os.getpid()))
if sys.argv[2:] == ["exit"]:
    print("cannot start: no API key", file=sys.stderr)
    sys.exit(2)
time.sleep(600)
