"""A stand-in for a vLLM server: answers GET /health and GET /metrics (a captured real page)."""

from __future__ import annotations

from pathlib import Path

METRICS = Path(__file__).parent / "data" / "vllm_metrics.txt"
# Serves GET /health and GET /metrics (the captured real page) on the --port it is given.
FAKE_SERVER = f"""
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
body = open({str(METRICS)!r}, "rb").read()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        data = body if self.path == "/metrics" else b""
        self.send_response(200); self.end_headers(); self.wfile.write(data)
    def log_message(self, *a): pass
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""

