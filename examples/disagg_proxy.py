"""A minimal router for disaggregated prefill over p2p_kv.

Each completion request goes to the prefiller first, with one output token
and ``kv_transfer_params: {"remote_decoder": {"kv_request_id": ID}}`` (a
fresh ID per request): the prefiller computes the prompt's KV and parks it
for a decoder naming ``ID``. Its response (``P2PKVConnector``) carries the
decode request's ``kv_transfer_params``, naming ``ID`` and where the blocks
wait; the proxy sends the original request to the decoder with them, and
returns the decoder's answer. The decoder loads the prompt's KV instead of
computing it.

    python examples/disagg_proxy.py --port 8200 \\
        --prefiller http://127.0.0.1:8100 --decoder http://127.0.0.1:8101

Standard library only; no streaming, one upstream call at a time per
request. A production router adds load balancing over many prefillers and
decoders, streaming and retries; the exchange with each engine is this one.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")}


class Proxy(BaseHTTPRequestHandler):
    prefiller = ""
    decoder = ""

    def do_POST(self) -> None:  # the http.server hook
        if self.path not in ROUTES:
            self.reply(404, {"error": f"no route {self.path}"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prefill = dict(body, max_tokens=1, stream=False)
        prefill.pop("max_completion_tokens", None)
        prefill["kv_transfer_params"] = {
            "remote_decoder": {"kv_request_id": f"proxy-{uuid.uuid4().hex}"}
        }
        status, out = post(self.prefiller + self.path, prefill)
        if status != 200:
            self.reply(status, {"error": "prefill failed", "prefiller": out})
            return
        leg = out.get("kv_transfer_params")
        if not leg:
            self.reply(
                502,
                {
                    "error": "the prefiller's response has no kv_transfer_params: "
                    'run it with "kv_connector": "P2PKVConnector", '
                    '"kv_connector_module_path": "p2p_kv.adapter.connector"'
                },
            )
            return
        status, out = post(self.decoder + self.path, dict(body, kv_transfer_params=leg))
        self.reply(status, out)

    def reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--prefiller", required=True, help="http://host:port")
    parser.add_argument("--decoder", required=True, help="http://host:port")
    args = parser.parse_args()
    Proxy.prefiller, Proxy.decoder = args.prefiller, args.decoder
    ThreadingHTTPServer(("127.0.0.1", args.port), Proxy).serve_forever()


if __name__ == "__main__":
    main()
